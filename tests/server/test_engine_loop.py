"""The server's engine loop on a real engine (the llama_gqa fixture): a stream whose RPC ends always ends, also
when its request never reached the engine (a decode replica's handover reserving pages: its handler thread waited
on the stream forever and held the process's exit at SIGTERM)."""

import threading

from jaxserve.host.request import FinishReason, SamplingParams
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.responses import failure


def test_a_released_stream_ends_even_when_its_request_never_reached_the_engine(llama_llm):
    loop = EngineLoop(llama_llm.engine, ServerMetrics(), max_queued_requests=4)
    try:
        admitted = threading.Event()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        # admit holds the request outside the engine, as a handover's page reservation does
        stream = loop.submit([1, 5, 6, 7], params, "held", admit=lambda engine, stream, prompt: admitted.set())
        assert admitted.wait(30)
        messages: list = []
        reader = threading.Thread(target=lambda: messages.extend(stream), daemon=True)
        reader.start()
        loop.release(stream)  # the RPC is over
        reader.join(timeout=30)
        assert not reader.is_alive(), "the handler thread still waits on the stream"
        assert [m.finish_reason for m in messages] == [FinishReason.ABORT] and loop.num_in_flight == 0
        # and a request the engine runs still completes, and one released mid-way ends as an abort
        whole = list(loop.submit([1, 5, 6, 7], params, "whole"))
        assert whole[-1].finish_reason == FinishReason.LENGTH and sum(len(m.token_ids) for m in whole) == 4
    finally:
        loop.stop()


def test_inter_token_latency_is_timed_per_completion(llama_llm):
    """With n > 1 each step delivers one delta per completion: each completion's are timed against its own
    previous delta, not against another completion's of the same step (which made ITL ~n times too low)."""
    metrics = ServerMetrics()
    loop = EngineLoop(llama_llm.engine, metrics, max_queued_requests=4)
    try:
        n, max_tokens = 3, 6
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        messages = list(loop.submit([1, 5, 6, 7], params, "several"))
        assert sum(len(m.token_ids) for m in messages) == n * max_tokens
    finally:
        loop.stop()
    sample = metrics.registry.get_sample_value
    assert sample("jaxserve_time_to_first_token_seconds_count") == 1
    # one interval per token after each completion's first; same-step deltas of other completions are not one
    assert sample("jaxserve_inter_token_latency_seconds_count") == n * (max_tokens - 1)


def test_cut_off_all_ends_what_is_left_with_a_reason(llama_llm):
    """Past the drain timeout the server ends the requests still in flight through the loop: each stream ends as an
    abort carrying the message, marked cut_off (gRPC UNAVAILABLE, HTTP 503 / an SSE error event then [DONE])."""
    loop = EngineLoop(llama_llm.engine, ServerMetrics(), max_queued_requests=4)
    try:
        params = SamplingParams(n=2, max_tokens=100, temperature=1.0, seed=0, ignore_eos=True)
        held = loop.submit([1, 5, 6, 7], params, "held", admit=lambda engine, stream, prompt: None)
        messages: list = []
        reader = threading.Thread(target=lambda: messages.extend(held), daemon=True)
        reader.start()
        threading.Timer(0.5, loop.release, (held,)).start()  # its call ends once it has read its last messages
        loop.cut_off_all("the server is shutting down", timeout=10)
        reader.join(timeout=10)
        assert not reader.is_alive() and loop.num_in_flight == 0
        assert held.cut_off == "the server is shutting down" and held.error_status == 503
        assert [(m.finish_reason, m.text) for m in messages] == [
            (FinishReason.ABORT, "the server is shutting down")
        ] * 2
        assert failure(messages[0], held) == "the server is shutting down"
    finally:
        loop.stop()
