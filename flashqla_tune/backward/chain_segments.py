"""Context parallelism for the backward's chain kernels: the segments their CTAs walk.

A CTA of chain_kernels walks one segment of one sequence for one (V tile, v-head). Without a
split a segment is a whole sequence. With the forward call's warm-up tables
(warmup_tables.WarmupTables: its per-v-head windows and segment-length table) a long sequence is
cut where the forward cuts it, every `L` chunks, L from the table entry of the sequence's own
chunk count, so a sequence's segmentation depends on its length alone (batch invariance). At
each boundary the kernel either warms up over the head's window from zero (stores nothing for
it) or, where the guard refuses the window, chains it exactly from the sequence's own start
(states) or end (gradients), the walk from there going on through such boundaries:
csrc/gdn_bwd_chain.cuh chain_range, and docs/backward.md for the bound. A sequence's segments are
adjacent rows of the table, in order (the kernel joins only rows that continue each other).

Everything here runs as device ops on the chunk layout's device offsets: nothing waits for the
GPU, so a backward with a split can be captured in a CUDA graph. The host knows only the call's
token count and sequence count, so the table has the most segments those allow
(WarmupTables.bound); slots past the call's own segments are unused (sequence -1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..segment_policy import SEGMENT_BUCKETS

FIELDS = 5  # csrc/gdn_bwd_chain.cuh kSegmentFields: first, begin, end, last chunk, sequence


@dataclass(frozen=True)
class ChainSegments:
    """What the chain kernels walk: table int64 [num_segments, FIELDS] on the device (the sequence's
    first chunk, the segment's chunks [begin, end), the sequence's end chunk, the sequence index or
    -1), num_seqs (rows of h0 / dht / the final state / dh0), and for a split the per-v-head windows
    (int32 [Hv], -1 or 0: exact) and the guard's log(eps)."""
    table: torch.Tensor
    num_seqs: int
    warmup: torch.Tensor | None = None
    log_eps: float = 0.0

    @property
    def num_segments(self) -> int:
        return self.table.shape[0]

    @property
    def splits(self) -> bool:
        return self.warmup is not None


def whole_sequences(chunk_offsets: torch.Tensor) -> ChainSegments:
    """One segment per sequence: chunk_offsets int64 [N + 1] (sequence i owns chunks offsets[i] ..
    offsets[i + 1])."""
    first, last = chunk_offsets[:-1], chunk_offsets[1:]
    seq = torch.arange(first.numel(), dtype=torch.int64, device=chunk_offsets.device)
    return ChainSegments(torch.stack([first, first, last, last, seq], 1).contiguous(), first.numel())


def split_sequences(chunk_offsets: torch.Tensor, segment_chunks: torch.Tensor, max_segments: int,
                    warmup: torch.Tensor, log_eps: float) -> ChainSegments:
    """Each sequence cut every L chunks, L = segment_chunks[bucket of its chunk count] (the
    segment policy's table: 0, or L at least the chunk count, keeps it whole), into a table of
    max_segments slots (at least the call's segments: WarmupTables.bound(tokens, sequences));
    warmup int32 [Hv] the windows, log_eps the guard's log(eps) < 0."""
    if segment_chunks.numel() != SEGMENT_BUCKETS:
        raise ValueError(f"segment_chunks has {segment_chunks.numel()} entries, expected {SEGMENT_BUCKETS}")
    if not log_eps < 0.0:
        raise ValueError(f"log_eps={log_eps} must be negative (eps < 1)")
    N = chunk_offsets.numel() - 1
    if max_segments < N:
        raise ValueError(f"max_segments={max_segments} is fewer than the {N} sequences")
    dev = chunk_offsets.device
    first, last = chunk_offsets[:-1], chunk_offsets[1:]
    chunks = last - first
    # bucket_of_chunks on the device: the bit length of chunks - 1, capped at the last entry (the
    # powers made by a device op, not copied from the host: a CUDA graph can capture this)
    powers = 2 ** torch.arange(SEGMENT_BUCKETS - 1, dtype=torch.int64, device=dev)
    bucket = ((chunks - 1).clamp(min=0)[:, None] >= powers).sum(1)
    length = segment_chunks.to(torch.int64)[bucket]
    splits = (length > 0) & (length < chunks)
    count = torch.where(splits, (chunks + length - 1) // length.clamp(min=1), torch.ones_like(chunks))
    step = torch.where(splits, length, chunks.clamp(min=1))
    ends = torch.cumsum(count, 0)
    slot = torch.arange(max_segments, dtype=torch.int64, device=dev)
    used = slot < ends[-1]
    seq = torch.searchsorted(ends, slot, right=True).clamp(max=N - 1)
    local = slot - (ends[seq] - count[seq])
    begin = torch.minimum(first[seq] + local * step[seq], last[seq])
    end = torch.minimum(begin + step[seq], last[seq])
    table = torch.stack([first[seq], begin, end, last[seq], torch.where(used, seq, torch.full_like(seq, -1))], 1)
    return ChainSegments(table.contiguous(), N, warmup.to(device=dev, dtype=torch.int32).contiguous(), float(log_eps))


def window_log_decay(gamma_last: torch.Tensor, beta_chunks: torch.Tensor, key_norms: torch.Tensor) -> torch.Tensor:
    """The guard's per-chunk term [chunks, Hv] fp32: gamma_C (the chunk's summed log-decay) where every
    token of the chunk has 0 <= b |k|^2 <= 2, +inf where one does not (a window holding it is chained
    exactly); beta_chunks and key_norms (|k|^2) [chunks, Hv, 64] in the chunk layout (pad rows zero)."""
    bk = beta_chunks * key_norms
    safe = ((beta_chunks >= 0) & (bk >= 0) & (bk <= 2)).all(-1)
    return torch.where(safe, gamma_last, torch.full_like(gamma_last, float("inf"))).float().contiguous()


__all__ = ["FIELDS", "ChainSegments", "split_sequences", "whole_sequences", "window_log_decay"]
