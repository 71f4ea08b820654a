"""One engine behind both APIs: 64 streamed chats over HTTP and 64 over gRPC at once all complete, each
equal to the offline API's greedy answer, and every page is free afterwards."""

import asyncio

import grpc
import pytest

from jaxserve import SamplingParams
from jaxserve.client import Client
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from tests.support.openai_harness import CHAT_TEMPLATE, async_openai_client
from tests.support.server_harness import ServerProcess

NUM_EACH = 64
MAX_TOKENS = 12
QUESTIONS = [
    "def forward(self, x):",
    "Return a new dictionary",
    "import numpy as np",
    "class Cache:",
    "for i in range(10):",
    "The quick brown fox",
    "print('hello')",
    "while True:",
]


def conversation(index: int) -> list[dict]:
    return [
        {"role": "system", "content": f"Answer {index % 3 + 1} ways."},
        {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]},
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the offline engine's limits (SMALL_ENGINE), so both run the same compiled shapes
    process = ServerProcess(
        tmp_path_factory.mktemp("openai-both"), engine={"max_num_seqs": 8}, server={"chat_template": CHAT_TEMPLATE}
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


async def http_chat(client, index: int) -> tuple[list[int], str, str]:
    stream = await client.chat.completions.create(
        model="llama_gqa",
        messages=conversation(index),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    token_ids, text, finish_reason = [], "", None
    async for chunk in stream:
        choice = chunk.choices[0]
        token_ids += getattr(choice, "token_ids", None) or []
        text += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
    return token_ids, text, finish_reason


async def grpc_chat(stub, index: int) -> tuple[list[int], str, str]:
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(**m) for m in conversation(index)],
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    )
    token_ids, text, finish_reason = [], "", None
    async for response in stub.Chat(request):
        token_ids += response.token_ids
        text += response.text
        finish_reason = response.finish_reason or finish_reason
    return token_ids, text, finish_reason


async def both_at_once(server) -> tuple[list, list]:
    async with async_openai_client(server) as client, grpc.aio.insecure_channel(server.target) as channel:
        stub = jaxserve_pb2_grpc.GenerationStub(channel)
        calls = [http_chat(client, i) for i in range(NUM_EACH)] + [grpc_chat(stub, i) for i in range(NUM_EACH)]
        results = await asyncio.wait_for(asyncio.gather(*calls), timeout=400)
    return results[:NUM_EACH], results[NUM_EACH:]


def test_64_http_and_64_grpc_chats_at_once_equal_the_offline_answers(server, llama_llm):
    over_http, over_grpc = asyncio.run(both_at_once(server))
    offline = llama_llm.chat(
        [conversation(i) for i in range(NUM_EACH)],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        chat_template=CHAT_TEMPLATE,
    )
    for index, (http_answer, grpc_answer, expected) in enumerate(zip(over_http, over_grpc, offline)):
        answer = (expected.outputs[0].token_ids, expected.outputs[0].text, expected.outputs[0].finish_reason)
        assert http_answer == answer, index
        assert grpc_answer == answer, index
    assert server.metric("jaxserve_kv_pages_used") == 0 and server.metric("jaxserve_streams_in_flight") == 0
    info = Client(server.target).server_info()
    assert info.num_free_pages == info.num_pages and info.num_running == info.num_waiting == 0
