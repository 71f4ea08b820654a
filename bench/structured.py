"""Structured output's cost: generated tokens/s with a JSON schema on every request vs none, at batch 1 and
32, in jaxserve and in llama.cpp's server (its `json_schema` field), same model file, same run.

    .venv/bin/python bench/structured.py [--precision f32] [--items 4] [--batch 32] [--single-requests 3]
        [--engines jaxserve,jaxserve-ngram,jaxserve-draft,llamacpp]

The default model (SmolLM2-135M-Instruct) as vs_llamacpp.py serves it: its GGUF dequantized to F32 (or
BF16) by llama-quantize, the same file loaded by both engines, 2 threads each (llama.cpp: -t 2; jaxserve
pinned to 2 cores). Every request is a chat prompt (one topic per request, rendered once with the model's
template and sent to both engines as the same token ids) asking for a catalogue of --items books; greedy.

  constrained    the schema below on every request (jaxserve: GuidedDecodingParams(json=...); llama.cpp:
                 /completion with "json_schema"). The reply's length is set by the schema and the model:
                 exactly --items objects of six bounded fields; the request ends at EOS once the JSON is
                 complete (--max-tokens caps it; a reply cut there is counted invalid).
  unconstrained  the same prompts, no schema, EOS ignored, each request's length its own engine's
                 constrained reply length (so both modes generate the same number of tokens).

batch 1: --single-requests requests one after another; batch --batch: that many requests at once
(jaxserve: one LLM.generate, max_num_seqs = --batch; llama.cpp: llama-server -np --batch -cb). Rates are
generated tokens over wall time, prompt processing included. Every constrained reply is parsed as JSON and
validated against the schema (jsonschema); the fraction is reported per engine. jaxserve's host cost per
step over each measured run comes from its device clock (stats()' host_seconds_per_step,
device_idle_seconds_per_step, taken as differences over the run). The grammar is compiled in a warm-up
request first (jaxserve caches compiled grammars per schema; llama.cpp converts the schema per request).

`--engines jaxserve-ngram` adds jaxserve with prompt-lookup speculation (speculative: {method: ngram}, its
adaptive policy), `jaxserve-draft` with the model's own int8 copy as a draft: a schema's keys and punctuation
are forced tokens, proposed and verified in one step (engine/speculation.py), so the constrained rows take
fewer steps than tokens.

Prints JSON lines (one per engine x mode x batch), then the ratios: jaxserve constrained/unconstrained per
batch (goal > 0.9 at batch 32) and jaxserve constrained / llama.cpp constrained (goal > 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_peer as peer  # noqa: E402
from vs_llamacpp import CACHE_DIR, DTYPES, emit, model_files, pin_threads  # noqa: E402

TOPICS = (
    "sailing", "astronomy", "baking", "chess", "gardening", "medieval history", "jazz", "mountaineering",
    "beekeeping", "photography", "robotics", "poetry", "volcanoes", "ancient Rome", "birdwatching", "cycling",
    "architecture", "mathematics", "cooking with rice", "the ocean", "trains", "painting", "chemistry", "forests",
    "philosophy", "knitting", "space travel", "the desert", "music theory", "coffee", "islands", "detectives",
)  # fmt: skip
GENRES = ["fiction", "history", "science", "biography", "poetry", "travel", "cooking", "children"]


def catalogue_schema(items: int) -> dict:
    book = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
            "genre": {"type": "string", "enum": GENRES},
            "pages": {"type": "integer", "minimum": 10, "maximum": 2000},
            "in_print": {"type": "boolean"},
        },
        "required": ["title", "author", "year", "genre", "pages", "in_print"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"books": {"type": "array", "items": book, "minItems": items, "maxItems": items}},
        "required": ["books"],
        "additionalProperties": False,
    }


def prompt_messages(topic: str, items: int) -> list[dict]:
    return [
        {
            "role": "user",
            "content": f'List {items} books about {topic} as JSON: an object with a key "books", a list of objects '
            'with "title", "author", "year", "genre", "pages" and "in_print".',
        }
    ]


def validity(texts: list[str], schema: dict) -> dict:
    """How many replies parse as JSON, and how many of those validate against the schema."""
    parsed = valid = 0
    for text in texts:
        try:
            document = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        try:
            jsonschema.validate(document, schema)
            valid += 1
        except jsonschema.ValidationError:
            pass
    return dict(parses=f"{parsed}/{len(texts)}", validates=f"{valid}/{len(texts)}", valid_fraction=valid / len(texts))


class Jaxserve:
    def __init__(
        self, path: str, dtype: str, batch: int, max_tokens: int, prompt_tokens: int, speculative: dict | None = None
    ):
        from jaxserve import LLM, SamplingParams
        from jaxserve.host.request import GuidedDecodingParams

        self.SamplingParams, self.GuidedDecodingParams = SamplingParams, GuidedDecodingParams
        self.llm = LLM(
            path,
            dtype=dtype,
            max_model_len=prompt_tokens + max_tokens + 16,
            max_num_seqs=batch,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,  # as llama.cpp's cache_prompt=False: every run prefills its prompts
            show_progress=False,
            **({"speculative": speculative} if speculative else {}),
        )

    def params(self, schema: dict | None, max_tokens: int):
        if schema is None:
            return self.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        guided = self.GuidedDecodingParams(json=schema)
        return self.SamplingParams(max_tokens=max_tokens, temperature=0.0, guided_decoding=guided)

    def run(self, prompts, schema, lengths, at_once: bool):
        """(texts, token counts, seconds, host clock over the run)."""
        clock = self.llm.engine.device_clock
        before = (clock.host_seconds, clock.idle_seconds, clock.num_steps)
        params = [self.params(schema, n) for n in lengths]
        groups = [(prompts, params)] if at_once else [([p], [q]) for p, q in zip(prompts, params)]
        outputs, start = [], time.perf_counter()
        for group_prompts, group_params in groups:
            outputs += self.llm.generate(group_prompts, group_params, use_tqdm=False)
        seconds = time.perf_counter() - start
        time.sleep(0.2)  # the device clock's watcher thread finishes the last step's accounting
        steps = max(clock.num_steps - before[2], 1)
        host = dict(
            num_steps=clock.num_steps - before[2],
            host_seconds_per_step=round((clock.host_seconds - before[0]) / steps, 6),
            device_idle_seconds_per_step=round((clock.idle_seconds - before[1]) / steps, 6),
        )
        completions = [o.outputs[0] for o in outputs]
        return [c.text for c in completions], [len(c.token_ids) for c in completions], seconds, host


class Llamacpp:
    def __init__(self, server: peer.LlamaServer):
        self.server = server

    def complete(self, prompt: list[int], schema: dict | None, max_tokens: int) -> dict:
        body = dict(prompt=prompt, n_predict=max_tokens, temperature=0.0, top_k=1, cache_prompt=False, stream=False)
        if schema is None:
            body["ignore_eos"] = True
        else:
            body["json_schema"] = schema
        return peer.post_json(f"http://127.0.0.1:{self.server.port}/completion", body, timeout=1800)

    def run(self, prompts, schema, lengths, at_once: bool):
        start = time.perf_counter()
        if at_once:
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                replies = list(pool.map(lambda p, n: self.complete(p, schema, n), prompts, lengths))
        else:
            replies = [self.complete(p, schema, n) for p, n in zip(prompts, lengths)]
        seconds = time.perf_counter() - start
        return [r["content"] for r in replies], [r["tokens_predicted"] for r in replies], seconds, None


def measure(engine_name: str, engine, prompts, schema, max_tokens: int, batch: int) -> dict:
    """Constrained, then unconstrained with the constrained replies' lengths; one JSON line each."""
    at_once = batch > 1
    records = {}
    texts, counts, seconds, host = engine.run(prompts, schema, [max_tokens] * len(prompts), at_once)
    check = validity(texts, schema)
    records["constrained"] = dict(
        engine=engine_name,
        mode="constrained",
        batch=batch,
        num_requests=len(prompts),
        generated_tokens=sum(counts),
        seconds=round(seconds, 2),
        tokens_per_s=round(sum(counts) / seconds, 1),
        reply_tokens=dict(min=min(counts), max=max(counts)),
        cut_at_max_tokens=sum(n >= max_tokens for n in counts),
        **check,
        **({"host": host} if host else {}),
    )
    emit(**records["constrained"])
    lengths = [max(n, 1) for n in counts]
    _, counts, seconds, host = engine.run(prompts, None, lengths, at_once)
    records["unconstrained"] = dict(
        engine=engine_name,
        mode="unconstrained",
        batch=batch,
        num_requests=len(prompts),
        generated_tokens=sum(counts),
        seconds=round(seconds, 2),
        tokens_per_s=round(sum(counts) / seconds, 1),
        **({"host": host} if host else {}),
    )
    emit(**records["unconstrained"])
    records["sample_reply"] = texts[0]
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a Hugging Face dir")
    parser.add_argument("--precision", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--items", type=int, default=4, help="books per reply (the schema's minItems = maxItems)")
    parser.add_argument("--batch", type=int, default=32, help="requests in flight in the batched runs")
    parser.add_argument("--single-requests", type=int, default=3, help="requests of the batch-1 runs, one by one")
    parser.add_argument("--max-tokens", type=int, default=400, help="cap on a constrained reply")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="jaxserve,llamacpp")
    args = parser.parse_args()
    pin_threads(args.threads)
    peer.ensure_built(CACHE_DIR)
    jax_path, ggufs, name = model_files(args)
    gguf = ggufs[DTYPES[args.precision][1]]
    schema = catalogue_schema(args.items)
    engines = args.engines.split(",")

    from jaxserve.loading.chat_template import render_chat
    from jaxserve.loading.model_source import open_model

    tokenizer = open_model(jax_path).tokenizer
    topics = [TOPICS[i % len(TOPICS)] for i in range(max(args.batch, args.single_requests))]
    prompts = [
        tokenizer.encode(render_chat(tokenizer, prompt_messages(t, args.items), add_generation_prompt=True),
                         add_special_tokens=False)
        for t in topics
    ]  # fmt: skip
    emit(
        bench="structured",
        model=name,
        precision=args.precision,
        threads=args.threads,
        items=args.items,
        max_tokens=args.max_tokens,
        prompt_tokens=dict(min=min(map(len, prompts)), max=max(map(len, prompts))),
        batches=[1, args.batch],
    )
    workloads = {1: prompts[: args.single_requests], args.batch: prompts[: args.batch]}
    warmup = [tokenizer.encode("Name one book about rivers.")]
    results = {}
    variants = (
        ("jaxserve", None),
        ("jaxserve-ngram", {"method": "ngram"}),
        ("jaxserve-draft", {"method": "draft", "draft_model": "self", "draft_quantization": "int8"}),
    )
    for engine_name, speculative in variants:
        if engine_name not in engines:
            continue
        ours = Jaxserve(
            jax_path, DTYPES[args.precision][0], args.batch, args.max_tokens, max(map(len, prompts)), speculative
        )
        ours.run(warmup, schema, [args.max_tokens], False)  # compiles the schema once (cached per schema)
        ours.run(warmup, None, [8], False)
        results[engine_name] = {
            b: measure(engine_name, ours, p, schema, args.max_tokens, b) for b, p in workloads.items()
        }
        stats = ours.llm.stats()
        emit(
            engine=engine_name,
            compiles_after_warmup=stats.get("num_compiles_after_warmup"),
            num_grammars_compiled=stats.get("num_grammars_compiled"),
            host_seconds_per_step_all=stats.get("host_seconds_per_step"),
            device_idle_seconds_per_step_all=stats.get("device_idle_seconds_per_step"),
            **{k: v for k, v in stats.items() if k.startswith("speculative_") and not isinstance(v, dict)},
        )
        del ours
        gc.collect()
    if "llamacpp" in engines:
        results["llamacpp"] = {}
        context = max(map(len, prompts)) + args.max_tokens + 16
        for batch, batch_prompts in workloads.items():
            with peer.LlamaServer(CACHE_DIR, gguf, args.threads, batch, context_per_slot=context) as server:
                theirs = Llamacpp(server)
                theirs.run(warmup, schema, [args.max_tokens], False)
                results["llamacpp"][batch] = measure("llamacpp", theirs, batch_prompts, schema, args.max_tokens, batch)
    report(results, args.batch)


def report(results: dict, batch: int) -> None:
    def rate(engine, b, mode):
        return results.get(engine, {}).get(b, {}).get(mode, {}).get("tokens_per_s")

    ratios = {}
    for b in (1, batch):
        for engine in results:
            constrained, unconstrained = rate(engine, b, "constrained"), rate(engine, b, "unconstrained")
            if constrained and unconstrained:
                ratios[f"{engine}_constrained_over_unconstrained_batch{b}"] = round(constrained / unconstrained, 3)
        ours, theirs = rate("jaxserve", b, "constrained"), rate("llamacpp", b, "constrained")
        if ours and theirs:
            ratios[f"jaxserve_over_llamacpp_constrained_batch{b}"] = round(ours / theirs, 3)
        for variant in ("jaxserve-ngram", "jaxserve-draft"):
            speculating = rate(variant, b, "constrained")
            for name, other in (("jaxserve", ours), ("llamacpp", theirs)):
                if speculating and other:
                    ratios[f"{variant}_over_{name}_constrained_batch{b}"] = round(speculating / other, 3)
    validity_by = {
        f"{engine}_batch{b}": records["constrained"]["validates"]
        for engine, by_batch in results.items()
        for b, records in by_batch.items()
    }
    samples = {engine: by_batch[batch]["sample_reply"] for engine, by_batch in results.items() if batch in by_batch}
    emit(result="structured", ratios=ratios, validates=validity_by, sample_replies=samples)
    print(
        "\n| engine | batch | constrained tok/s | unconstrained tok/s | ratio | valid JSON |\n|---|---|---|---|---|---|"
    )
    for engine, by_batch in results.items():
        for b, records in by_batch.items():
            c, u = records["constrained"]["tokens_per_s"], records["unconstrained"]["tokens_per_s"]
            print(f"| {engine} | {b} | {c} | {u} | {c / u:.2f}x | {records['constrained']['validates']} |")


if __name__ == "__main__":
    main()
