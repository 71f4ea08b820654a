"""SIGTERM and Ctrl-C on a real server process: during load and warm-up they stop it there (it used to warm up,
serve and only then drain), and a second signal exits at once whatever the first is still waiting for."""

import signal
import subprocess
import sys
import time

from tests.support.server_harness import ServerProcess


def wait_for_log(server: ServerProcess, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.read_log():
        assert server.process.poll() is None, f"server exited early:\n{server.read_log()}"
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.read_log()}"
        time.sleep(0.05)


def test_a_signal_during_warm_up_stops_the_server_there(tmp_path):
    # no compilation cache and many buckets: warm-up lasts seconds
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 128, "compilation_cache_dir": None}
    server = ServerProcess(tmp_path, engine=engine)
    try:
        wait_for_log(server, "warming up")
        time.sleep(0.3)
        server.process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert server.process.wait(timeout=30) == 0
        log = server.read_log()
        assert "stopped while starting" in log and " serving " not in log, log
        assert time.monotonic() - sent < 15, log
    finally:
        server.process.kill()
        server.stop()


# run_until_signalled in a process of its own (no JAX: it starts at once): start() prints "starting" and waits
# interruptibly, swallowing the first StopRequested as a garbage-collection callback would; stop() prints
# "stopping" and takes a minute.
PROGRAM = """
import sys, time
from jaxserve.server.process import StopRequested, run_until_signalled, signals_interrupt

def start():
    swallowed = False
    try:
        with signals_interrupt():
            print("starting", flush=True)
            while True:
                try:
                    time.sleep(0.01)
                except StopRequested:
                    if swallowed:
                        raise
                    swallowed = True
    except StopRequested:
        print("interrupted", flush=True)
    return "server"

def stop(server):
    print("stopping", flush=True)
    time.sleep(60)

sys.exit(run_until_signalled("test", start, stop))
"""


def test_start_up_is_interrupted_even_when_a_raise_is_swallowed_and_a_second_signal_exits_at_once():
    process = subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "starting\n"
        process.send_signal(signal.SIGTERM)
        assert process.stdout.readline() == "interrupted\n"  # raised again after the first was swallowed
        assert process.stdout.readline() == "stopping\n"
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 128 + signal.SIGINT
        assert time.monotonic() - sent < 5
    finally:
        process.kill()
        process.wait()
