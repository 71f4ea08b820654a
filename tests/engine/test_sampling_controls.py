"""Sampling controls end to end on tiny-random (random weights, a real sentencepiece vocabulary of 384):
logit_bias, allowed_token_ids, bad_words and min_tokens change exactly the tokens they name, and the
bad ones are refused before anything is queued."""

import pytest

from jaxserve import SamplingParams
from tests.support.sampling_engines import assert_idle, greedy, tiny_random_llm, token_ids

PROMPT = [1, 275, 240]  # its greedy output holds single-token words ("b", "i", "t") and two-token ones
EOS = 2


@pytest.fixture(scope="module")
def llm():
    return tiny_random_llm()


@pytest.fixture(scope="module")
def plain(llm):
    """PROMPT's unconstrained greedy output, with the top-2 logprobs of each token."""
    return llm.generate([PROMPT], greedy(32, logprobs=2))[0].outputs[0]


def test_logit_bias_of_plus_100_makes_every_token_that_token(llm):
    target = 300
    biased = greedy(12, logit_bias={target: 100})
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, logit_bias={str(target): 100})
    results = llm.generate([PROMPT, PROMPT], [biased, sampled])
    assert results[0].outputs[0].token_ids == [target] * 12
    assert [o.token_ids for o in results[1].outputs] == [[target] * 12] * 3


def test_logit_bias_of_minus_100_moves_greedy_to_the_runner_up(llm, plain):
    first = plain.token_ids[0]
    runner_up = sorted(plain.logprobs[0].items(), key=lambda item: -item[1])[1][0]
    assert runner_up != first
    out = llm.generate([PROMPT], greedy(4, logit_bias={first: -100}, logprobs=2))[0].outputs[0]
    assert out.token_ids[0] == runner_up
    assert first not in out.token_ids
    # logprobs stay the model's: the runner-up's is the same as in the unbiased run
    assert out.logprobs[0][runner_up] == pytest.approx(plain.logprobs[0][runner_up], abs=1e-5)


def test_logit_bias_outside_the_vocabulary_or_too_many_entries_is_refused(llm):
    with pytest.raises(ValueError, match=r"logit_bias token ids \[384, 1000\] are outside the vocabulary"):
        llm.generate([PROMPT, PROMPT], [greedy(4), greedy(4, logit_bias={5: 1.0, 384: 1.0, 1000: -3.0})])
    max_entries = llm.engine.config.scheduler.max_bias_entries
    too_many = {token: 0.5 for token in range(3, 3 + max_entries + 1)}
    with pytest.raises(ValueError, match=rf"needs {max_entries + 1} biased tokens.*max_bias_entries \({max_entries}\)"):
        llm.generate([PROMPT], greedy(4, logit_bias=too_many))
    # min_tokens' ban of EOS counts too; at the cap a request is served
    at_cap = {token: 0.5 for token in range(3, 2 + max_entries)} | {300: 100}
    with pytest.raises(ValueError, match="max_bias_entries"):
        llm.generate([PROMPT], greedy(4, logit_bias=at_cap, min_tokens=1, ignore_eos=False))
    assert_idle(llm)
    assert token_ids(llm, [PROMPT], greedy(4, logit_bias=at_cap))[0] == [300] * 4


def test_allowed_token_ids_hold_greedy_and_sampled(llm, plain):
    allowed = [100, 101, 102, 259, 277, 310, 350]  # 'a' 'b' 'c' ' ' 'o' ',' '"'
    assert not set(plain.token_ids) <= set(allowed), "the constraint must change the output"
    results = llm.generate(
        [PROMPT, PROMPT],
        [
            greedy(24, allowed_token_ids=allowed),
            SamplingParams(max_tokens=24, temperature=1.0, seed=3, n=4, allowed_token_ids=allowed),
        ],
    )
    outputs = results[0].outputs + results[1].outputs
    for out in outputs:
        assert len(out.token_ids) == 24
        assert set(out.token_ids) <= set(allowed), out.token_ids
    assert len({tuple(out.token_ids) for out in results[1].outputs}) > 1, "sampled sequences should differ"


def single_token_words(llm, token_ids):
    """(index, word) for the tokens of token_ids that a bad word of their own text bans whole."""
    tokenizer = llm.get_tokenizer()
    found = []
    for index, token in enumerate(token_ids):
        word = tokenizer.decode([token])
        if word.strip() and [token] in encodings(tokenizer, word):
            found.append((index, word))
    return found


def two_token_words(llm, token_ids):
    """(index, word) for the token pairs of token_ids that a bad word of their text bans (by its second)."""
    tokenizer = llm.get_tokenizer()
    found = []
    for index in range(len(token_ids) - 1):
        pair = token_ids[index : index + 2]
        word = tokenizer.decode(pair)
        if word.strip() and pair in encodings(tokenizer, word):
            found.append((index, word))
    return found


def encodings(tokenizer, word):
    """How the model writes the word alone and after a space."""
    return [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word.lstrip())]


def contains(token_ids, word_ids):
    return any(token_ids[i : i + len(word_ids)] == word_ids for i in range(len(token_ids) - len(word_ids) + 1))


def test_single_token_bad_word_never_appears(llm, plain):
    index, word = single_token_words(llm, plain.token_ids)[0]
    banned = plain.token_ids[index]
    out = token_ids(llm, [PROMPT], greedy(32, bad_words=[word]))[0]
    assert out[:index] == plain.token_ids[:index]  # the same until the banned token would come
    assert banned not in out


@pytest.mark.parametrize("overlap_steps", [True, False])
def test_two_token_bad_word_never_appears(overlap_steps, plain):
    llm = tiny_random_llm(overlap_steps)
    index, word = two_token_words(llm, plain.token_ids)[0]
    first, second = plain.token_ids[index : index + 2]
    out = token_ids(llm, [PROMPT], greedy(32, bad_words=[word]))[0]
    # its first token stays (alone it is no bad word); the second is banned right after it
    assert out[: index + 1] == plain.token_ids[: index + 1]
    assert out[index + 1] != second
    for word_ids in encodings(llm.get_tokenizer(), word):
        assert not contains(out, word_ids), (word, word_ids, out)
    assert len(out) == 32


@pytest.mark.parametrize("stop", ["stop_token", "eos"])
def test_min_tokens_holds_back_a_pushed_up_stop(llm, stop):
    stop_token = 300 if stop == "stop_token" else EOS
    controls = dict(logit_bias={stop_token: 100}, ignore_eos=False)
    if stop == "stop_token":
        controls["stop_token_ids"] = [stop_token]
    without = llm.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.0, **controls))[0].outputs[0]
    assert without.token_ids == [stop_token] and without.finish_reason == "stop"
    results = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5, **controls),
            SamplingParams(max_tokens=20, temperature=1.0, seed=7, min_tokens=9, **controls),
            SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, **controls),
        ],
    )
    for result, min_tokens in zip(results[:2], (5, 9)):
        out = result.outputs[0]
        assert out.finish_reason == "stop"
        assert len(out.token_ids) == min_tokens + 1 and out.token_ids[-1] == stop_token
        assert stop_token not in out.token_ids[:-1]
    at_length = results[2].outputs[0]  # min_tokens == max_tokens: the stop never gets its turn
    assert (
        at_length.finish_reason == "length" and stop_token not in at_length.token_ids and len(at_length.token_ids) == 6
    )


def test_allowed_token_ids_that_bans_leave_empty_are_refused(llm):
    # "b" is token 265 alone: with 300 also allowed, only 300 is left
    assert token_ids(llm, [PROMPT], greedy(6, allowed_token_ids=[265, 300], bad_words=["b"]))[0] == [300] * 6
    # Nothing left: every logit would be -inf and the sampler's pick (token 0) no token the caller allowed.
    with pytest.raises(ValueError, match=r"allowed_token_ids leaves nothing to generate: bad_words ban"):
        llm.generate([PROMPT], greedy(6, allowed_token_ids=[265], bad_words=["b"]))
    with pytest.raises(
        ValueError, match=r"nothing to generate: bad_words and min_tokens \(EOS and stop tokens, for the first 3"
    ):
        llm.generate(
            [PROMPT], greedy(6, allowed_token_ids=[265, 300], bad_words=["b"], stop_token_ids=[300], min_tokens=3)
        )
    with pytest.raises(ValueError, match=r"nothing to generate: min_tokens"):
        llm.generate([PROMPT], greedy(6, allowed_token_ids=[EOS], min_tokens=1, ignore_eos=False))
    assert_idle(llm)
    # once min_tokens is met, EOS alone is what may follow
    out = llm.generate(
        [PROMPT], greedy(6, allowed_token_ids=[EOS, 300], min_tokens=2, ignore_eos=False, logit_bias={EOS: 50})
    )
    assert out[0].outputs[0].token_ids == [300, 300, EOS]


def test_bans_that_cover_every_allowed_token_end_the_request_without_noise(llm):
    # "t t" is two tokens: its second is banned only after its first, so the request is valid at admission,
    # and after one 261 the only allowed token is banned: the step has no token left to give.
    params = greedy(6, allowed_token_ids=[261], bad_words=["t t"])
    first = llm.engine.tokenizer.encode("t t", add_special_tokens=False)
    assert len(first) == 2 and first[0] == 261 and first[1] == 261
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == [261] and out.finish_reason == "no_token_allowed"
    assert_idle(llm)
