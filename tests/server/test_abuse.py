"""A real server against careless and hostile clients (issue #18): reused and colliding request ids,
streams nobody reads, oversized requests, malformed bytes. Every wait is bounded; loopback only."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from jaxserve.client import Client, build_request
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from tests.support.server_harness import ServerProcess

MAX_NUM_SEQS, MAX_QUEUED = 4, 4
MAX_IN_FLIGHT = MAX_NUM_SEQS + MAX_QUEUED
IDLE_TIMEOUT = 6.0
LIMITS = {
    "max_queued_requests": MAX_QUEUED,
    "stream_idle_timeout": IDLE_TIMEOUT,
    "max_stop_strings": 8,
    "max_stop_string_bytes": 256,
    "max_stop_token_ids": 16,
    "max_prompt_bytes": 4096,
    "max_id_length": 64,
}
# A client that reads nothing: a 1 KiB receive window that never grows, so the server's sends block.
UNREAD_CHANNEL_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("abuse"), engine={"max_num_seqs": MAX_NUM_SEQS}, server=LIMITS)
    process.wait_until_serving()
    yield process
    assert process.stop() == 0
    log = process.read_log()
    assert "Traceback" not in log and " ERROR " not in log, log


def wait_for(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def test_a_reused_request_id_never_aborts_another_request(server):
    results, errors = [], []

    def one_client():
        client = Client(server.target)
        try:
            for _ in range(8):
                completion = client.generate(
                    [1, 5, 9], max_tokens=6, temperature=0.0, ignore_eos=True, request_id="shared"
                )
                results.append((completion.finish_reason, len(completion.token_ids), completion.request_id))
        except grpc.RpcError as error:
            errors.append(error.code())
        finally:
            client.close()

    threads = [threading.Thread(target=one_client) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and len(results) == 24
    assert set(results) == {("length", 6, "shared")}


def test_server_made_ids_never_collide_with_client_ids(server):
    client = Client(server.target)
    held = [
        client.stream([1, 4, 4], max_tokens=100, temperature=0.0, ignore_eos=True, request_id=f"req-{i}")
        for i in range(5)
    ]
    try:
        for call in held:
            next(call)
        made = [client.generate([1, 2, 3], max_tokens=2, temperature=0.0) for _ in range(3)]
        assert [c.finish_reason for c in made] == ["length"] * 3
        ids = {c.request_id for c in made}
        assert len(ids) == 3 and not ids & {f"req-{i}" for i in range(5)}
    finally:
        for call in held:
            call.cancel()
        client.close()


def open_unread_stream(server):
    channel = server.new_channel(options=UNREAD_CHANNEL_OPTIONS)
    stub = jaxserve_pb2_grpc.GenerationStub(channel)
    request = build_request([1, 4, 4], max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=5)
    return channel, stub.Generate(request, timeout=60)


def test_unread_streams_hold_their_slots_until_expired_and_never_block_health(server):
    stub = jaxserve_pb2_grpc.GenerationStub(server.channel)

    def engine_idle() -> bool:
        info = stub.GetServerInfo(pb.ServerInfoRequest(), timeout=1)
        return info.num_running == 0 and info.num_waiting == 0

    opened = [open_unread_stream(server) for _ in range(4 * MAX_IN_FLIGHT)]
    calls = [call for _, call in opened]
    try:
        assert wait_for(lambda: sum(c.done() for c in calls) >= 3 * MAX_IN_FLIGHT, timeout=IDLE_TIMEOUT / 2)
        accepted = [c for c in calls if not c.done()]
        assert len(accepted) == MAX_IN_FLIGHT
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls if c.done())
        for _ in range(5):
            assert server.health(timeout=1) == health_pb2.HealthCheckResponse.SERVING
        # The engine finishes the accepted requests; their unread streams still hold their slots.
        assert wait_for(engine_idle, timeout=IDLE_TIMEOUT - 2)
        assert not any(c.done() for c in accepted)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(build_request([1, 2, 3], max_tokens=2), timeout=5))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Past stream_idle_timeout the stuck streams are cancelled and their slots freed (the clients
        # learn of it when they next read).
        assert wait_for(lambda: server.metric("jaxserve_streams_in_flight") == 0, timeout=IDLE_TIMEOUT + 15)
        assert server.metric("jaxserve_idle_streams_expired_total") == MAX_IN_FLIGHT
        assert Client(server.target).generate([1, 2, 3], max_tokens=2, temperature=0.0).finish_reason == "length"
        for call in accepted:
            with pytest.raises(grpc.RpcError) as error:
                list(call)
            assert error.value.code() == grpc.StatusCode.CANCELLED
    finally:
        for channel, call in opened:
            call.cancel()
            channel.close()
    assert wait_for(lambda: server.metric("jaxserve_kv_pages_used") == 0, timeout=10)


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        (dict(stop=[f"s{i}" for i in range(9)]), "server.max_stop_strings"),
        (dict(stop=["x" * 200, "y" * 200]), "server.max_stop_string_bytes"),
        (dict(stop_token_ids=list(range(17))), "server.max_stop_token_ids"),
        (dict(stop_token_ids=[-1]), "outside the vocabulary"),
        (dict(stop_token_ids=[10**9]), "outside the vocabulary"),
        (dict(prompt="\u00e9" * 2100), "server.max_prompt_bytes"),
        (dict(prompt="a" * 50_000), "server.max_prompt_bytes"),  # refused before it is parsed
        (dict(prompt=[1] * 129), "max_model_len"),
        (dict(request_id="r" * 65), "server.max_id_length"),
        (dict(session_id="s" * 65), "server.max_id_length"),
    ],
)
def test_oversized_requests_are_refused_with_the_limit_named(server, request_kwargs, message):
    stub = jaxserve_pb2_grpc.GenerationStub(server.channel)
    request_kwargs = {"prompt": [1, 2, 3], "max_tokens": 4, **request_kwargs}
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(build_request(**request_kwargs), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details()


@pytest.mark.parametrize(
    "request_kwargs",
    [
        dict(prompt="a" * 3_900_000),
        dict(prompt=[1, 2], stop_token_ids=[2] * 1_500_000),
        dict(prompt=[1, 2], stop=[f"never-{i:06d}" for i in range(200_000)]),
    ],
)
def test_a_request_over_max_message_bytes_is_refused_by_grpc(server, request_kwargs):
    # max_message_bytes is derived from the caps (64 KiB here): gRPC refuses before the server reads
    stub = jaxserve_pb2_grpc.GenerationStub(server.channel)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(build_request(max_tokens=4, **request_kwargs), timeout=10))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.value.details()


def _bad_utf8(message) -> bytes:
    data = message.SerializeToString()
    return data.replace(b"abc", b"a\xffc")


MALFORMED = [
    ("/jaxserve.v1.Generation/Generate", True, b"\xff\xff\xff\xff"),
    ("/jaxserve.v1.Generation/Generate", True, _bad_utf8(pb.GenerateRequest(text="abc"))),
    ("/jaxserve.v1.Generation/Tokenize", False, _bad_utf8(pb.TokenizeRequest(text="abc"))),
    ("/jaxserve.v1.Generation/GetServerInfo", False, b"\x0a\x05ab"),
    ("/grpc.health.v1.Health/Check", False, _bad_utf8(health_pb2.HealthCheckRequest(service="abc"))),
]


@pytest.mark.parametrize("method,streams,payload", MALFORMED)
def test_malformed_bytes_are_invalid_argument(server, method, streams, payload):
    with pytest.raises(grpc.RpcError) as error:
        if streams:
            list(server.channel.unary_stream(method)(payload, timeout=10))
        else:
            server.channel.unary_unary(method)(payload, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in error.value.details()
