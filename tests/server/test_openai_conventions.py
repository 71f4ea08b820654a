"""The OpenAI conventions a server is configured for: the names it serves the model under
(server.served_model_name, as vLLM's --served-model-name) and the browser origins it lets call it
(server.cors_allowed_origins), API keys and all."""

import pytest

from jaxserve.client import Connection
from tests.support.openai_harness import CHAT_TEMPLATE, error_of, http, openai_client
from tests.support.server_harness import ServerProcess

API_KEY = "conventions-key-31d0"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ALIASES = ["tiny-llama", "tiny-llama-latest"]
ORIGIN = "https://chat.example:8443"
SMALL = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("openai-conventions")
    (directory / "keys").write_text(API_KEY + "\n")
    process = ServerProcess(
        directory,
        engine={"max_num_seqs": 2},
        server={
            "api_keys": str(directory / "keys"),
            "served_model_name": ALIASES,
            "cors_allowed_origins": [ORIGIN],
            "chat_template": CHAT_TEMPLATE,
        },
        connection=Connection(api_key=API_KEY),
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, api_key=API_KEY) as client:
        yield client


def test_models_lists_the_served_names_primary_first(client):
    models = client.models.list().data
    assert [model.id for model in models] == ALIASES
    assert {model.model_extra["root"] for model in models} == {"llama_gqa"}  # the checkpoint behind them


@pytest.mark.parametrize("name", [*ALIASES, "llama_gqa", None])
def test_every_alias_and_the_checkpoint_name_are_accepted(server, client, name):
    """The checkpoint's name keeps working for clients written before the aliases; responses carry the
    primary name, as vLLM's do."""
    body = {**SMALL, **({"model": name} if name is not None else {})}
    status, _, answer = http(server, "POST", "/v1/completions", body, AUTH)
    assert status == 200, answer
    completion = client.chat.completions.create(
        model=name or ALIASES[1], messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert completion.model == ALIASES[0]


def test_an_unknown_name_is_404_listing_the_served_ones(server):
    status, _, answer = http(server, "POST", "/v1/completions", {**SMALL, "model": "tiny-llama-2"}, AUTH)
    error = error_of(answer)
    assert status == 404 and error["param"] == "model" and error["type"] == "NotFoundError"
    assert all(f"'{alias}'" in error["message"] for alias in ALIASES)


def test_a_browser_preflight_from_an_allowed_origin_needs_no_key(server):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = http(server, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, _ = http(
        server, "OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "https://x.example"}
    )
    assert status == 400 and "access-control-allow-origin" not in headers


def test_answers_and_refusals_carry_the_cors_headers(server):
    status, headers, _ = http(server, "POST", "/v1/completions", SMALL, {**AUTH, "Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    # the page must be able to read why it was refused
    status, headers, answer = http(server, "POST", "/v1/completions", SMALL, {"Origin": ORIGIN})
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN
    assert error_of(answer)["code"] == "invalid_api_key"
    status, headers, _ = http(server, "POST", "/v1/completions", SMALL, {**AUTH, "Origin": "https://x.example"})
    assert status == 200 and "access-control-allow-origin" not in headers
