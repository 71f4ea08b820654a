from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

from jaxserve.proto import jaxserve_pb2 as _jaxserve_pb2

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "held_page_keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _jaxserve_pb2.SamplingParams
    held_page_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(
        self,
        request_id: str | None = ...,
        token_ids: _Iterable[int] | None = ...,
        sampling: _jaxserve_pb2.SamplingParams | _Mapping | None = ...,
        held_page_keys: _Iterable[int] | None = ...,
    ) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Iterable[int] | None = ..., dtype: str | None = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = (
        "handover_id",
        "first_token_id",
        "first_logprobs",
        "sampling_seed",
        "finish_reason",
        "first_text",
        "transfer_address",
        "transfer_id",
        "chunks",
        "num_pages_sent",
        "num_cached_tokens",
    )
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handover_id: str
    first_token_id: int
    first_logprobs: _jaxserve_pb2.TokenLogprobs
    sampling_seed: int
    finish_reason: str
    first_text: str
    transfer_address: str
    transfer_id: int
    chunks: _containers.RepeatedCompositeFieldContainer[PageChunk]
    num_pages_sent: int
    num_cached_tokens: int
    def __init__(
        self,
        handover_id: str | None = ...,
        first_token_id: int | None = ...,
        first_logprobs: _jaxserve_pb2.TokenLogprobs | _Mapping | None = ...,
        sampling_seed: int | None = ...,
        finish_reason: str | None = ...,
        first_text: str | None = ...,
        transfer_address: str | None = ...,
        transfer_id: int | None = ...,
        chunks: _Iterable[PageChunk | _Mapping] | None = ...,
        num_pages_sent: int | None = ...,
        num_cached_tokens: int | None = ...,
    ) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handover_id",)
    HANDOVER_ID_FIELD_NUMBER: _ClassVar[int]
    handover_id: str
    def __init__(self, handover_id: str | None = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool | None = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = (
        "role",
        "serving",
        "transfer_address",
        "num_parked",
        "num_reservations",
        "num_free_pages",
        "num_pages",
        "num_expired",
        "num_handovers",
        "bytes_moved",
        "num_pages_moved",
        "num_pages_reused",
        "num_recomputed",
        "num_compiles_after_warmup",
        "seconds_moving",
        "seconds_prefilling",
        "num_local_prefills",
        "num_queued",
    )
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARKED_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOVERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_REUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPILES_AFTER_WARMUP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_MOVING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PREFILLING_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    role: str
    serving: bool
    transfer_address: str
    num_parked: int
    num_reservations: int
    num_free_pages: int
    num_pages: int
    num_expired: int
    num_handovers: int
    bytes_moved: int
    num_pages_moved: int
    num_pages_reused: int
    num_recomputed: int
    num_compiles_after_warmup: int
    seconds_moving: float
    seconds_prefilling: float
    num_local_prefills: int
    num_queued: int
    def __init__(
        self,
        role: str | None = ...,
        serving: bool | None = ...,
        transfer_address: str | None = ...,
        num_parked: int | None = ...,
        num_reservations: int | None = ...,
        num_free_pages: int | None = ...,
        num_pages: int | None = ...,
        num_expired: int | None = ...,
        num_handovers: int | None = ...,
        bytes_moved: int | None = ...,
        num_pages_moved: int | None = ...,
        num_pages_reused: int | None = ...,
        num_recomputed: int | None = ...,
        num_compiles_after_warmup: int | None = ...,
        seconds_moving: float | None = ...,
        seconds_prefilling: float | None = ...,
        num_local_prefills: int | None = ...,
        num_queued: int | None = ...,
    ) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "prefill_address")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request: _jaxserve_pb2.GenerateRequest
    prefill_address: str
    def __init__(
        self,
        request: _jaxserve_pb2.GenerateRequest | _Mapping | None = ...,
        prefill_address: str | None = ...,
    ) -> None: ...
