"""The jaxserve.v1.Generation gRPC service over an EngineLoop."""

from __future__ import annotations

import math

import grpc

import jaxserve
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.host.request import SamplingParams
from jaxserve.server.engine_loop import Delta, Draining, EngineLoop, Overloaded

DEFAULT_MAX_TOKENS = 16


def sampling_params_from_proto(sampling: pb.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams; unset optional fields take vLLM's defaults. Raises ValueError."""
    if any(not math.isfinite(v) for v in (sampling.temperature, sampling.top_p, sampling.min_p)):
        raise ValueError("temperature, top_p and min_p must be finite numbers")
    return SamplingParams(
        max_tokens=sampling.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_k=sampling.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        min_p=sampling.min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs or None,
    )


def response_from_delta(delta: Delta) -> pb.GenerateResponse:
    logprobs = []
    for token_id, top in zip(delta.token_ids, delta.logprobs or []):
        logprobs.append(pb.TokenLogprobs(
            token_id=token_id, logprob=top[token_id],
            top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in sorted(top.items(), key=lambda kv: -kv[1])]))
    return pb.GenerateResponse(token_ids=delta.token_ids, text=delta.text, finish_reason=delta.finish_reason or "",
                               num_prompt_tokens=delta.num_prompt_tokens, num_cached_tokens=delta.num_cached_tokens,
                               logprobs=logprobs)


class GenerationService(jaxserve_pb2_grpc.GenerationServicer):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.loop: EngineLoop | None = None  # set once the engine has warmed up

    def _ready_loop(self, context) -> EngineLoop:
        if self.loop is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still warming up")
        return self.loop

    def Generate(self, request, context):
        loop = self._ready_loop(context)
        metrics = loop.metrics
        try:
            if bool(request.text) == bool(request.token_ids):
                raise ValueError("set exactly one of text and token_ids")
            prompt = request.text if request.text else list(request.token_ids)
            stream = loop.submit(prompt, sampling_params_from_proto(request.sampling), request.request_id,
                                 request.session_id or None)
        except ValueError as error:
            metrics.rejected.labels("INVALID_ARGUMENT").inc()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Overloaded as error:
            metrics.rejected.labels("RESOURCE_EXHAUSTED").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except Draining as error:
            metrics.rejected.labels("UNAVAILABLE").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        # Runs when the RPC ends for any reason; after a normal finish the abort is a no-op.
        context.add_callback(lambda: loop.abort(stream.request_id))
        for delta in stream:
            yield response_from_delta(delta)

    def GetServerInfo(self, request, context):
        loop = self._ready_loop(context)
        info, load = loop.engine.describe(), loop.engine.load()
        shapes = [f"{kind}(tokens={tokens}, seqs={seqs}, pages={pages})"
                  for kind, tokens, seqs, pages in info.compiled_buckets]
        return pb.ServerInfo(model=self.model_name, dtype=info.dtype, mesh=info.mesh, page_size=info.page_size,
                             num_pages=info.num_pages, compiled_buckets=shapes, max_model_len=info.max_model_len,
                             version=jaxserve.__version__, attention_impl=info.attention_impl,
                             max_num_seqs=info.max_num_seqs, vocab_size=info.vocab_size,
                             num_free_pages=load.num_free_pages, num_running=load.num_running,
                             num_waiting=load.num_waiting)

    def Tokenize(self, request, context):
        tokenizer = self._ready_loop(context).engine.tokenizer
        if tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the model has no tokenizer.model")
        return pb.TokenizeResponse(token_ids=tokenizer.encode(request.text))

    def Detokenize(self, request, context):
        loop = self._ready_loop(context)
        tokenizer = loop.engine.tokenizer
        if tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the model has no tokenizer.model")
        vocab_size = loop.engine.model_config.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab_size]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids {bad[:5]} are outside [0, {vocab_size})")
        return pb.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids)))


def _device_name() -> str:
    import jax

    device = jax.devices()[0]
    return f"{device.platform}:{device.id} ({device.device_kind})"
