"""The entry points' allocator settings (jaxserve/step_allocator.py): a CPU process re-executes itself once, the
same pid and command, with glibc's tunables; an accelerator's, or one with its own glibc.malloc tunables, does not."""

import json
import os
import subprocess
import sys

import pytest

from jaxserve.step_allocator import TUNABLES, wants_restart

PROBE = (
    "import json, os, sys\n"
    "from jaxserve.step_allocator import restart_with_step_allocator\n"
    "print(json.dumps([os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:]]), flush=True)\n"
    "restart_with_step_allocator()\n"
)


def run_probe(tmp_path, **environ):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"} | environ
    result = subprocess.run(
        [sys.executable, "-u", str(script), "a", "--b"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_a_cpu_process_restarts_once_with_the_tunables(tmp_path):
    if not wants_restart({"JAX_PLATFORMS": "cpu"}):
        assert os.confstr("CS_GNU_LIBC_VERSION") is None or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
        return
    first, second = run_probe(tmp_path, JAX_PLATFORMS="cpu")
    assert first[0] == second[0] and first[2] == second[2] == ["a", "--b"]
    assert first[1] is None and second[1] == ":".join(TUNABLES)


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
    assert len(runs) == 2 and runs[1][1] == ":".join(["glibc.cpu.x86_rep_movsb_threshold=4096", *TUNABLES])
