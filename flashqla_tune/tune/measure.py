"""The GPU measurement the tuner injects into BatchTuner: build through the kernel cache,
check against the float64 oracle on fresh random inputs, time by CUDA-graph replay with
rotated inputs over the scoreboard's length mix. Needs nvcc (build) and an sm_90 GPU (the rest).
"""
from __future__ import annotations

import functools
import math
import os
import secrets

from .. import cache, runtime, warmup_tables
from ..measure.accuracy import rel_l2
from ..measure.cases import SEQLENS, Case, format_seqlens
from ..measure.inputs import make_inputs, make_rotation
from ..measure.timing import CudaTimer, rotation_count
from ..build import BuildError
from ..segment_policy import SEGMENT_BUCKETS
from ..plan import KernelPlan
from .isolation import CallTimeouts, isolated
from .trial import BuildOutcome, CheckResult, Measurement

CHECK_SEQLENS = (700, 1100, 37)   # a chunk tail, a multi-chunk row and a sub-chunk row
CHECK_TOLERANCE = 1e-2            # DESIGN.md's ceiling for the relative L2 error of o and state
ROTATION_CAP_BYTES = 8 << 30


class CacheBuilder:
    """Builds a batch with one cache.get_kernels call (ninja runs `jobs` nvcc at once)."""

    def __init__(self, jobs: int | None = None):
        self.jobs = jobs or max(1, os.cpu_count() or 1)

    def build(self, plans: list[KernelPlan]) -> dict[str, BuildOutcome]:
        try:
            entries = cache.get_kernels(plans, jobs=self.jobs)
            return {e.plan.name: BuildOutcome(handle=e) for e in entries}
        except BuildError as exc:
            failed = {name: text for name, _, text in exc.failures}
        out: dict[str, BuildOutcome] = {}
        for plan in plans:
            if plan.name in failed:
                out[plan.name] = BuildOutcome(error=f"compile failed: {failed[plan.name][-1500:]}")
            else:
                entry = cache.lookup(plan)   # the batch's other plans were published before the raise
                out[plan.name] = BuildOutcome(handle=entry, error=None if entry else "built but not in the cache")
        return out


def _dtype(plan: KernelPlan):
    import torch

    return torch.bfloat16 if plan.spec.qkv_dtype == "bfloat16" else torch.float16


def forward_on_inputs(plan: KernelPlan, x, out=None, final_out=None, prep_schedule: str = "auto", **cp):
    """Run plan on a protocol input set, whose states are [N,Hv,K,V]; a state_v_first plan gets
    them transposed in and gives them back transposed, so results compare with the oracle. cp:
    runtime.forward's context-parallel arguments (warmup, warmup_eps, segment_lengths)."""
    vk = plan.spec.state_layout == "vk"
    h0 = x.initial_state.transpose(-1, -2).contiguous() if vk else x.initial_state
    o, s = runtime.forward(plan, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens_long, h0, x.scale,
                           True, False, out=out, final_out=final_out, prep_schedule=prep_schedule, **cp)
    return o, (s.transpose(-1, -2) if vk else s)


def forced_cp_arguments(num_v_heads: int) -> dict:
    """Context parallelism on the checker's short sequences: the op's default warm-up table and
    eps, and every length bucket cut into segments one chunk longer than the window, so the
    700- and 1100-token sequences split in two. A pack runs its plan this way, so a config whose
    CP kernels (the state pass, the chain) fail is rejected like one whose chain fails."""
    length = warmup_tables.DEFAULT_WINDOW_CHUNKS + 1
    return {"warmup": warmup_tables.default_table(num_v_heads), "warmup_eps": warmup_tables.DEFAULT_EPS,
            "segment_lengths": (length,) * SEGMENT_BUCKETS}


class OracleChecker:
    """Fresh random protocol inputs per check (a new seed each time), outputs poisoned with NaN;
    the plan runs twice, as one chain per sequence and with context parallelism forced
    (forced_cp_arguments), and both must meet the tolerance."""

    def __init__(self, tolerance: float = CHECK_TOLERANCE, device: str = "cuda"):
        self.tolerance, self.device = tolerance, device

    def check(self, plan: KernelPlan, handle) -> CheckResult:
        import torch

        from ..oracle import chunk_gated_delta_rule_chunked

        spec = plan.spec
        seed = secrets.randbelow(2**31)
        x = make_inputs(Case(spec.num_qk_heads, spec.num_v_heads, CHECK_SEQLENS), self.device, seed=seed,
                        dtype=_dtype(plan))

        def poisoned():
            final = torch.full(x.initial_state.shape, float("nan"), dtype=torch.float32, device=x.v.device)
            return torch.full_like(x.v, float("nan")), (final.transpose(-1, -2).contiguous()
                                                        if spec.state_layout == "vk" else final)

        with torch.no_grad():
            o, s = forward_on_inputs(plan, x, *poisoned())
            o_cp, s_cp = forward_on_inputs(plan, x, *poisoned(), **forced_cp_arguments(spec.num_v_heads))
            if x.v.is_cuda:
                torch.cuda.synchronize()
            ref_o, ref_s = chunk_gated_delta_rule_chunked(
                x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
                output_final_state=True, cu_seqlens=x.cu_seqlens_long)
        errors = {"o": rel_l2(o, ref_o), "state": rel_l2(s, ref_s),
                  "o_cp": rel_l2(o_cp, ref_o), "state_cp": rel_l2(s_cp, ref_s)}
        ok = all(math.isfinite(e) and e <= self.tolerance for e in errors.values())
        return CheckResult(ok, errors, f"seed {seed}, tolerance {self.tolerance:g}")


class GraphTimer:
    """Median graph-replay time per length mix; the inputs of a mix are made once and shared by
    every trial of the run, so configs are compared on the same data."""

    def __init__(self, seqlens=SEQLENS, budget_s: float = 0.3, device: str = "cuda"):
        self.seqlens, self.device = tuple(tuple(s) for s in seqlens), device
        self.timer = CudaTimer(budget_s=budget_s)
        self._sets: dict = {}

    def _rotation(self, case: Case, dtype):
        key = (case.num_qk_heads, case.num_v_heads, case.seqlens, dtype)
        if key not in self._sets:
            import torch

            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 0
            probe = make_rotation(case, 1, self.device, dtype=dtype)
            count = rotation_count(probe[0].nbytes(), l2, ROTATION_CAP_BYTES) if l2 else 1
            cu = (probe[0].cu_seqlens, probe[0].cu_seqlens_long, probe[0].cu_seqlens_cpu)
            self._sets[key] = probe + (make_rotation(case, count - 1, self.device, seed=1, dtype=dtype, cu=cu)
                                       if count > 1 else [])
        return self._sets[key]

    def time(self, plan: KernelPlan, handle) -> dict[str, float]:
        return self.time_call(plan.spec, _dtype(plan), lambda x: forward_on_inputs(plan, x))

    def time_call(self, spec, dtype, fn) -> dict[str, float]:
        """Median graph replay of fn(inputs) per length mix, on the run's shared input sets."""
        import torch

        times = {}
        for seqlens in self.seqlens:
            sets = self._rotation(Case(spec.num_qk_heads, spec.num_v_heads, seqlens), dtype)
            with torch.no_grad():
                self.timer.warmup(fn, sets, rounds=1)
                timing = self.timer.graph(fn, sets)
            if timing.median_ms is None:
                raise RuntimeError(f"{format_seqlens(seqlens)}: {timing.error}")
            times[format_seqlens(seqlens)] = timing.median_ms
        return times


class GraphAnchorTimer:
    """FLA and FlashQLA (whichever import here) on the tuner's own mixes and input sets, so the
    closing table's ratios come from one run. A missing or failing anchor is recorded with the
    reason."""

    def __init__(self, graph_timer: GraphTimer, names=("fla", "flashqla")):
        self.graph_timer, self.names = graph_timer, tuple(names)

    def time(self, spec) -> dict[str, dict]:
        import torch

        from ..measure.impls import call, load_impls

        loaded, skipped = load_impls(self.names)
        out: dict[str, dict] = {name: {"error": why} for name, why in skipped.items()}
        dtype = torch.bfloat16 if spec.qkv_dtype == "bfloat16" else torch.float16
        for impl in loaded:
            try:
                times = self.graph_timer.time_call(spec, dtype, lambda x, impl=impl: call(impl, x))
                out[impl.name] = {"times_ms": times, "version": impl.version}
            except Exception as exc:
                out[impl.name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        return out


def cuda_context_alive() -> bool:
    """Whether this process can still run work on its GPU: a kernel fault is sticky, after it
    every synchronize and launch fails."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def in_process_gpu_measurement(seqlens=SEQLENS, anchors=("fla", "flashqla")) -> Measurement:
    """Checker, timer and anchor timer on this process's GPU (no builder): what the measuring
    process of isolation.py runs."""
    timer = GraphTimer(seqlens)
    return Measurement(None, OracleChecker(), timer, GraphAnchorTimer(timer, anchors) if anchors else None,
                       context_alive=cuda_context_alive)


def gpu_measurement(jobs: int | None = None, seqlens=SEQLENS, anchors=("fla", "flashqla"),
                    timeouts: CallTimeouts = CallTimeouts()) -> Measurement:
    """Builds here; checks and times in a child process (isolation.py), so a config that faults or
    hangs costs its own trial only."""
    factory = functools.partial(in_process_gpu_measurement, tuple(tuple(s) for s in seqlens), tuple(anchors or ()))
    return isolated(CacheBuilder(jobs), factory, anchors=bool(anchors), timeouts=timeouts)
