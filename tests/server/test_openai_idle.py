"""A streaming HTTP client that stops reading is cut off after server.stream_idle_timeout, as over gRPC:
its request aborted, its slot and pages freed, its connection closed, and the server serving others."""

import json
import socket
import time

import pytest

from tests.support.openai_harness import openai_client
from tests.support.server_harness import ServerProcess

IDLE_TIMEOUT = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # many large messages (n = 8, 380 logprobs per token: megabytes) so the socket buffers fill up
    process = ServerProcess(
        tmp_path_factory.mktemp("openai-idle"),
        engine={"max_num_seqs": 8, "max_logprobs": 380},
        server={"stream_idle_timeout": IDLE_TIMEOUT},
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


def test_a_client_that_stops_reading_is_cut_off(server):
    body = json.dumps(
        {
            "prompt": [1, 4, 4],
            "max_tokens": 120,
            "n": 8,
            "logprobs": 380,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends block
    client.connect(("127.0.0.1", server.http_port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (
            server.metric("jaxserve_idle_streams_expired_total", 0.0) >= 1
            and server.metric("jaxserve_streams_in_flight") == 0
        ):
            break
        time.sleep(0.2)
    assert server.metric("jaxserve_idle_streams_expired_total") == 1
    assert server.metric("jaxserve_streams_in_flight") == 0 and server.metric("jaxserve_kv_pages_used") == 0
    client.settimeout(30)
    while client.recv(1 << 16):  # what the buffers held, then the end: the server closed the connection
        pass
    client.close()
    log = server.read_log()
    # one line says what happened; the response task's cancellation is no error to trace back
    assert log.count("has not read") == 1 and "Traceback" not in log and "CancelledError" not in log, log
    with openai_client(server) as other:
        assert other.completions.create(model="llama_gqa", prompt=[1, 2], max_tokens=2).choices[0].finish_reason
