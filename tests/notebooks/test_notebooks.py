"""The notebooks in notebooks/ run top to bottom on CPU, as a user would run them, without a cell error.

Each test executes a copy of the committed notebook (committed with outputs cleared) in a fresh
kernel of this Python, with the repository root as its working directory. The quickstart is pointed at
the small random-weight fixture llama_gqa, so the test needs no download whatever the default model is.
"""

import os
import pathlib
import re
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT_SECONDS = 600


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def kernel_env(**extra: str) -> dict[str, str]:
    """This process's environment on CPU, without settings that would pre-empt the notebooks' own (the
    fake device count, the plotting backend: the kernel draws inline, as in Jupyter)."""
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS", "MPLBACKEND")}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def execute(name: str, env: dict[str, str]) -> float:
    notebook = read(name)
    client = NotebookClient(
        notebook, timeout=CELL_TIMEOUT_SECONDS, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    start = time.perf_counter()
    try:
        client.execute(env=env)
    except CellExecutionError as error:
        traceback = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # the kernel's colours
        pytest.fail(f"{name}: a cell failed\n{traceback}", pytrace=False)
    return time.perf_counter() - start


@pytest.mark.parametrize("name", ["quickstart.ipynb", "sharding.ipynb"])
def test_committed_without_outputs(name):
    notebook = read(name)
    nbformat.validate(notebook)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells), (
        f"{name} is committed with outputs: clear them (jupyter nbconvert --clear-output --inplace)"
    )


def test_quickstart_runs():
    seconds = execute("quickstart.ipynb", kernel_env(JAXSERVE_NOTEBOOK_MODEL=str(ROOT / "tests/fixtures/llama_gqa")))
    print(f"quickstart.ipynb: {seconds:.0f} s")


def test_sharding_runs():
    seconds = execute("sharding.ipynb", kernel_env())
    print(f"sharding.ipynb: {seconds:.0f} s")
