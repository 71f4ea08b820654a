"""An HTTP error's type is its status's name plus Error, as vLLM names them; 500's phrase ends in Error already."""

from jaxserve.server.openai.errors import error_body


def test_error_types_are_named_once():
    assert error_body(400, "m")["error"]["type"] == "BadRequestError"
    assert error_body(404, "m")["error"]["type"] == "NotFoundError"
    assert error_body(500, "m")["error"]["type"] == "InternalServerError"
    assert error_body(503, "m")["error"]["type"] == "ServiceUnavailableError"


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done():
    """A failure while making a stream's events (a server bug: a missing score raised APIError 500 in the
    completions stream) was a connection cut mid-body: clients saw a protocol error, not the reason."""
    import asyncio
    import json

    from jaxserve.server.openai.errors import APIError
    from jaxserve.server.openai.responses import DONE, ended_by_an_error_event, sse

    async def events(error):
        yield sse({"choices": [{"text": "a"}]})
        raise error

    async def gather(error):
        return [event async for event in ended_by_an_error_event(events(error))]

    for error, status, message in (
        (APIError(500, "the engine returned no logprobs"), 500, "the engine returned no logprobs"),
        (KeyError("x"), 500, "KeyError('x')"),
    ):
        sent = asyncio.run(gather(error))
        assert sent[0] == sse({"choices": [{"text": "a"}]}) and sent[-1] == DONE
        body = json.loads(sent[1].removeprefix("data: "))
        assert body["error"]["code"] == status and body["error"]["message"] == message
