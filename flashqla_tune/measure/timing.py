"""Timers. Graph replay: warm up eagerly, capture ONE CUDA graph that calls the implementation on
R distinct input sets (so L2 cannot keep them resident), replay it, report the median replay time
divided by R: kernel time without host cost. Eager: the median of single calls timed on the host
with a synchronize on each side: host overhead included."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Timing:
    median_ms: float | None = None
    samples: list = field(default_factory=list)  # per-call ms
    error: str | None = None  # why there is no number (e.g. the call cannot be captured)

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "n": len(self.samples),
                "min_ms": min(self.samples) if self.samples else None, "error": self.error}


def rotation_count(set_bytes: int, l2_bytes: int, cap_bytes: int, max_sets: int = 32) -> int:
    """Input sets to rotate through: enough that together they are at least twice the L2, no
    more than fit in cap_bytes or max_sets, and at least one."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    want = math.ceil(2 * l2_bytes / set_bytes)
    return max(1, min(want, max_sets, cap_bytes // set_bytes))


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:300]


SLOW_MS = 20.0  # calls slower than this (the PyTorch baseline on long rows) get fewer samples
SLOW_MIN_SAMPLES = 3


def _count(first_ms: float, budget_s: float, lo: int, hi: int) -> int:
    lo = min(lo, SLOW_MIN_SAMPLES) if first_ms > SLOW_MS else lo
    return int(max(lo, min(hi, budget_s * 1e3 / max(first_ms, 1e-3))))


class CudaTimer:
    """The real timer (needs a GPU). budget_s bounds the time spent per measurement once the
    minimum sample count is reached."""

    def __init__(self, budget_s: float = 0.3, min_samples: int = 10, max_samples: int = 200):
        self.budget_s, self.min_samples, self.max_samples = budget_s, min_samples, max_samples

    def warmup(self, call, sets, rounds: int = 2) -> None:
        """Eager calls on every set (JIT compile, autotune, fill identity-keyed caches), on a side
        stream as graph capture wants."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(rounds):
                for x in sets:
                    call(x)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def graph(self, call, sets) -> Timing:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outs = [call(x) for x in sets]  # kept alive: each call writes its own outputs
            del outs
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:
            torch.cuda.synchronize()
            return Timing(error=f"capture failed: {_short(exc)}")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples: list[float] = []

        def once():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / len(sets))

        once()
        n = _count(samples[0] * len(sets), self.budget_s, self.min_samples, self.max_samples)
        samples.clear()
        for _ in range(n):
            once()
        del graph
        return Timing(statistics.median(samples), samples)

    def eager(self, call, sets) -> Timing:
        samples: list[float] = []

        def once(i):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(sets[i % len(sets)])
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e3)

        try:
            once(0)
            n = _count(samples[0], self.budget_s, self.min_samples, self.max_samples)
            samples.clear()
            for i in range(n):
                once(i)
        except Exception as exc:
            return Timing(error=f"eager call failed: {_short(exc)}")
        return Timing(statistics.median(samples), samples)


def kernel_launches_and_ms_per_call(call, repeats: int = 5,
                                    name_of=lambda name: name) -> dict[str, tuple[float, float]]:
    """Each CUDA kernel's launches and time (ms) per call of call() (torch.profiler over `repeats`
    calls, after one warm-up call, under no_grad), summed under name_of(kernel name): where one
    call's GPU time goes. The profile scripts in benchmarks/ and tools/ share it."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                call()
            torch.cuda.synchronize()
    per_kernel: dict[str, tuple[float, float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            key = name_of(evt.name)
            launches, ms = per_kernel.get(key, (0.0, 0.0))
            per_kernel[key] = (launches + 1 / repeats, ms + evt.device_time_total / 1e3 / repeats)
    return per_kernel


def kernel_ms_per_call(call, repeats: int = 5, name_of=lambda name: name) -> dict[str, float]:
    """kernel_launches_and_ms_per_call's times alone."""
    return {key: ms for key, (_, ms) in kernel_launches_and_ms_per_call(call, repeats, name_of).items()}
