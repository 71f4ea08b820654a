"""A real server process and real gRPC clients: streaming, cancellation, bad requests, health, metrics,
overload and graceful shutdown."""

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from jaxserve import LLM, SamplingParams
from jaxserve.client import Client, build_request
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.server.config_file import load_config
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir
from tests.support.server_harness import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # no compilation cache: warm-up then lasts long enough to watch health go NOT_SERVING -> SERVING
    process = ServerProcess(
        tmp_path_factory.mktemp("server"), engine={"max_num_seqs": 8, "compilation_cache_dir": None}
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


def test_health_goes_from_not_serving_to_serving(server):
    assert server.health_statuses[-1] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in server.health_statuses


def test_32_concurrent_streams_equal_transformers_greedy_output(server):
    prompts = expected("llama_gqa")["prompts"]
    jobs = [prompts[i % len(prompts)] for i in range(32)]
    results = [None] * len(jobs)

    def run(index):
        client = Client(server.target)
        messages = list(client.stream(jobs[index]["token_ids"], max_tokens=24, temperature=0.0))
        results[index] = messages
        client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    offline = LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE).generate(
        [job["token_ids"] for job in jobs], SamplingParams(max_tokens=24, temperature=0.0)
    )
    for job, messages, offline_output in zip(jobs, results, offline):
        tokens = [t for message in messages for t in message.token_ids]
        assert tokens == offline_output.outputs[0].token_ids == job["greedy_token_ids"]
        assert messages[-1].finish_reason in ("length", "stop")
        assert all(not m.finish_reason for m in messages[:-1]) and len(messages) > 1, "tokens arrive as a stream"
        assert messages[-1].num_prompt_tokens == len(job["token_ids"])


def test_text_prompts_logprobs_and_stop_strings(server):
    client = Client(server.target)
    full = client.generate("def forward(self, x):", max_tokens=12, temperature=0.0)
    assert full.text and full.num_prompt_tokens == len(client.tokenize("def forward(self, x):"))
    stop = full.text[3:5]
    stopped = client.generate("def forward(self, x):", max_tokens=12, temperature=0.0, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.index(stop)]
    assert stopped.stop_reason == stop and full.stop_reason is None
    stop_token = full.token_ids[2]
    by_token = client.generate("def forward(self, x):", max_tokens=12, temperature=0.0, stop_token_ids=[stop_token])
    assert by_token.stop_reason == stop_token
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    streamed = list(client.stream([1, 5, 9], max_tokens=3, temperature=0.0, logprobs=2))
    logprobs = [lp for message in streamed for lp in message.logprobs]
    assert len(logprobs) == 3 and all(lp.logprob <= 0 and len(lp.top) >= 2 for lp in logprobs)
    client.close()


def test_cancelled_stream_frees_its_pages(server):
    client = Client(server.target)
    call = client.stream([1] + [7] * 20, max_tokens=100, temperature=0.0, ignore_eos=True)
    next(call)
    next(call)
    aborted = 'jaxserve_requests_total{finish_reason="abort"}'
    aborted_before = server.metric(aborted, default=0.0)
    call.cancel()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.metric(aborted, default=0.0) > aborted_before and server.metric("jaxserve_kv_pages_used") == 0:
            break
        time.sleep(0.05)
    assert server.metric("jaxserve_kv_pages_used") == 0
    assert server.metric('jaxserve_requests_total{finish_reason="abort"}') > aborted_before
    info = client.server_info()
    assert info.num_free_pages == info.num_pages and info.num_running == 0
    client.close()


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        (dict(prompt=[1, 99999]), "outside the vocabulary"),
        (dict(prompt=[1] * 120, max_tokens=20), "max_model_len"),
        (dict(prompt=[1, 2], temperature=-1.0), "temperature"),
        (dict(prompt=[1, 2], top_p=0.0), "top_p"),
        (dict(prompt="", max_tokens=4), "exactly one"),
    ],
)
def test_bad_requests_get_invalid_argument(server, request_kwargs, message):
    stub = jaxserve_pb2_grpc.GenerationStub(server.channel)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(build_request(**request_kwargs)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()
    assert Client(server.target).generate([1, 2, 3], max_tokens=2, temperature=0.0).finish_reason == "length"


def test_both_text_and_token_ids_is_invalid(server):
    stub = jaxserve_pb2_grpc.GenerationStub(server.channel)
    request = build_request("hello", max_tokens=2)
    request.token_ids.extend([1, 2])
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_server_info_tokenize_detokenize(server):
    client = Client(server.target)
    info = client.server_info()
    assert info.page_size == 16 and info.max_model_len == 128 and info.dtype == "float32"
    assert info.num_pages > 0 and info.compiled_buckets and info.version
    token_ids = client.tokenize("Return a new dictionary")
    assert token_ids[0] == 1 and client.detokenize(token_ids) == "Return a new dictionary"
    with pytest.raises(grpc.RpcError) as error:
        client.detokenize([10**6])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.close()


def test_metrics_scrape(server):
    text = server.metrics()
    for name in (
        "jaxserve_requests_total",
        "jaxserve_running_requests",
        "jaxserve_waiting_requests",
        "jaxserve_kv_cache_usage_ratio",
        "jaxserve_prefix_cache_hit_rate",
        "jaxserve_prompt_tokens_total",
        "jaxserve_generation_tokens_total",
        "jaxserve_time_to_first_token_seconds_bucket",
        "jaxserve_inter_token_latency_seconds_bucket",
        "jaxserve_compiles_after_warmup",
        "jaxserve_preemptions",
    ):
        assert name in text, name
    assert server.metric("jaxserve_compiles_after_warmup") == 0
    assert "jaxserve_expert" not in text  # a dense model has no expert metrics


def test_expert_load_metrics_follow_the_engine_stats():
    from prometheus_client import generate_latest

    from jaxserve.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    stats = {
        "num_running": 1,
        "num_waiting": 0,
        "kv_pages_total": 10,
        "kv_pages_free": 4,
        "prefix_cache_hit_rate": 0.5,
        "num_compiles_after_warmup": 0,
        "num_preemptions": 0,
        "expert_load_max_over_mean": 1.75,
        "expert_device_tokens": [30, 10],
        "expert_device_imbalance": 1.5,
        "expert_rebalances": 2,
    }
    metrics.observe_engine(stats)
    text = generate_latest(metrics.registry).decode()
    for line in (
        'jaxserve_expert_device_tokens{device="0"} 30.0',
        'jaxserve_expert_device_tokens{device="1"} 10.0',
        "jaxserve_expert_device_imbalance 1.5",
        "jaxserve_expert_load_max_over_mean 1.75",
        "jaxserve_expert_rebalances 2.0",
        "jaxserve_kv_cache_usage_ratio 0.6",
    ):
        assert line in text, line


def test_overload_is_refused_and_sigterm_drains(tmp_path):
    server = ServerProcess(tmp_path, engine={"max_num_seqs": 2}, server={"max_queued_requests": 1})
    server.wait_until_serving()
    outcomes = []

    def run():
        client = Client(server.target)
        try:
            outcomes.append(client.generate([1, 4, 4], max_tokens=60, temperature=0.0, ignore_eos=True).finish_reason)
        except grpc.RpcError as error:
            outcomes.append(error.code())
        client.close()

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    server.process.send_signal(signal.SIGTERM)  # in-flight requests must still finish
    for thread in threads:
        thread.join(timeout=120)
    assert server.process.wait(timeout=60) == 0
    assert outcomes.count("length") >= 3, outcomes  # 2 running + 1 queued were accepted
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes
    assert set(outcomes) <= {"length", grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
    assert "stopped" in server.read_log()


def test_config_file_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  max_num_seq: 4\n")
    with pytest.raises(ValueError, match="engine.max_num_seq"):
        load_config(str(path))
    path.write_text("servers:\n  port: 1\n")
    with pytest.raises(ValueError, match="unknown config section 'servers'"):
        load_config(str(path))
    config = load_config(None, ["server.port=6000", "engine.max_num_seqs=3", "model.dtype=float32"])
    assert config.server.port == 6000 and config.engine.scheduler.max_num_seqs == 3 and config.engine.dtype == "float32"
    with pytest.raises(ValueError, match="unknown config key"):
        load_config(None, ["nope=1"])
    assert load_config("configs/default.yaml").model.path == "default"
