"""After a verify step (device/verify_step.py): each verify row's accepted proposals and the target's
token after them, appended one at a time as a plain decode would, so that a stop token, a stop string,
max_tokens or max_model_len ends the sequence exactly where it would have ended without speculation
(the tokens after it are dropped).

KV: the step wrote the newest token's and every proposal's KV; only the newest token's and the accepted
proposals' count as computed. The rejected ones' slots lie beyond num_computed_tokens, so no page holding
them is cached as full until a later step has overwritten them with the real tokens' KV.
"""

from __future__ import annotations

from jaxserve.host.output_processor import OutputProcessor, append_token, token_logprobs
from jaxserve.host.request import RequestStatus
from jaxserve.host.schedule import ScheduledChunk
from jaxserve.host.scheduler import Scheduler
from jaxserve.host.speculation_policy import AcceptanceCounts


def process_verified(
    chunks: list[ScheduledChunk],
    scheduler: Scheduler,
    sampled,
    num_accepted,
    first_row: int,
    width: int,
    outputs: OutputProcessor,
    counts: AcceptanceCounts,
) -> set[str]:
    """chunks ran on scheduler's rank as verify rows first_row, first_row + 1, ...; sampled (numpy
    SamplerOutput fields) has `width` rows per verify row, one per position. Returns the ids of the
    requests that produced a token or finished."""
    progressed = set()
    for index, chunk in enumerate(chunks):
        row, seq = first_row + index, chunk.seq
        scheduler.mark_processed(chunk)
        if seq.is_finished or seq.status is not RequestStatus.RUNNING:
            continue  # aborted while its step ran: its KV and tokens go nowhere
        accepted = int(num_accepted[row])
        counts.record(len(chunk.draft_token_ids), accepted)
        seq.num_draft_tokens += len(chunk.draft_token_ids)
        seq.num_accepted_draft_tokens += accepted
        reason = None
        for position in range(row * width, row * width + accepted + 1):
            num_top = seq.params.logprobs
            reason = append_token(
                seq,
                int(sampled.token_ids[position]),
                token_logprobs(position, sampled, num_top) if num_top is not None else None,
                outputs.tokenizer,
                outputs.eos_token_ids,
                outputs.max_model_len,
                bool(sampled.no_token_allowed[position]),
            )
            outputs.num_generated_tokens += 1
            if reason is not None:
                break
        # the newest token's and the accepted proposals' KV, as far as the tokens kept reach
        seq.num_computed_tokens = min(chunk.start + 1 + accepted, seq.num_tokens)
        scheduler.cache_full_pages(seq)
        if reason is not None:
            if seq.num_computed_tokens == seq.num_tokens:  # ended on an accepted proposal: its KV is computed
                scheduler.finish(seq, reason)
            else:
                scheduler.finish_or_flush(seq, reason)
        progressed.add(seq.request_id)
    return progressed
