"""SamplingParams to and from the proto's (jaxserve.proto), both ways: the gRPC service reads them, and
the router's HTTP API sends what its OpenAI handlers built on to the replicas."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from jaxserve.host.request import GuidedDecodingParams, Logprob, SamplingParams
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server import limits as request_limits
from jaxserve.server.limits import RequestLimits

DEFAULT_MAX_TOKENS = 16


def guided_decoding_from_proto(guided: pb.GuidedDecoding) -> GuidedDecodingParams | None:
    params = _guided_kind_from_proto(guided)
    if guided.whitespace_pattern:
        if params is None:
            raise ValueError("guided_decoding.whitespace_pattern needs json_schema or json_object")
        return dataclasses.replace(params, whitespace_pattern=guided.whitespace_pattern)
    return params


def _guided_kind_from_proto(guided: pb.GuidedDecoding) -> GuidedDecodingParams | None:
    kind = guided.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            schema = json.loads(guided.json_schema)
        except (json.JSONDecodeError, RecursionError) as error:  # RecursionError: nested past Python's stack
            raise ValueError(
                f"guided_decoding.json_schema is not valid JSON (or is nested too deeply): {error}"
            ) from None
        if not isinstance(schema, dict):
            raise ValueError("guided_decoding.json_schema must be a JSON object")
        return GuidedDecodingParams(json=guided.json_schema)
    if kind == "json_object":
        if not guided.json_object:
            raise ValueError("guided_decoding.json_object must be true when set")
        return GuidedDecodingParams(json_object=True)
    if kind == "choice":
        return GuidedDecodingParams(choice=list(guided.choice.choices))
    return GuidedDecodingParams(**{kind: getattr(guided, kind)})


def guided_decoding_to_proto(params: GuidedDecodingParams | None) -> pb.GuidedDecoding | None:
    if params is None:
        return None
    whitespace = params.whitespace_pattern or ""
    if params.json is not None:  # normalized to JSON text by GuidedDecodingParams
        return pb.GuidedDecoding(json_schema=str(params.json), whitespace_pattern=whitespace)
    if params.json_object:
        return pb.GuidedDecoding(json_object=True, whitespace_pattern=whitespace)
    if params.choice is not None:
        return pb.GuidedDecoding(choice=pb.GuidedChoice(choices=list(params.choice)))
    if params.regex is not None:
        return pb.GuidedDecoding(regex=params.regex)
    if params.structural_tag is not None:  # normalized to JSON text by GuidedDecodingParams
        return pb.GuidedDecoding(structural_tag=str(params.structural_tag))
    return pb.GuidedDecoding(grammar=params.grammar)


def sampling_params_from_proto(
    sampling: pb.SamplingParams, tool_guide: GuidedDecodingParams | None = None
) -> SamplingParams:
    """Proto -> SamplingParams; unset optional fields take vLLM's defaults. tool_guide: the grammar a chat's
    tool_choice imposes (never together with the request's own). Raises ValueError."""
    numbers = (sampling.temperature, sampling.top_p, sampling.min_p, sampling.presence_penalty)
    numbers += (sampling.frequency_penalty, sampling.repetition_penalty, *sampling.logit_bias.values())
    if any(not math.isfinite(v) for v in numbers):
        raise ValueError("temperature, top_p, min_p, the penalties and logit_bias must be finite numbers")
    guided = guided_decoding_from_proto(sampling.guided_decoding)
    if guided is not None and tool_guide is not None:
        raise ValueError("tool_choice 'required' or a function constrains the output already: no guided_decoding too")
    return SamplingParams(
        n=sampling.n or 1,
        max_tokens=0 if sampling.prompt_only else (sampling.max_tokens or DEFAULT_MAX_TOKENS),
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_k=sampling.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        min_p=sampling.min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs or None,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(sampling.logit_bias) or None,
        min_tokens=sampling.min_tokens,
        bad_words=list(sampling.bad_words) or None,
        allowed_token_ids=list(sampling.allowed_token_ids) or None,
        guided_decoding=guided or tool_guide,
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        lora=sampling.lora or None,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        skip_special_tokens=not sampling.keep_special_tokens,
        spaces_between_special_tokens=not sampling.no_spaces_between_special_tokens,
        guided_decoding_after_token=(
            sampling.guided_decoding_after_token if sampling.HasField("guided_decoding_after_token") else None
        ),
        truncate_prompt_tokens=(
            sampling.truncate_prompt_tokens if sampling.HasField("truncate_prompt_tokens") else None
        ),
    )


def check_sampling(limits: RequestLimits, sampling: pb.SamplingParams, tools: Sequence[str] = ()) -> None:
    """The server's caps on a request's sampling fields (and a chat's tools' JSON); ValueError."""
    request_limits.check_stops(limits, sampling.stop, sampling.stop_token_ids)
    guided = sampling.guided_decoding
    texts = [guided.json_schema, guided.regex, guided.grammar, *guided.choice.choices, guided.whitespace_pattern]
    texts.append(guided.structural_tag)
    texts += [*sampling.bad_words, *tools]
    request_limits.check_structured(limits, texts, len(sampling.logit_bias) + len(sampling.allowed_token_ids))
    request_limits.check_vocabulary(limits, sampling.logit_bias.keys(), "logit_bias keys")
    request_limits.check_vocabulary(limits, sampling.allowed_token_ids, "allowed_token_ids")


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Everything SamplingParams holds, so that a replica samples as the router's caller asked."""
    sampling = pb.SamplingParams(
        n=params.n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        stop=list(params.stop or ()),  # normalized to a tuple by SamplingParams
        stop_token_ids=list(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs or 0,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias or ()),  # (token id, bias) pairs
        min_tokens=params.min_tokens,
        bad_words=list(params.bad_words or ()),
        allowed_token_ids=list(params.allowed_token_ids or ()),
        guided_decoding=guided_decoding_to_proto(params.guided_decoding),
        prompt_only=params.max_tokens == 0,
        lora=params.lora or "",
        include_stop_str_in_output=params.include_stop_str_in_output,
        keep_special_tokens=not params.skip_special_tokens,
        no_spaces_between_special_tokens=not params.spaces_between_special_tokens,
    )
    if params.seed is not None:
        sampling.seed = params.seed
    if params.prompt_logprobs is not None:
        sampling.prompt_logprobs = params.prompt_logprobs
    if params.guided_decoding_after_token is not None:
        sampling.guided_decoding_after_token = params.guided_decoding_after_token
    if params.truncate_prompt_tokens is not None:
        sampling.truncate_prompt_tokens = params.truncate_prompt_tokens
    return sampling


def token_logprobs_message(token_id: int, top: dict[int, float]) -> pb.TokenLogprobs:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return pb.TokenLogprobs(
        token_id=token_id,
        logprob=top[token_id],
        top=[pb.TokenLogprob(token_id=t, logprob=v, rank=rank_of(v)) for t, v in ranked],
        rank=rank_of(top[token_id]),
    )


def rank_of(logprob: float) -> int:
    """A Logprob's rank for the wire (0: a plain float, rank unknown)."""
    return getattr(logprob, "rank", None) or 0


def logprobs_from_message(entry: pb.TokenLogprobs) -> dict[int, float]:
    """token_logprobs_message's inverse: {token_id: Logprob} for the top entries and the token itself."""
    logprobs: dict[int, float] = {top.token_id: Logprob(top.logprob, top.rank or None) for top in entry.top}
    logprobs[entry.token_id] = Logprob(entry.logprob, entry.rank or None)
    return logprobs


def stop_reason_fields(stop_reason: int | str | None) -> dict:
    """GenerateResponse's stop_reason oneof for a delta's stop_reason."""
    if stop_reason is None:
        return {}
    return {"stop_string": stop_reason} if isinstance(stop_reason, str) else {"stop_token_id": stop_reason}
