"""lm-evaluation-harness against jaxserve: `python -m jaxserve.serve` started on a model, lm-eval's
`local-completions` model pointed at its HTTP API, the tiny local tasks in this folder run to the end;
with --peer-hf, lm-eval's `hf` model (transformers) on the same checkpoint and tasks beside it.

    .venv/bin/python bench/eval/run_lm_eval.py                      # the default model
    .venv/bin/python bench/eval/run_lm_eval.py --model tiny-random --limit 8
    # transformers' accuracy beside it: run from a venv with torch, transformers and lm-eval, the server
    # still from jaxserve's venv
    /path/to/hf-venv/bin/python bench/eval/run_lm_eval.py --server-python .venv/bin/python --peer-hf

Prints one JSON line per (model, task): accuracy (acc, acc_norm or exact_match) with its standard error.
lm-eval reads the tokenizer through the server's /tokenizer_info, /tokenize and /detokenize, so nothing
is downloaded. The default model is a GGUF file (jaxserve/loading/default_model.py); transformers
dequantizes the same file for the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TASKS = ["jaxserve_tiny_mc", "jaxserve_tiny_qa"]
METRICS = ("acc", "acc_norm", "exact_match")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, model: str, directory: str, engine: dict) -> tuple[subprocess.Popen, int]:
    http_port = free_port()
    config = {
        "model": {"path": model},
        "engine": {"show_progress": False, **engine},
        "server": {"host": "127.0.0.1", "port": free_port(), "metrics_port": free_port(), "http_port": http_port},
    }
    path = os.path.join(directory, "server.yaml")
    with open(path, "w") as f:
        json.dump(config, f)  # YAML is a superset of JSON
    log = open(os.path.join(directory, "server.log"), "w")
    process = subprocess.Popen([python, "-m", "jaxserve.serve", "--config", path], stdout=log, stderr=log, cwd=ROOT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as response:
                if response.status == 200:
                    return process, http_port
        except OSError:
            pass
        time.sleep(1)
    process.terminate()
    raise SystemExit("the server did not start serving in time")


def served_model_name(http_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def evaluate(model: str, model_args: dict, limit: int | None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=HERE),
        limit=limit,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
    )


def report(results: dict, peer: str, model: str) -> list[dict]:
    lines = []
    for task in TASKS:
        scores = results["results"][task]
        for key, value in scores.items():
            metric, _, filter_name = key.partition(",")
            if metric not in METRICS:
                continue
            line = {
                "bench": "lm_eval",
                "peer": peer,
                "model": model,
                "task": task,
                "metric": metric,
                "value": round(float(value), 4),
                "stderr": round(float(scores.get(f"{metric}_stderr,{filter_name}", float("nan"))), 4),
                "num_samples": len(results["samples"][task]),
            }
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


def hf_model_args(model: str, server_python: str, device: str) -> dict:
    """lm-eval's hf model on the same checkpoint: a Hugging Face directory, or a GGUF file transformers
    dequantizes. Named models are resolved by jaxserve's interpreter (this one may lack jaxserve)."""
    if model in ("default", "tiny-random"):
        code = f"from jaxserve.loading.default_model import resolve_model_path; print(resolve_model_path({model!r}))"
        model = subprocess.check_output([server_python, "-c", code], cwd=ROOT, text=True).strip().splitlines()[-1]
    if model.endswith(".gguf"):
        return {
            "pretrained": os.path.dirname(model),
            "gguf_file": os.path.basename(model),
            "dtype": "float32",
            "device": device,
        }
    return {"pretrained": model, "dtype": "float32", "device": device}


def run_jaxserve(args) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        engine = {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 256}
        process, http_port = start_server(args.server_python, args.model, directory, engine)
        try:
            model_args = {
                "base_url": f"http://127.0.0.1:{http_port}/v1/completions",
                "model": served_model_name(http_port),
                "num_concurrent": args.num_concurrent,
                "max_retries": 1,
                "max_length": engine["max_model_len"],
            }
            return evaluate("local-completions", model_args, args.limit)
        finally:
            process.terminate()
            process.wait(timeout=60)


def compare(ours: dict, theirs: dict) -> None:
    """Per item: the loglikelihoods' largest difference and how often both pick the same choice; how often
    the generated answers are the same text."""
    for task in TASKS:
        pairs = list(zip(ours["samples"][task], theirs["samples"][task]))
        line = {"bench": "lm_eval", "compare": "jaxserve vs transformers", "task": task, "num_samples": len(pairs)}
        if ours["results"][task].get("acc,none") is not None:
            scores = [([r[0] for r in a["filtered_resps"]], [r[0] for r in b["filtered_resps"]]) for a, b in pairs]
            line["max_abs_loglikelihood_difference"] = round(
                max(abs(x - y) for a, b in scores for x, y in zip(a, b)), 5
            )
            line["same_choice"] = sum(a.index(max(a)) == b.index(max(b)) for a, b in scores) / len(scores)
        else:
            line["same_text"] = sum(a["filtered_resps"] == b["filtered_resps"] for a, b in pairs) / len(pairs)
        print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="model.path: default, tiny-random, a directory or a .gguf")
    parser.add_argument("--server-python", default=sys.executable, help="the interpreter with jaxserve installed")
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    parser.add_argument("--num-concurrent", type=int, default=8, help="lm-eval's requests in flight")
    parser.add_argument("--peer-hf", action="store_true", help="also run lm-eval's hf model (needs torch)")
    parser.add_argument("--hf-device", default="cpu", help="where transformers runs (cpu, cuda)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    runs = {"jaxserve": lambda: run_jaxserve(args)}
    if args.peer_hf:
        runs["transformers"] = lambda: evaluate(
            "hf", hf_model_args(args.model, args.server_python, args.hf_device), args.limit
        )
    results = {}
    for peer, run in runs.items():
        started = time.perf_counter()
        results[peer] = run()
        report(results[peer], peer, args.model)
        print(json.dumps({"bench": "lm_eval", "peer": peer, "seconds": round(time.perf_counter() - started, 1)}))
    if args.peer_hf:
        compare(results["jaxserve"], results["transformers"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
