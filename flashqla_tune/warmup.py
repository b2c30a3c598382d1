"""From a per-v-head warm-up table (the op's `warmup` keyword) to what the kernels read on the
device: the table itself and the segment-length table of the CP cost model (cp_plan.py).

Both depend only on the table's values, the plan and the GPU, never on the batch, so a
sequence's segmentation depends only on its own length (batch invariance). They are built once
per (values, plan, device) and kept: later calls, CUDA-graph captures included, copy nothing
from the host. The first call with a new table therefore has to happen outside a capture.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .calibrate.settings import DEFAULT_EPS  # the calibration's default eps: the same bound
from .cp_plan import Machine, WarmupProfile, segment_table
from .plan import KernelPlan

SEGMENT_BUCKETS = 32        # csrc/gdn_cp.cuh kSegmentBuckets: entry b for sequences of <= 2^b chunks
MAX_WINDOW_CHUNKS = 1024    # a window is a warm-up over n_h chunks; calibration caps n_h at 16
MAX_SEGMENTS = 65535 // 3   # csrc/gdn_cp.cuh kMaxSegments: the state pass has 3 grid z-slices per segment


class WarmupError(ValueError):
    """A warm-up table the kernels cannot use."""


@dataclass(frozen=True)
class WarmupTables:
    warmup: torch.Tensor          # int32 [Hv] on the device
    segment_chunks: torch.Tensor  # int32 [SEGMENT_BUCKETS] on the device
    lengths: tuple[int, ...]      # the same on the host
    log_eps: float

    @property
    def splits(self) -> bool:
        """False when no sequence length is worth splitting: calls then run without CP."""
        return any(self.lengths)


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
    2^b chunks, from the CP cost model for this plan's chains on `sms` SMs."""
    t = plan.tiles
    chains = plan.spec.num_v_heads * (plan.spec.head_v_dim // t.block_v)
    profile = WarmupProfile.from_tables([list(values)])
    table = segment_table(chains, profile, Machine(sms=sms, ctas_per_sm=t.ctas_per_sm))
    buckets = sorted(table)
    top = int(math.log2(buckets[-1]))
    return [table[2 ** min(b, top)] for b in range(SEGMENT_BUCKETS)]


def tables_for(values: tuple[int, ...], plan: KernelPlan, device: torch.device, eps: float) -> WarmupTables:
    """The device tables of a checked warm-up table (normalise) for plan on device; cached."""
    if not 0.0 < eps < 1.0:
        raise WarmupError(f"warmup_eps={eps} must lie in (0, 1)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _tables(values, plan, device, float(eps))


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=256)
def _tables(values: tuple[int, ...], plan: KernelPlan, device: torch.device, eps: float) -> WarmupTables:
    lengths = segment_lengths(values, plan, sm_count(device))
    return WarmupTables(torch.tensor(values, dtype=torch.int32, device=device),
                        torch.tensor(lengths, dtype=torch.int32, device=device), tuple(lengths), math.log(eps))


def max_segments(lengths: tuple[int, ...], total_tokens: int, num_seqs: int) -> int:
    """An upper bound on the segments of any call of num_seqs sequences over total_tokens tokens
    under the segment table `lengths` (the kernels plan at most this many, and the workspace holds
    this many). Sequence i has c_i chunks with sum c_i <= T / 64 + N, and ceil(c_i / L(c_i)) segments."""
    chunks = total_tokens // 64 + num_seqs
    per_seq, shortest = 0, None
    for b, length in enumerate(lengths):
        if length <= 0:
            continue
        lowest = 1 if b == 0 else 2 ** (b - 1) + 1          # bucket b: 2^(b-1) < c <= 2^b
        highest = chunks if b == len(lengths) - 1 else min(2 ** b, chunks)  # the last bucket is open
        if highest <= length or highest < lowest:
            continue                                        # no sequence of this bucket is split
        per_seq = max(per_seq, -(-highest // length) - 1)   # extra segments grow with c inside a bucket
        shortest = length if shortest is None else min(shortest, length)
    extra = min(num_seqs * per_seq, chunks // shortest) if per_seq else 0
    return num_seqs + extra


__all__ = ["DEFAULT_EPS", "MAX_SEGMENTS", "SEGMENT_BUCKETS", "max_segments", "WarmupError", "WarmupTables", "normalise", "segment_lengths",
           "sm_count", "tables_for"]
