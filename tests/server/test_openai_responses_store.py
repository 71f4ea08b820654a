"""/v1/responses' store through the real openai client, on a server whose store holds 3 responses: a chain by
previous_response_id renders exactly the whole conversation sent as input (instructions not carried over, tool
calls included), retrieve and delete, the input items listed in pages, 404s naming the id, store false, the LRU bound, streamed responses stored as
response.completed is sent, failed and abandoned ones not stored. The store's byte bound is checked on its own."""

import json
import time
from http.client import HTTPConnection

import openai
import pytest

from jaxserve.server.config_file import ServerConfig
from jaxserve.server.openai.response_store import ResponseStore
from tests.server import test_chat_tool_stream
from tests.server.test_openai_responses import ASK, GREEDY, MODEL, WEATHER_TOOL, scripted_events, tool_call
from tests.server.test_openai_tools import TOOLS_TEMPLATE
from tests.support.openai_harness import error_of, http, openai_client
from tests.support.server_harness import ServerProcess

STORE_BOUND = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("responses_store"),
        engine={"max_num_seqs": 4, "max_model_len": 256},
        server={"chat_template": TOOLS_TEMPLATE, "responses_store_max_responses": STORE_BOUND},
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as client:
        yield client


def as_input(response) -> list[dict]:
    """A response's output items fed back as input, as clients without the store do."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_a_chain_renders_the_whole_conversation_without_the_earlier_instructions(client):
    first = client.responses.create(model=MODEL, input=ASK, instructions="Be brief.", **GREEDY)
    assert first.model_extra["store"] is True and first.previous_response_id is None  # store's default: true
    follow_up = "And in Lima?"
    second = client.responses.create(model=MODEL, input=follow_up, previous_response_id=first.id, **GREEDY)
    conversation = [{"role": "user", "content": ASK}, *as_input(first), {"role": "user", "content": follow_up}]
    whole = client.responses.create(model=MODEL, input=conversation, store=False, **GREEDY)
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == whole.output_text
    # a third turn continues the second's conversation, the first turn's included
    third = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_chained_tool_call_is_the_assistant_turn_before_its_output(client):
    first = client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER_TOOL], tool_choice="required", temperature=1.0, max_output_tokens=120
    )
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}
    options = {"model": MODEL, "tools": [WEATHER_TOOL], **GREEDY}
    second = client.responses.create(input=[result], previous_response_id=first.id, **options)
    whole = client.responses.create(input=[{"role": "user", "content": ASK}, *as_input(first), result], **options)
    assert second.usage.input_tokens == whole.usage.input_tokens and second.output_text == whole.output_text


def test_a_stored_response_is_retrieved_then_deleted(server, client):
    response = client.responses.create(model=MODEL, input=ASK, metadata={"turn": "1"}, **GREEDY)
    retrieved = client.responses.retrieve(response.id)
    assert retrieved.model_dump() == response.model_dump() and retrieved.metadata == {"turn": "1"}
    status, _, body = http(server, "DELETE", f"/v1/responses/{response.id}")
    assert status == 200 and json.loads(body) == {"id": response.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError, match=response.id):
        client.responses.retrieve(response.id)
    status, _, body = http(server, "DELETE", f"/v1/responses/{response.id}")
    assert status == 404 and error_of(body)["param"] == "response_id"
    kept = client.responses.create(model=MODEL, input=ASK, **GREEDY)
    client.responses.delete(kept.id)  # the client's own call
    assert http(server, "GET", f"/v1/responses/{kept.id}")[0] == 404


def test_an_unknown_previous_response_id_is_a_404_naming_it(server, client):
    with pytest.raises(openai.NotFoundError, match="resp_unknown"):
        client.responses.create(model=MODEL, input=ASK, previous_response_id="resp_unknown")
    status, _, body = http(server, "POST", "/v1/responses", {"input": ASK, "previous_response_id": "resp_x1"})
    error = error_of(body)
    assert status == 404 and error["param"] == "previous_response_id" and "resp_x1" in error["message"]
    with pytest.raises(openai.NotFoundError, match="resp_never"):
        client.responses.retrieve("resp_never")
    # a request that cannot be served is refused as such first
    refused = {"input": ASK, "previous_response_id": "resp_x1", "truncation": "auto"}
    status, _, body = http(server, "POST", "/v1/responses", refused)
    assert status == 400 and error_of(body)["param"] == "truncation"


def test_input_items_list_the_requests_own_input_in_pages(server, client):
    first = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2)
    [only] = client.responses.input_items.list(first.id).data  # a string input: one user message
    assert only.type == "message" and only.role == "user" and only.id.startswith("msg_")
    assert [part.model_dump(exclude_none=True) for part in only.content] == [{"type": "input_text", "text": ASK}]
    given = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "assistant", "content": "Hello.", "id": "msg_given"},
        {"role": "user", "content": [{"type": "input_text", "text": "Lima?"}, {"type": "input_text", "text": " Now."}]},
    ]
    second = client.responses.create(model=MODEL, input=given, previous_response_id=first.id, max_output_tokens=2)
    newest_first = client.responses.input_items.list(second.id).data  # its own input only, the last item first
    assert [(item.role, item.id == "msg_given") for item in newest_first] == [
        ("user", False),
        ("assistant", True),
        ("developer", False),
    ]
    assert [part.text for part in newest_first[0].content] == ["Lima?", " Now."]
    assert newest_first[1].content[0].type == "output_text" and newest_first[1].content[0].text == "Hello."
    # pages of one, in order, as the client's auto-pagination follows has_more and last_id
    paged = list(client.responses.input_items.list(second.id, limit=1, order="asc"))
    assert [item.id for item in paged] == [item.id for item in reversed(newest_first)]
    page = client.responses.input_items.list(second.id, limit=2, after=paged[0].id, order="asc")
    assert [item.id for item in page.data] == [paged[1].id, paged[2].id] and page.has_more is False
    # refusals name what is wrong; an id not stored is a 404
    for query, param in [("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=msg_no", "after")]:
        status, _, body = http(server, "GET", f"/v1/responses/{second.id}/input_items?{query}")
        assert status == 400 and error_of(body)["param"] == param, (query, body)
    with pytest.raises(openai.NotFoundError, match="resp_never"):
        client.responses.input_items.list("resp_never")


def test_store_false_keeps_nothing(client):
    response = client.responses.create(model=MODEL, input=ASK, store=False, **GREEDY)
    assert response.model_extra["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        client.responses.create(model=MODEL, input=ASK, previous_response_id=response.id)


def test_the_least_recently_used_is_evicted_past_the_bound(client):
    ids = [client.responses.create(model=MODEL, input=ASK, max_output_tokens=2).id for _ in range(STORE_BOUND)]
    client.responses.retrieve(ids[0])  # the oldest is now the most recently used
    newest = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2).id
    with pytest.raises(openai.NotFoundError, match=ids[1]):
        client.responses.retrieve(ids[1])
    with pytest.raises(openai.NotFoundError, match=ids[1]):
        client.responses.create(model=MODEL, input=ASK, previous_response_id=ids[1])
    assert [client.responses.retrieve(id_).id for id_ in (ids[0], ids[2], newest)] == [ids[0], ids[2], newest]


def test_a_streamed_response_is_stored_as_completed_is_sent(client):
    events = list(client.responses.create(model=MODEL, input=ASK, stream=True, **GREEDY))
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.model_extra["store"] is True
    assert client.responses.retrieve(completed.response.id).model_dump() == completed.response.model_dump()
    chained = client.responses.create(model=MODEL, input="More?", previous_response_id=completed.response.id, **GREEDY)
    assert chained.usage.input_tokens > completed.response.usage.input_tokens


def test_an_abandoned_stream_is_not_stored(server):
    aborted = 'jaxserve_requests_total{finish_reason="abort"}'
    aborted_before = server.metric(aborted, default=0.0)
    connection = HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 200, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.readline() == b"event: response.created\n"
    response_id = json.loads(response.readline().removeprefix(b"data: "))["response"]["id"]
    connection.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric(aborted, default=0.0) == aborted_before:
        time.sleep(0.05)
    assert server.metric(aborted) > aborted_before and http(server, "GET", f"/v1/responses/{response_id}")[0] == 404


def test_a_failed_stream_is_not_stored_and_a_completed_one_is():
    failed_call, failed = tool_call(test_chat_tool_stream.ScriptedGroup(["boom"], finish_reason="error"), True)
    done_call, done = tool_call(test_chat_tool_stream.ScriptedGroup(test_chat_tool_stream.PIECES), True)
    store = failed.store = done.store = ResponseStore()
    assert scripted_events(failed_call, failed)[-1].type == "response.failed" and len(store) == 0
    assert scripted_events(done_call, done)[-1].type == "response.completed" and len(store) == 1
    stored = store.get(done.id)
    assert stored is not None and stored.response["output"][1]["type"] == "function_call"


def entry(number: int, text: str = "x") -> tuple[dict, list[dict]]:
    return {"id": f"resp_{number}", "output": [text]}, [{"role": "user", "content": text}]


def test_the_byte_bound_evicts_the_oldest_and_refuses_an_entry_alone_over_it():
    stored = {"response": entry(0)[0], "conversation": entry(0)[1], "input_items": []}
    size = len(json.dumps(stored, separators=(",", ":")))
    store = ResponseStore(max_responses=100, max_bytes=2 * size)
    assert store.put(*entry(1)) and store.put(*entry(2)) and store.total_bytes == 2 * size
    assert store.put(*entry(3)) and store.get("resp_1") is None and len(store) == 2 and store.total_bytes == 2 * size
    assert not store.put(*entry(4, "y" * 3 * size)) and store.get("resp_4") is None and len(store) == 2
    assert store.delete("resp_2") and not store.delete("resp_2") and store.total_bytes == size
    copy = store.get("resp_3")
    assert copy is not None
    copy.conversation.append({"role": "user", "content": "changed"})  # a caller's copy, not the store's
    assert store.get("resp_3") == copy.__class__(*entry(3))
    off = ResponseStore(max_responses=0)
    assert not off.enabled and not off.put(*entry(1)) and len(off) == 0


def test_negative_store_bounds_are_refused():
    with pytest.raises(ValueError, match="responses_store_max_bytes"):
        ServerConfig(responses_store_max_bytes=-1)
