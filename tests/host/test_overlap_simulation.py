"""Overlapped steps driven in plain Python (no JAX): the engine's step order (plan and dispatch step N+1,
then process step N) over a fake device that keeps, per KV slot, a hash of the prefix it was computed
from, and a token buffer per token slot. With aborts, preemption, chunked prefill, n > 1, stop tokens,
prefix caching and a host tier, every step must read the KV of its own prefix, write no cached page,
compute nothing beyond max_tokens, keep token slots distinct, and give the outputs of stepping in turn."""

import hashlib
import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.host.output_processor import OutputProcessor
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.scheduler import Scheduler

VOCAB, EOS, STOP = 50, 2, 5


def prefix_hash(tokens) -> str:
    return hashlib.blake2b(repr(tuple(tokens)).encode(), digest_size=6).hexdigest()


def fake_model(tokens, seq) -> int:
    return (
        int(hashlib.blake2b(repr((tuple(tokens), seq.sampling_seed)).encode(), digest_size=4).hexdigest(), 16) % VOCAB
    )


class SimulatedEngine:
    def __init__(self, overlap, num_pages, page_size, max_num_seqs, budget, block, host_pages, max_model_len):
        self.allocator = PageAllocator(num_pages, page_size, True, host_pages)
        self.scheduler = Scheduler(
            self.allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, prefill_query_block=block
        )
        self.outputs = OutputProcessor(None, frozenset({EOS}), max_model_len)
        self.kv: dict[tuple[int, int], str] = {}  # (page, offset) -> hash of the prefix it was computed from
        self.token_buffer = [None] * (max_num_seqs + 1)
        self.overlap, self.page_size, self.max_model_len = overlap, page_size, max_model_len
        self.in_flight = []

    def _page(self, page):
        return tuple(self.kv.get((page, offset)) for offset in range(self.page_size))

    def _move_host_tier_pages(self):
        allocator = self.allocator
        demoted, allocator.pending_demotions = allocator.pending_demotions, []
        for page, key, contents in demoted:
            allocator.host_tier.store(key, contents, self._page(page))
        promoted, allocator.pending_promotions = allocator.pending_promotions, []
        for page, data in promoted:
            self.kv.update(((page, offset), value) for offset, value in enumerate(data))

    def _run(self, chunks):
        sampled = []
        for chunk in chunks:
            seq, size = chunk.seq, self.page_size
            assert chunk.end <= min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
            if chunk.samples_next_token and not seq.flushing:  # never a token beyond max_tokens
                assert chunk.end - seq.num_prompt_tokens < seq.params.max_tokens
            tokens = seq.token_ids
            if chunk.end > len(tokens):  # the token the step in flight samples, read from the token buffer
                assert chunk.end == len(tokens) + 1 and seq.token_buffer_entry >= 0
                tokens = tokens + [self.token_buffer[seq.token_buffer_entry]]
            for position in range(chunk.start):  # what attention reads
                page = seq.page_ids[position // size]
                assert self.kv.get((page, position % size)) == prefix_hash(tokens[: position + 1]), (
                    f"sequence {seq.seq_id} reads wrong KV at position {position} (page {page})"
                )
            for position in range(chunk.start, chunk.end):
                page = seq.page_ids[position // size]
                assert self.allocator.page_keys[page] is None, f"a step writes cached page {page}"
                self.kv[(page, position % size)] = prefix_hash(tokens[: position + 1])
            token = fake_model(tokens[: chunk.end], seq) if chunk.samples_next_token else 0
            self.token_buffer[seq.token_buffer_entry if chunk.samples_next_token else -1] = token
            sampled.append(token)
        self.scheduler.mark_dispatched(chunks)
        return np.array(sampled, np.int32)

    def step(self):
        schedule = self.scheduler.schedule()
        dispatched = []
        if not schedule.is_empty:
            self._move_host_tier_pages()
            dispatched = [(chunks, self._run(chunks)) for chunks in (schedule.prefills, schedule.decodes) if chunks]
        to_process = self.in_flight if self.overlap else dispatched
        self.in_flight = dispatched if self.overlap else []
        for chunks, tokens in to_process:
            self.outputs.process(
                chunks,
                self.scheduler,
                SimpleNamespace(token_ids=tokens, no_token_allowed=np.zeros(len(tokens), bool)),
                0,
            )
        slots = [seq.token_buffer_entry for seq in self.scheduler.running]
        assert -1 not in slots and len(set(slots)) == len(slots)
        assert len(self.scheduler._free_buffer_entries) + len(slots) == self.scheduler.max_num_seqs

    @property
    def busy(self):
        return bool(self.in_flight) or self.scheduler.has_unfinished


def simulate(seed, overlap, aborts, config):
    rng, ids = random.Random(seed), itertools.count()
    engine = SimulatedEngine(overlap, **config)
    bases = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    requests = []
    for i in range(12):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 6))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, min(20, config["max_model_len"] - len(prompt)) + 1),
            stop_token_ids=[STOP] if i % 2 else None,
        )
        seqs = [
            SequenceState(
                seq_id=next(ids),
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                params=params,
                sampling_seed=1000 * i + k,
                arrival_order=i,
            )
            for k in range(2 if i % 5 == 0 else 1)
        ]
        arrival = rng.randrange(0, 25)
        abort_at = arrival + rng.randrange(0, 10)
        requests.append((seqs, arrival, abort_at if aborts and i % 3 == 1 else None))
    for step in itertools.count():
        for seqs, arrival, abort_at in requests:
            for seq in seqs:
                if step == arrival:
                    engine.scheduler.add(seq)
                if step == abort_at and not seq.is_finished:
                    engine.scheduler.finish(seq, "abort")
        engine.step()
        if step > 35 and not engine.busy:
            break
        assert step < 3000, "no progress"
    assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages
    return {
        seq.seq_id: (seq.output_token_ids, seq.finish_reason)
        for seqs, _, _ in requests
        for seq in seqs
        if seq.finish_reason != "abort"
    }


CONFIGS = {
    "host_tier": dict(num_pages=12, page_size=4, max_num_seqs=4, budget=16, block=4, host_pages=8, max_model_len=40),
    "chunked": dict(num_pages=30, page_size=2, max_num_seqs=3, budget=8, block=2, host_pages=0, max_model_len=32),
    "preempting": dict(num_pages=9, page_size=4, max_num_seqs=6, budget=32, block=1, host_pages=20, max_model_len=32),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_overlapped_steps_read_and_write_the_right_kv(name):
    config = CONFIGS[name]
    for seed in range(12):
        expected = simulate(seed, False, False, {**config, "num_pages": 200})
        for overlap in (True, False):
            got = simulate(seed, overlap, True, config)
            assert got == {seq_id: expected[seq_id] for seq_id in got}, (seed, overlap)
