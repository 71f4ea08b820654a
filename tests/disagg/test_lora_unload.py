"""An adapter named by a decode replica's pending handover (reserved, or queued for a slot) is not yet a
request of the engine, but completing the handover needs it loaded: unload_lora refuses while one exists,
naming it, and allows the unload once the handovers are gone; a base-model handover holds no adapter."""

import pytest

from jaxserve import LLM, SamplingParams
from tests.lora.support import BASE_MODEL, adapter_dir
from tests.support.fixtures import SMALL_ENGINE

ADAPTER = "attn_r4"
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def decode():
    """One sequence slot (a second handover queues), one decode and one prefill bucket."""
    options = {**SMALL_ENGINE, "max_num_seqs": 1, "decode_seq_buckets": (1,), "prefill_token_buckets": (64,)}
    lora = {"adapters": {ADAPTER: adapter_dir(ADAPTER)}, "max_rank": 8}
    return LLM(BASE_MODEL, role="decode", when_decode_full="queue", lora=lora, **options).engine


def test_unload_is_refused_while_a_handover_holds_the_adapter(decode):
    handovers, adapter_params = decode.handovers, SamplingParams(max_tokens=4, lora=ADAPTER)
    assert handovers.reserve("reserved", PROMPT, adapter_params) is not None
    with pytest.raises(ValueError, match=r"'attn_r4' is in use by 1 .*'reserved'"):
        decode.unload_lora(ADAPTER)
    answers = []
    handovers.reserve_or_queue("queued", PROMPT, adapter_params, lambda *answer: answers.append(answer))
    assert not answers and handovers.stats()["handover_queued"] == 1  # the one slot is reserved
    with pytest.raises(ValueError, match=r"in use by 2 .*'reserved', 'queued'"):
        decode.unload_lora(ADAPTER)
    handovers.cancel("reserved")
    with pytest.raises(ValueError, match=r"in use by 1 .*'queued'"):
        decode.unload_lora(ADAPTER)
    handovers.cancel("queued")
    assert answers == [(None, False)]
    assert handovers.reserve("base", PROMPT, SamplingParams(max_tokens=4)) is not None
    decode.unload_lora(ADAPTER)  # only a base-model handover is pending
    assert decode.lora_adapters() == []
    with pytest.raises(ValueError, match=ADAPTER):  # a new handover for the unloaded adapter is refused
        handovers.reserve("late", PROMPT, adapter_params)
    handovers.cancel("base")
    assert handovers.stats()["handover_reservations"] == 0
    scheduler = decode.schedulers[0]
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_usable_pages
