from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos", "logprobs", "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids", "guided_decoding", "prompt_logprobs", "prompt_only", "lora", "include_stop_str_in_output", "keep_special_tokens", "guided_decoding_after_token", "truncate_prompt_tokens", "no_spaces_between_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ONLY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_AFTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    guided_decoding: GuidedDecoding
    prompt_logprobs: int
    prompt_only: bool
    lora: str
    include_stop_str_in_output: bool
    keep_special_tokens: bool
    guided_decoding_after_token: int
    truncate_prompt_tokens: int
    no_spaces_between_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., guided_decoding: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., prompt_only: _Optional[bool] = ..., lora: _Optional[str] = ..., include_stop_str_in_output: _Optional[bool] = ..., keep_special_tokens: _Optional[bool] = ..., guided_decoding_after_token: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., no_spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag", "whitespace_pattern")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: GuidedChoice
    grammar: str
    structural_tag: str
    whitespace_pattern: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[GuidedChoice, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ..., whitespace_pattern: _Optional[str] = ...) -> None: ...

class GuidedChoice(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "logprobs", "request_id", "index", "tool_calls", "content", "prompt_logprobs", "reasoning_content", "stop_string", "stop_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    request_id: str
    index: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    reasoning_content: str
    stop_string: str
    stop_token_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., reasoning_content: _Optional[str] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling", "session_id", "add_generation_prompt", "continue_final_message", "tools", "tool_choice", "tool_choice_function", "parallel_tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    session_id: str
    add_generation_prompt: bool
    continue_final_message: bool
    tools: _containers.RepeatedScalarFieldContainer[str]
    tool_choice: str
    tool_choice_function: str
    parallel_tool_calls: bool
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[str]] = ..., tool_choice: _Optional[str] = ..., tool_choice_function: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "dtype", "mesh", "page_size", "num_pages", "compiled_buckets", "max_model_len", "version", "attention_impl", "max_num_seqs", "vocab_size", "num_free_pages", "num_running", "num_waiting", "system_fingerprint", "model_fingerprint", "prefill_seconds_per_token", "swap_in_seconds_per_page", "num_tokens_waiting_prefill", "host_tier_pages", "instance_id", "step_seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    COMPILED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_IMPL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_SECONDS_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_WAITING_PREFILL_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_PAGES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    mesh: str
    page_size: int
    num_pages: int
    compiled_buckets: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    version: str
    attention_impl: str
    max_num_seqs: int
    vocab_size: int
    num_free_pages: int
    num_running: int
    num_waiting: int
    system_fingerprint: str
    model_fingerprint: str
    prefill_seconds_per_token: float
    swap_in_seconds_per_page: float
    num_tokens_waiting_prefill: int
    host_tier_pages: int
    instance_id: str
    step_seconds: float
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., mesh: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., compiled_buckets: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ..., version: _Optional[str] = ..., attention_impl: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., system_fingerprint: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., prefill_seconds_per_token: _Optional[float] = ..., swap_in_seconds_per_page: _Optional[float] = ..., num_tokens_waiting_prefill: _Optional[int] = ..., host_tier_pages: _Optional[int] = ..., instance_id: _Optional[str] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ("heartbeat_ms",)
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ms: int
    def __init__(self, heartbeat_ms: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "key", "parent_key", "num_tokens", "tier", "rank")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
        CLEARED: _ClassVar[KVEvent.Kind]
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    CLEARED: KVEvent.Kind
    class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DEVICE: _ClassVar[KVEvent.Tier]
        HOST: _ClassVar[KVEvent.Tier]
    DEVICE: KVEvent.Tier
    HOST: KVEvent.Tier
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    key: int
    parent_key: int
    num_tokens: int
    tier: KVEvent.Tier
    rank: int
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., key: _Optional[int] = ..., parent_key: _Optional[int] = ..., num_tokens: _Optional[int] = ..., tier: _Optional[_Union[KVEvent.Tier, str]] = ..., rank: _Optional[int] = ...) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_pages", "num_tokens_waiting_prefill", "prefill_seconds_per_token", "swap_in_seconds_per_page", "step_seconds", "lora_root_keys")
    class LoraRootKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_WAITING_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_SECONDS_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LORA_ROOT_KEYS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_tokens_waiting_prefill: int
    prefill_seconds_per_token: float
    swap_in_seconds_per_page: float
    step_seconds: float
    lora_root_keys: _containers.ScalarMap[str, int]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_tokens_waiting_prefill: _Optional[int] = ..., prefill_seconds_per_token: _Optional[float] = ..., swap_in_seconds_per_page: _Optional[float] = ..., step_seconds: _Optional[float] = ..., lora_root_keys: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("sequence", "snapshot", "events", "load", "instance_id", "more")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    load: ReplicaLoad
    instance_id: str
    more: bool
    def __init__(self, sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., load: _Optional[_Union[ReplicaLoad, _Mapping]] = ..., instance_id: _Optional[str] = ..., more: _Optional[bool] = ...) -> None: ...

class LoadLoRARequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoRAResponse(_message.Message):
    __slots__ = ("slot", "rank")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    slot: int
    rank: int
    def __init__(self, slot: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoRAResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
