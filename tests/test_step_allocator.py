"""The entry points' allocator settings (jaxserve/step_allocator.py): a CPU process re-executes itself once, the
same pid and command, with glibc's tunables; an accelerator's, one with its own glibc.malloc tunables, a server
configured with `server.allocator: system`, or the offline CLI run with `--allocator system`, does not."""

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaxserve.server.config_file import load_config
from jaxserve.step_allocator import TUNABLES, configured_allocator, wants_restart

PROBE = (
    "import json, os, sys\n"
    "from jaxserve.step_allocator import restart_with_step_allocator\n"
    "print(json.dumps([os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:]]), flush=True)\n"
    "restart_with_step_allocator(server_argv=sys.argv[1:])\n"
)

CPU_GLIBC = wants_restart({"JAX_PLATFORMS": "cpu"})  # glibc (another C library: no restart ever)
RESTARTED = 2 if CPU_GLIBC else 1  # runs of a probe that restarts where it can


def run_probe(tmp_path, *args, **environ):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"} | environ
    result = subprocess.run(
        [sys.executable, "-u", str(script), *(args or ("a", "--b"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_a_cpu_process_restarts_once_with_the_tunables(tmp_path):
    runs = run_probe(tmp_path, JAX_PLATFORMS="cpu")
    assert len(runs) == RESTARTED and runs[0][1] is None
    if CPU_GLIBC:
        assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2] == ["a", "--b"]
        assert runs[1][1] == ":".join(TUNABLES)


def test_the_users_own_tunables_are_left_alone(tmp_path):
    (only,) = run_probe(tmp_path, JAX_PLATFORMS="cpu", GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    assert only[1] == "glibc.malloc.arena_max=4"


@pytest.mark.parametrize(
    "environ",
    [
        {"JAX_PLATFORMS": "cuda"},
        {"JAX_PLATFORMS": "tpu,cpu"},
        {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    ],
)
def test_no_restart_on_an_accelerator_or_with_malloc_tunables_set(environ):
    assert not wants_restart(environ)


def test_other_tunables_are_kept_beside_ours(tmp_path):
    runs = run_probe(tmp_path, JAX_PLATFORMS="cpu", GLIBC_TUNABLES="glibc.cpu.x86_rep_movsb_threshold=4096")
    assert len(runs) == RESTARTED
    if CPU_GLIBC:
        assert runs[1][1] == ":".join(["glibc.cpu.x86_rep_movsb_threshold=4096", *TUNABLES])


def write_config(tmp_path, text):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_the_server_config_chooses_the_allocator(tmp_path):
    system = write_config(tmp_path, "model: {path: tiny-random}\nserver: {allocator: system, port: 50052}\n")
    assert configured_allocator(["--config", system]) == "system"
    assert configured_allocator(["--set", "server.allocator=system"]) == "system"
    assert configured_allocator(["--config", system, "--set", "server.allocator=glibc-step"]) == "glibc-step"
    assert configured_allocator([]) == "glibc-step"
    assert load_config(system).server.allocator == "system"


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "/nonexistent/serve.yaml"],
        ["--set", "server.allocator=jemalloc"],
        ["--set", "nosuchsection.key=1"],
        ["--config"],
    ],
)
def test_a_config_that_does_not_read_leaves_the_default_and_the_server_names_the_error(argv):
    assert configured_allocator(argv) == "glibc-step"


def test_an_unknown_allocator_is_refused_by_name():
    with pytest.raises(ValueError, match="server.allocator must be one of glibc-step, system, got 'jemalloc'"):
        load_config(None, ["server.allocator=jemalloc"])


def test_allocator_system_keeps_the_process_from_restarting(tmp_path):
    system = write_config(tmp_path, "server: {allocator: system}\n")
    (only,) = run_probe(tmp_path, "--config", system, JAX_PLATFORMS="cpu")
    assert only[1] is None and only[2] == ["--config", system]
    runs = run_probe(tmp_path, "--config", system, "--set", "server.allocator=glibc-step", JAX_PLATFORMS="cpu")
    assert len(runs) == RESTARTED


def counting_starts(tmp_path) -> dict[str, str]:
    """An environment (JAX_PLATFORMS=cpu, no GLIBC_TUNABLES) whose sitecustomize appends each interpreter start's
    GLIBC_TUNABLES to tmp_path / "starts"."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        f"with open({str(tmp_path / 'starts')!r}, 'a') as starts:\n"
        "    starts.write(repr(os.environ.get('GLIBC_TUNABLES')) + '\\n')\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    return env | {
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
    }


def test_the_server_entry_point_reads_the_allocator_before_restarting(tmp_path):
    """`python -m jaxserve.serve` itself: a sitecustomize records each interpreter start's GLIBC_TUNABLES; a
    bad port stops the server right after its config loads, before any engine."""
    env = counting_starts(tmp_path)
    for allocator, starts in (("system", ["None"]), ("glibc-step", ["None", repr(":".join(TUNABLES))])):
        (tmp_path / "starts").unlink(missing_ok=True)
        command = [sys.executable, "-m", "jaxserve.serve", "--set", f"server.allocator={allocator}"]
        result = subprocess.run(
            [*command, "--set", "server.port=-1"], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode != 0 and "server.port must be" in result.stderr, result.stderr[-2000:]
        assert (tmp_path / "starts").read_text().splitlines() == starts[:RESTARTED]


def test_the_offline_cli_reads_its_allocator_option_before_restarting(tmp_path):
    """`python -m jaxserve --allocator system` starts once; a bad --max-tokens stops the CLI right after its parser,
    before any engine. An unknown allocator restarts as the default and is then refused by name."""
    env = counting_starts(tmp_path)
    cases = (
        ("system", ["None"], "--max-tokens: invalid int value"),
        ("glibc-step", ["None", repr(":".join(TUNABLES))], "--max-tokens: invalid int value"),
        ("jemalloc", ["None", repr(":".join(TUNABLES))], "--allocator: invalid choice: 'jemalloc'"),
    )
    for allocator, starts, error in cases:
        (tmp_path / "starts").unlink(missing_ok=True)
        command = [sys.executable, "-m", "jaxserve", "tiny-random", "--allocator", allocator, "--max-tokens", "x"]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and error in result.stderr, result.stderr[-2000:]
        assert (tmp_path / "starts").read_text().splitlines() == starts[:RESTARTED]


def test_a_config_that_is_not_a_regular_file_is_left_for_the_server_to_read(tmp_path):
    """A pipe (`--config <(...)`) reads once: the early look must leave it to the server's own load."""
    fifo = str(tmp_path / "config.fifo")
    os.mkfifo(fifo)

    def write():
        with contextlib.suppress(BrokenPipeError):  # the release below opens and closes without reading
            Path(fifo).write_text("server: {allocator: system}\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        assert configured_allocator(["--config", fifo]) == "glibc-step"
    finally:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # lets the writer through either way
        writer.join(timeout=10)
    assert configured_allocator(["--config", fifo, "--set", "server.allocator=system"]) == "system"


def test_the_early_read_imports_nothing_heavy_and_reports_nothing():
    """Before the restart: no JAX, numpy or gRPC (the restart would pay for them twice), and a bad command line
    is left for the server's parser to report once."""
    code = (
        "import sys\n"
        "from jaxserve.step_allocator import configured_allocator\n"
        "assert configured_allocator(['--config']) == 'glibc-step'\n"
        "assert configured_allocator(['--set', 'server.allocator=system']) == 'system'\n"
        "print(sorted(name for name in ('jax', 'numpy', 'grpc') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]" and result.stderr == "", result
