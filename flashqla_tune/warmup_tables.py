"""From a per-v-head warm-up table (the op's `warmup` keyword) to what the kernels read on the
device: the table itself and the segment-length table of the CP cost model (cp_cost_model.py).

Both depend only on the table's values, the plan and the GPU, never on the batch, so a
sequence's segmentation depends only on its own length (batch invariance). They are built once
per (values, plan, device) and kept: later calls, CUDA-graph captures included, copy nothing
from the host. The first call with a new table therefore has to happen outside a capture.
"""
from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import torch

from .calibration_settings import DEFAULT_EPS  # the calibration's default eps: the same bound
from .cp_cost_model import Machine, WarmupProfile, check_segment_table, segment_table
from .plan import KernelPlan
from .segment_policy import MAX_SEGMENTS, SEGMENT_BUCKETS, bucket_of_chunks, segments_of
from .supported_shapes import MAX_WINDOW_CHUNKS  # the longest warm-up window a table may hold, in chunks

# The op's window when the caller gives no table (DESIGN.md): 512 tokens. The guard still decides
# per boundary and input, so a head whose gates do not decay that fast is chained exactly; the
# protocol's gates (logsigmoid(randn) / 16) need 4-5 chunks, so 8 covers them with room.
DEFAULT_WINDOW_CHUNKS = 8
CP_SCRATCH_LIMIT_BYTES = 2 << 30  # fp32 boundary, H and M states of a call; above it the call runs without CP


class WarmupError(ValueError):
    """A warm-up table the kernels cannot use."""


@dataclass(frozen=True)
class WarmupTables:
    warmup: torch.Tensor          # int32 [Hv] on the device
    segment_chunks: torch.Tensor  # int32 [SEGMENT_BUCKETS] on the device
    lengths: tuple[int, ...]      # the same on the host
    log_eps: float
    bound: SegmentBound           # a call's segment bound from (T, N)
    exact_heads: int              # entries of -1 (FqtGdnFwdArgs.exact_heads)

    @property
    def splits(self) -> bool:
        """False when no sequence length is worth splitting: calls then run without CP."""
        return any(self.lengths)


def default_table(num_v_heads: int) -> tuple[int, ...]:
    """The warm-up table of a call without one: every head DEFAULT_WINDOW_CHUNKS, guarded."""
    return (DEFAULT_WINDOW_CHUNKS,) * num_v_heads


def is_default_table(values: tuple[int, ...]) -> bool:
    return tuple(values) == default_table(len(values))


def normalise(warmup, num_v_heads: int) -> tuple[int, ...]:
    """The op's `warmup` argument as a tuple of ints, checked: one entry per v-head, each -1 (chain
    exactly) or a window of 1..MAX_WINDOW_CHUNKS chunks. A CUDA tensor is refused: its values pick
    the segment lengths on the host, and reading them would synchronise."""
    if isinstance(warmup, torch.Tensor):
        if warmup.device.type != "cpu":
            raise WarmupError(f"warmup is on {warmup.device}; pass it as a CPU tensor or a list (its values "
                              f"choose the segment lengths on the host, and reading a GPU tensor would synchronise)")
        if warmup.dim() != 1 or warmup.is_floating_point() or warmup.is_complex():
            raise WarmupError(f"warmup must be a 1-D integer tensor, got {warmup.dtype} {tuple(warmup.shape)}")
        values = tuple(int(x) for x in warmup.tolist())
    else:
        try:
            values = tuple(warmup)
        except TypeError:
            raise WarmupError(f"warmup must be a list or 1-D tensor of ints, got {type(warmup).__name__}") from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            raise WarmupError(f"warmup must hold ints, got {values!r}")
    if len(values) != num_v_heads:
        raise WarmupError(f"warmup has {len(values)} entries; the call has Hv={num_v_heads} v-heads")
    for h, n in enumerate(values):
        if n != -1 and not 1 <= n <= MAX_WINDOW_CHUNKS:
            raise WarmupError(f"warmup[{h}]={n}: each entry is -1 (chain exactly) or 1..{MAX_WINDOW_CHUNKS} chunks")
    return values


def segment_lengths(values: tuple[int, ...], plan: KernelPlan, sms: int) -> list[int]:
    """The kernel's segment table: entry b is the segment length (chunks) for sequences of at most
    2^b chunks, from the CP cost model for this plan's chains on `sms` SMs and this warm-up table.
    The default table is planned as if a quarter of its heads failed the guard (the protocol's
    share of non-decaying heads): without a calibration the planner cannot know which will."""
    if is_default_table(values):
        profile = WarmupProfile(exact_share=0.25, mean_window=float(DEFAULT_WINDOW_CHUNKS),
                                max_window=DEFAULT_WINDOW_CHUNKS)
    else:
        profile = WarmupProfile.from_tables([list(values)])
    return profile_segment_lengths(profile, plan, sms)


def profile_segment_lengths(profile: WarmupProfile, plan: KernelPlan, sms: int) -> list[int]:
    """The same from a pooled profile (a pack's: every layer and head of its calibration)."""
    t = plan.tiles
    chains = plan.spec.num_v_heads * (plan.spec.head_v_dim // t.block_v)
    table = segment_table(chains, profile, Machine(sms=sms, ctas_per_sm=t.ctas_per_sm),
                          qk_heads=plan.spec.num_qk_heads)
    buckets = sorted(table)
    top = int(math.log2(buckets[-1]))
    return [table[2 ** min(b, top)] for b in range(SEGMENT_BUCKETS)]


def describe_splits(lengths: tuple[int, ...], token_lengths: tuple[int, ...] = (2048, 8192, 32768, 131072)) -> str:
    """How a segment table cuts a sequence of each length, e.g. '8192 tokens: 16 x 8 chunks'."""
    parts = []
    for tokens in token_lengths:
        chunks = -(-tokens // 64)
        length = lengths[bucket_of_chunks(chunks)]
        segments = segments_of(chunks, length)
        parts.append(f"{tokens} tokens: " + (f"{segments} x {length} chunks" if segments > 1 else "one chain"))
    return "; ".join(parts)


def tables_for(values: tuple[int, ...], plan: KernelPlan, device: torch.device, eps: float,
               lengths: tuple[int, ...] | None = None) -> WarmupTables | None:
    """The device tables of a checked warm-up table (normalise) for plan on device; cached.
    lengths: a segment table to use instead of the cost model's for this table (a pack's).
    Under CUDA-graph capture a table must already be cached: the default table's first call then
    runs without CP (None, with a warning once); any other table is an error."""
    if not 0.0 < eps < 1.0:
        raise WarmupError(f"warmup_eps={eps} must lie in (0, 1)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _tables(values, plan, device, float(eps), lengths)


_DEFAULT_SKIPPED_WARNED = False


def _warn_default_skipped() -> None:
    global _DEFAULT_SKIPPED_WARNED
    if not _DEFAULT_SKIPPED_WARNED:
        _DEFAULT_SKIPPED_WARNED = True
        warnings.warn("the op's first call is being captured in a CUDA graph: its default warm-up table is not on "
                      "the GPU yet, so this captured call chains every sequence exactly (no context parallelism); "
                      "make one eager call before capturing to get it", RuntimeWarning, stacklevel=4)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Kept for the life of the process, never evicted: a captured CUDA graph holds the tables' device
# pointers. Each entry is two small int32 tensors per (table, plan, device, eps).
_TABLES: dict[tuple, WarmupTables] = {}
_TABLES_LOCK = threading.Lock()


def _tables(values: tuple[int, ...], plan: KernelPlan, device: torch.device, eps: float,
            lengths: tuple[int, ...] | None) -> WarmupTables | None:
    key = (values, plan, device, eps, lengths)
    tables = _TABLES.get(key)
    if tables is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # copying a new table to the GPU is a synchronous copy, which stream capture forbids
            if is_default_table(values):
                _warn_default_skipped()
                return None
            raise WarmupError(f"warm-up table {list(values)} is new on {device} while a CUDA graph is being "
                              f"captured: its first call copies it to the GPU, so make one call with it before "
                              f"the capture")
        with _TABLES_LOCK:
            tables = _TABLES.get(key)
            if tables is None:
                tables = _TABLES[key] = _make_tables(values, plan, device, eps, lengths)
    return tables


def _make_tables(values: tuple[int, ...], plan: KernelPlan, device: torch.device, eps: float,
                 lengths: tuple[int, ...] | None) -> WarmupTables:
    lengths = check_segment_table(lengths) if lengths is not None else segment_lengths(values, plan, sm_count(device))
    return WarmupTables(torch.tensor(values, dtype=torch.int32, device=device),
                        torch.tensor(lengths, dtype=torch.int32, device=device), tuple(lengths), math.log(eps),
                        SegmentBound.of(tuple(lengths)), values.count(-1))


@dataclass(frozen=True)
class SegmentBound:
    """An upper bound on the segments of a call of N sequences over T tokens under a segment
    table, O(1) per call (the kernels plan at most this many; the workspace holds this many).
    Sequence i has c_i <= ceil(T / 64) chunks with sum c_i <= C = T / 64 + N, bucket b holds
    2^(b-1) < c <= 2^b (bucket 0: c <= 1; the last bucket is open), and c chunks give
    ceil(c / L_b) segments when 0 < L_b < c, else one. Inside a bucket the extra segments grow
    with c, so the most a single sequence can add is at the top of a bucket, or at ceil(T / 64)
    in that one's bucket; over all sequences the extra is also at most C / (shortest L that
    splits)."""
    lengths: tuple[int, ...]
    top_extra: tuple[int, ...]    # [b]: max extra segments of a sequence in buckets 0..b (b < last)
    top_shortest: tuple[int, ...]  # [b]: shortest splitting L in buckets 0..b (0: none)

    @classmethod
    def of(cls, lengths: tuple[int, ...]) -> "SegmentBound":
        extra, shortest = [], []
        best, short = 0, 0
        for b, length in enumerate(lengths[:-1]):
            if 0 < length < 2 ** b:
                best = max(best, segments_of(2 ** b, length) - 1)
                short = length if short == 0 else min(short, length)
            extra.append(best)
            shortest.append(short)
        return cls(tuple(lengths), tuple(extra), tuple(shortest))

    def __call__(self, total_tokens: int, num_seqs: int) -> int:
        chunks = total_tokens // 64 + num_seqs
        longest = -(-total_tokens // 64)                 # no sequence has more chunks than this
        part = bucket_of_chunks(longest)                 # the bucket of the longest possible sequence
        per_seq, shortest = (self.top_extra[part - 1], self.top_shortest[part - 1]) if part > 0 else (0, 0)
        length = self.lengths[part]
        if 0 < length < longest:                         # inside a bucket the extra grows with c
            per_seq = max(per_seq, segments_of(longest, length) - 1)
            shortest = length if shortest == 0 else min(shortest, length)
        extra = min(num_seqs * per_seq, chunks // shortest) if per_seq else 0
        return num_seqs + extra


def segment_state_bytes(num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """Bytes of one segment's fp32 boundary, H and M states: call_segments' bytes_per_segment."""
    return 3 * num_v_heads * head_k_dim * head_v_dim * 4


def call_segments(tables: WarmupTables, total_tokens: int, num_seqs: int, bytes_per_segment: int,
                  longest_tokens: int = 0) -> int:
    """The segment bound the kernels get for a call, or 0 to run it without CP: when no length
    splits, when no sequence of at most longest_tokens tokens (the host's knowledge, 0: unknown)
    would split, or when the bound exceeds the kernels' limit or its fp32 boundary, H and M states
    would take more than CP_SCRATCH_LIMIT_BYTES. The bound only sees T and N, so a call of very
    many sequences is refused CP even when few of them are long; such a call gives each sequence
    the exact chain (the no-CP result), so batch invariance holds for calls under the limit."""
    if not tables.splits:
        return 0
    if 0 < longest_tokens <= total_tokens and tables.bound(longest_tokens, 1) == 1:
        return 0  # every sequence is at most longest_tokens long, and none of those splits
    segments = tables.bound(total_tokens, num_seqs)
    if segments == num_seqs:
        return 0  # no sequence of this call is long enough to split: skip the CP kernels
    if segments > MAX_SEGMENTS or segments * bytes_per_segment > CP_SCRATCH_LIMIT_BYTES:
        warnings.warn(f"context parallelism is off for a call of {num_seqs} sequences over {total_tokens} tokens: "
                      f"up to {segments} segments would need {segments * bytes_per_segment / 2**30:.1f} GiB of "
                      f"boundary states (limit {CP_SCRATCH_LIMIT_BYTES / 2**30:.0f} GiB, {MAX_SEGMENTS} segments); "
                      f"every sequence of this call is chained exactly", RuntimeWarning, stacklevel=3)
        return 0
    return segments


def max_segments(lengths: tuple[int, ...], total_tokens: int, num_seqs: int) -> int:
    return SegmentBound.of(tuple(lengths))(total_tokens, num_seqs)


__all__ = ["CP_SCRATCH_LIMIT_BYTES", "DEFAULT_EPS", "DEFAULT_WINDOW_CHUNKS", "MAX_SEGMENTS", "SEGMENT_BUCKETS",
           "SegmentBound", "WarmupError", "WarmupTables", "call_segments", "default_table", "describe_splits",
           "is_default_table", "max_segments", "normalise", "profile_segment_lengths", "segment_lengths",
           "segment_state_bytes", "sm_count", "tables_for"]
