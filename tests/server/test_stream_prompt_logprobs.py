"""n > 1 with prompt_logprobs: the prompt's scores reach every completion, also one that is still prefilling
when the scoring sequence finishes the prompt (under load its chunk lands a step later). The step that completes
the scores carried them on that completion's empty delta, which the loop drops (nothing new for its client), so its
choice never got them: the HTTP API answered 500 "the engine returned no logprobs for the prompt's tokens"."""

from types import SimpleNamespace

from jaxserve.host.request import CompletionOutput, RequestOutput, SamplingParams
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.request_stream import RequestStream

PROMPT = [1, 5, 6, 7]
SCORED = [None, {5: -1.0}, {6: -2.0}, {7: -3.0}]


class IdleEngine:
    def describe(self):
        return SimpleNamespace(max_num_seqs=4)

    def stats(self):
        return {}

    def has_unfinished_requests(self):
        return False


def output(handle, first, second, scored):
    return RequestOutput(handle, None, PROMPT, [first, second], prompt_logprobs=scored)


def test_a_completion_behind_the_scoring_one_still_gets_the_prompt_logprobs():
    loop = EngineLoop(IdleEngine(), ServerMetrics(), max_queued_requests=4)
    try:
        params = SamplingParams(n=2, max_tokens=1, prompt_logprobs=0)
        stream = RequestStream("r#0", "r", params, len(PROMPT))  # as submit makes it, without a real engine
        loop.streams[stream.handle] = stream
        # the scoring sequence finishes the prompt and samples; the other is still prefilling
        loop._deliver(output("r#0", CompletionOutput(0, "a", [9], "length"), CompletionOutput(1, "", [], None), SCORED))
        loop._deliver(
            output("r#0", CompletionOutput(0, "a", [9], "length"), CompletionOutput(1, "b", [8], "length"), SCORED)
        )
        messages = [stream.take(timeout=1), stream.take(timeout=1)]
        by_index = {m.index: m for m in messages}
        assert set(by_index) == {0, 1}
        assert by_index[0].prompt_logprobs == SCORED
        assert by_index[1].prompt_logprobs == SCORED, "the second completion lost the prompt's logprobs"
        assert by_index[1].token_ids == [8]
    finally:
        loop.stop()
