"""truncate_prompt_tokens through gRPC, the router and the disaggregated router: a prompt longer than max_model_len
is truncated before its length is checked (as over HTTP), and what is checked, routed and sent is the prompt the
replica uses."""

import threading
from types import SimpleNamespace

import pytest

from jaxserve import SamplingParams
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.router.http_api import RoutedLoop
from jaxserve.server.grpc_chat import checked_chat
from jaxserve.server.limits import RequestLimits
from jaxserve.server.service import checked_request

LIMITS = RequestLimits.for_engine(max_model_len=16, vocab_size=1000)
LONG = list(range(3, 43))  # 40 tokens, more than max_model_len


def test_grpc_truncates_a_long_token_id_prompt_before_checking_its_length():
    prompt, params = checked_request(
        LIMITS, pb.GenerateRequest(token_ids=LONG, sampling=pb.SamplingParams(truncate_prompt_tokens=5))
    )
    assert prompt == LONG[-5:] and params.truncate_prompt_tokens == 5
    prompt, _ = checked_request(
        LIMITS, pb.GenerateRequest(token_ids=LONG, sampling=pb.SamplingParams(truncate_prompt_tokens=-1))
    )
    assert prompt == LONG[-16:]
    with pytest.raises(ValueError, match="max_model_len"):  # without truncation: refused as before
        checked_request(LIMITS, pb.GenerateRequest(token_ids=LONG))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        checked_request(
            LIMITS, pb.GenerateRequest(token_ids=LONG, sampling=pb.SamplingParams(truncate_prompt_tokens=0))
        )


def test_grpc_chat_gives_the_rendered_conversations_last_tokens():
    from tests.loading.test_tokenizer import load

    tokenizer = load("llama_metaspace")
    limits = RequestLimits.for_engine(max_model_len=128, vocab_size=tokenizer.vocab_size)
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="a few words to render here")])
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"
    whole, _, _ = checked_chat(request, tokenizer, limits, template, "auto")
    request.sampling.truncate_prompt_tokens = 4
    cut, params, _ = checked_chat(request, tokenizer, limits, template, "auto")
    assert len(whole) > 4 and cut == whole[-4:] and params.truncate_prompt_tokens == 4


def test_the_router_http_loop_checks_and_counts_the_truncated_prompt():
    """A text prompt is tokenized by the router: its length check and the stream's prompt count are the
    truncated prompt's, and the forwarded token ids are those the replica uses."""
    sent, done = [], threading.Event()

    def generate(request, relay):
        sent.append(list(request.token_ids))
        done.set()
        return iter(())

    service = SimpleNamespace(
        max_in_flight=4, num_in_flight=0, draining=False, tokenize_prompt=lambda prompt: list(LONG), Generate=generate
    )
    loop = RoutedLoop(service, SimpleNamespace(model_name="m", max_model_len=16, max_num_seqs=4), None)
    stream = loop.submit("a long text", SamplingParams(max_tokens=4, truncate_prompt_tokens=6))
    assert stream.num_prompt_tokens == 6
    assert done.wait(10) and sent == [LONG[-6:]]
