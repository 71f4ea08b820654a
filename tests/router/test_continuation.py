"""What the disaggregated router sends again after a decode replica fails mid-stream (router/disaggregated.py):
the streamed tokens join the prompt and the budget counts them; what cannot resume exactly elsewhere is named."""

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.disaggregated import continuation, inexact_continuation


def test_a_continuation_counts_the_streamed_tokens_and_asks_no_prompt_logprobs_again():
    sampling = pb.SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0, prompt_logprobs=2)
    original = pb.GenerateRequest(request_id="r", token_ids=[1, 2, 3], sampling=sampling)
    assert continuation(original, []) is original
    following = continuation(original, [7, 8, 9])
    assert list(following.token_ids) == [1, 2, 3, 7, 8, 9] and following.sampling.max_tokens == 7
    assert following.sampling.min_tokens == 1 and not following.sampling.HasField("prompt_logprobs")
    assert continuation(original, [5] * 6).sampling.min_tokens == 0
    assert original.sampling.HasField("prompt_logprobs") and list(original.token_ids) == [1, 2, 3]  # left as it was


def test_grammars_and_output_penalties_are_named_as_not_resumable():
    assert inexact_continuation(pb.SamplingParams(temperature=0.0, repetition_penalty=1.3)) == ""
    guided = pb.SamplingParams(guided_decoding=pb.GuidedDecoding(regex="x{3}[a-z]+"))
    assert "guided decoding" in inexact_continuation(guided)
    assert "penalties" in inexact_continuation(pb.SamplingParams(frequency_penalty=0.5))
    assert "penalties" in inexact_continuation(pb.SamplingParams(presence_penalty=-0.5))


def test_a_continuation_of_a_truncated_prompt_is_not_truncated_again():
    """The router sends the prompt truncated (truncate_prompt_tokens): the continuation's prompt (that prompt and
    the streamed tokens) is cut no further, or it would lose the prompt's start and the client's count."""
    sampling = pb.SamplingParams(max_tokens=10, temperature=0.0, truncate_prompt_tokens=3)
    original = pb.GenerateRequest(request_id="r", token_ids=[4, 5, 6], sampling=sampling)
    following = continuation(original, [7, 8])
    assert list(following.token_ids) == [4, 5, 6, 7, 8] and not following.sampling.HasField("truncate_prompt_tokens")
