"""Constrained output and the sampling controls end to end (openai client, raw HTTP, gRPC) on a random
tiny model: its text is noise, so what comes back fits the constraint only because the engine's grammar
and masks made it; the refusals are 400 / INVALID_ARGUMENT naming the field, before anything is queued."""

import json
import re

import grpc
import pytest

from jaxserve.client import Client
from tests.support.openai_harness import CHAT_TEMPLATE, error_of, http, openai_client
from tests.support.server_harness import ServerProcess

PROMPT = "def forward(self, x):"
# llguidance's layout keyword: a random model would otherwise fill a reply with flexible whitespace
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(
        tmp_path_factory.mktemp("structured"), engine={"max_num_seqs": 4}, server={"chat_template": CHAT_TEMPLATE}
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as client:
        yield client


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"ok", "colour"} and isinstance(value["ok"], bool) and value["colour"] in ("red", "green")


@pytest.mark.parametrize("seed", [1, 2])
def test_response_format_json_schema_replies_fit_the_schema(client, seed):
    reply = client.chat.completions.create(
        model="llama_gqa",
        messages=[{"role": "user", "content": "colour?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
        temperature=1.0,
        seed=seed,
        max_tokens=60,
    )
    assert reply.choices[0].finish_reason == "stop"
    check_schema(reply.choices[0].message.content)


def test_guided_extras_on_completions(client):
    choice = client.completions.create(
        model="llama_gqa", prompt=PROMPT, max_tokens=10, seed=3, extra_body={"guided_choice": ["alpha", "beta"]}
    )
    assert choice.choices[0].text in ("alpha", "beta")
    regex = client.completions.create(
        model="llama_gqa", prompt=PROMPT, max_tokens=20, seed=4, extra_body={"guided_regex": "(yes|no)-[0-9]{3}"}
    )
    assert re.fullmatch("(yes|no)-[0-9]{3}", regex.choices[0].text), regex.choices[0].text
    structured = client.completions.create(
        model="llama_gqa", prompt=PROMPT, max_tokens=60, seed=5, extra_body={"structured_outputs": {"json": SCHEMA}}
    )
    check_schema(structured.choices[0].text)


@pytest.mark.parametrize("seed", [6, 7, 8])
def test_a_whitespace_pattern_lets_a_json_reply_hold_that_whitespace(server, client, seed):
    """vLLM's guided_whitespace_pattern (HTTP and gRPC): the reply fits the schema, and between its tokens holds
    only whitespace the pattern allows (no space, not three newlines; the compact default would put ", ")."""
    schema = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}  # the pattern sets the whitespace
    options = dict(model="llama_gqa", prompt=PROMPT, max_tokens=60, seed=seed)
    reply = client.completions.create(
        **options, extra_body={"guided_json": schema, "guided_whitespace_pattern": "\n{0,2}"}
    ).choices[0]
    check_schema(reply.text)
    over_grpc = Client(server.target).generate(
        PROMPT, max_tokens=60, seed=seed, temperature=1.0, guided_json=schema, guided_whitespace_pattern="\n{0,2}"
    )
    check_schema(over_grpc.text)
    for text in (reply.text, over_grpc.text):
        between_tokens = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # the strings' own text left out
        assert " " not in between_tokens and "\n\n\n" not in between_tokens, text


def generated_ids(client, **extra) -> list[int]:
    reply = client.completions.create(
        model="llama_gqa",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )
    return reply.choices[0].token_ids


def test_logit_bias_and_allowed_token_ids_steer_every_token(client):
    assert set(generated_ids(client, logit_bias={"42": 100})) == {42}
    assert set(generated_ids(client, allowed_token_ids=[7, 9])) <= {7, 9}
    banned = generated_ids(client)
    assert not set(generated_ids(client, logit_bias={str(t): -100 for t in banned})) & set(banned)


def test_a_presence_penalty_changes_a_repetitive_greedy_reply(client):
    plain = generated_ids(client)
    assert len(set(plain)) < len(plain)  # greedy noise repeats itself: the penalty has something to act on
    assert generated_ids(client, presence_penalty=2.0) != plain
    assert generated_ids(client, repetition_penalty=5.0) != plain


@pytest.mark.parametrize(
    "body,reason",
    [
        ({"logit_bias": {"99999": 1}}, "outside the vocabulary"),
        ({"logit_bias": {"5": 150}}, "[-100, 100]"),
        ({"allowed_token_ids": [10**6]}, "outside the vocabulary"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"guided_json": "{broken"}, "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give only one"),
        ({"min_tokens": 9}, "min_tokens"),
    ],
)
def test_bad_controls_are_400_naming_the_field(server, body, reason):
    request = {"model": "llama_gqa", "prompt": PROMPT, "max_tokens": 4, **body}
    status, _, answer = http(server, "POST", "/v1/completions", request)
    assert status == 400 and reason in error_of(answer)["message"], answer


def test_grpc_generate_takes_the_same_controls(server):
    client = Client(server.target)
    try:
        completion = client.generate(PROMPT, max_tokens=10, seed=6, guided_choice=["left", "right"])
        assert completion.text in ("left", "right") and completion.finish_reason == "stop"
        biased = client.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0})
        assert set(biased.token_ids) == {42}
        with pytest.raises(grpc.RpcError) as refusal:
            client.generate(PROMPT, max_tokens=4, logit_bias={99999: 1.0})
    finally:
        client.close()
    assert (
        refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in refusal.value.details()
    )


def test_the_sdks_parse_with_a_pydantic_model_validates(client):
    """What agent code does: `chat.completions.parse(response_format=PydanticModel)` (strict JSON schema
    from pydantic, no jaxserve-specific keys), sampled at temperature 1 on a noise model."""
    from typing import Literal

    import pydantic

    class Book(pydantic.BaseModel):
        title: str = pydantic.Field(max_length=12)
        year: int = pydantic.Field(ge=1000, le=2100)
        genre: Literal["poetry", "novel", "essay"]
        in_print: bool

    for seed in (1, 2, 3):
        reply = client.chat.completions.parse(
            model="llama_gqa",
            messages=[{"role": "user", "content": "a book, as JSON"}],
            response_format=Book,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Book)  # the SDK validated it against the model
        Book.model_validate_json(message.content)
