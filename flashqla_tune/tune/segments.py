"""The segment-length stage of tuning (DESIGN.md, "Tuning protocol"): the cost model's
segment table (flashqla_tune/cp_cost_model.py) refined on the GPU for the length buckets the
scoreboard's sequences fall in.

For each bucket, the plan's forward runs with the pack's warm-up table and each candidate segment
length, on one sequence that fills the bucket and on a batch of BATCH of them. Batch invariance
keeps the batch out of the run-time choice, so the stage keeps the length with the smallest
geometric mean of the two times: the same hedge the cost model makes (`batch_weight`), here
measured. Buckets no scoreboard length falls in keep the model's entry. Any table is correct
(the kernels chain exactly wherever a window does not hold, for any segment length: the forced
segment-length GPU tests), so a candidate needs no oracle check, only a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..cp_cost_model import check_segment_table
from ..segment_policy import bucket_of_chunks

TUNED_TOKENS = (2048, 8192, 32768)   # the scoreboard's lengths (1x2048, 1x8192, 1x32768)
BATCH = 4                            # the batched case: BATCH sequences of the bucket's length
LENGTHS = (16, 32, 64, 128, 256, 512, 1024)  # candidate segment lengths in chunks (besides 0: no split)

# time_fn(seqlens, segment_table) -> median ms of the plan's forward on that length mix
TimeFn = Callable[[tuple[int, ...], tuple[int, ...]], float]


def bucket_of(tokens: int) -> int:
    """The segment-table entry a sequence of `tokens` tokens reads."""
    return bucket_of_chunks(-(-tokens // 64))


def candidates(tokens: int, model_length: int, max_window: int) -> list[int]:
    """No split, the model's choice, and every candidate that splits the sequence and is longer
    than the longest window it warms up over."""
    chunks = -(-tokens // 64)
    out = {0} | {L for L in LENGTHS if max_window < L < chunks}
    if 0 < model_length < chunks:
        out.add(model_length)
    return sorted(out)


@dataclass(frozen=True)
class SegmentTuning:
    lengths: tuple[int, ...]                       # the refined table (SEGMENT_BUCKETS entries)
    model_lengths: tuple[int, ...]                 # the cost model's, which it started from
    timings: dict[int, dict[int, dict[str, float]]]  # tokens -> segment length -> {"alone", "batch", "score"} ms

    def gains(self) -> dict[int, float]:
        """Per tuned length: the cost model's choice's score over the chosen one's (above 1: the
        measured choice is faster; 1.0 where both are the same length)."""
        out = {}
        for tokens, by_length in self.timings.items():
            b, chunks = bucket_of(tokens), -(-tokens // 64)
            model, chosen = (L if 0 < L < chunks else 0 for L in (self.model_lengths[b], self.lengths[b]))
            if model in by_length and chosen in by_length:
                out[tokens] = by_length[model]["score"] / by_length[chosen]["score"]
        return out

    def record(self) -> dict:
        """What the pack's manifest keeps (JSON: string keys)."""
        return {"lengths": list(self.lengths), "model_lengths": list(self.model_lengths),
                "batch": BATCH, "gain_over_model": {str(t): g for t, g in self.gains().items()},
                "timings_ms": {str(t): {str(L): v for L, v in by_length.items()}
                               for t, by_length in self.timings.items()}}


def tune_segment_table(model_lengths, max_window: int, time_fn: TimeFn,
                       tokens: tuple[int, ...] = TUNED_TOKENS) -> SegmentTuning:
    """Refine model_lengths bucket by bucket (shortest first: a longer bucket's times do not
    depend on a shorter one's entry, since every timed sequence fills its own bucket)."""
    model = check_segment_table(tuple(model_lengths))
    if max_window < 0:
        raise ValueError(f"max_window={max_window} must be >= 0")
    buckets = [bucket_of(t) for t in sorted(set(tokens))]
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"tokens={sorted(set(tokens))} put two lengths in one segment-table bucket "
                         f"(buckets {buckets}): one would overwrite the other's choice")
    lengths = list(model)
    timings: dict[int, dict[int, dict[str, float]]] = {}
    for t in sorted(set(tokens)):
        b = bucket_of(t)
        results: dict[int, dict[str, float]] = {}
        for length in candidates(t, model[b], max_window):
            table = tuple(lengths[:b] + [length] + lengths[b + 1:])
            alone, batch = time_fn((t,), table), time_fn((t,) * BATCH, table)
            if not (math.isfinite(alone) and math.isfinite(batch) and alone > 0 and batch > 0):
                raise ValueError(f"{t} tokens, segment length {length}: times must be positive, got "
                                 f"alone={alone}, batch={batch}")
            results[length] = {"alone": alone, "batch": batch, "score": math.sqrt(alone * batch)}
        # ties go to the split with less work: no split first, then the longest segments
        lengths[b] = min(results, key=lambda L: (results[L]["score"], L != 0, -L))
        timings[t] = results
    return SegmentTuning(tuple(lengths), model, timings)


def gpu_time_fn(plan, warmup: tuple[int, ...], eps: float, budget_s: float = 0.2) -> TimeFn:
    """Median CUDA-graph replay of plan's forward with `warmup` and the given segment table, on the
    protocol's inputs (made once per length mix and shared by every candidate)."""
    import torch

    from .. import runtime
    from ..measure.cases import Case
    from ..measure.inputs import make_rotation
    from ..measure.timing import CudaTimer

    spec = plan.spec
    dtype = torch.bfloat16 if spec.qkv_dtype == "bfloat16" else torch.float16
    timer = CudaTimer(budget_s=budget_s)
    sets: dict[tuple[int, ...], list] = {}
    vk = spec.state_layout == "vk"

    def time_fn(seqlens: tuple[int, ...], table: tuple[int, ...]) -> float:
        if seqlens not in sets:
            sets[seqlens] = make_rotation(Case(spec.num_qk_heads, spec.num_v_heads, seqlens), 2, "cuda", dtype=dtype)
            if vk:
                for x in sets[seqlens]:
                    x.initial_state = x.initial_state.transpose(-1, -2).contiguous()

        def call(x):
            # the longest sequence, as the op knows it from cu_seqlens_cpu: an unsplit batch skips the CP kernels
            return runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, x.initial_state, x.scale,
                                   True, False, warmup=warmup, warmup_eps=eps, segment_lengths=table,
                                   longest_tokens=max(seqlens))
        with torch.no_grad():
            timer.warmup(call, sets[seqlens], rounds=1)
            timing = timer.graph(call, sets[seqlens])
        if timing.median_ms is None:
            raise RuntimeError(f"segment tuning, {seqlens}: {timing.error}")
        return timing.median_ms
    return time_fn


__all__ = ["BATCH", "LENGTHS", "SegmentTuning", "TUNED_TOKENS", "bucket_of", "candidates", "gpu_time_fn",
           "tune_segment_table"]
