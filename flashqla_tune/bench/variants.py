"""Build variants of our kernels (extra nvcc flags such as -DFQT_PREP_ABLATE) side by side, and run
one variant in place of a plan's own library: what scripts/prep_ablation.py and prep_variants.py
measure with. The variants share the plans' cache; only the flags tell their entries apart."""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import cache, host_path, runtime
from ..build import BuildConfig
from ..loader import open_library
from ..plan import KernelPlan
from .accuracy import rel_l2
from .timing import kernel_ms_per_call


def build_variants(plans: list[KernelPlan], flags: dict[str, tuple[str, ...] | BuildConfig]) -> dict[str, list]:
    """{variant: [cache entry per plan]}, every variant built with its extra nvcc flags (or its whole
    BuildConfig, e.g. another csrc/ folder to time an older tree beside this one); the variants
    build at once (nvcc runs in subprocesses)."""
    configs = {name: extra if isinstance(extra, BuildConfig) else BuildConfig(extra_flags=tuple(extra))
               for name, extra in flags.items()}
    with ThreadPoolExecutor(max(1, len(configs))) as pool:
        built = pool.map(lambda config: cache.get_kernels(plans, config=config), configs.values())
        return dict(zip(configs, built))


@contextlib.contextmanager
def running(entry, plan: KernelPlan):
    """Inside, every forward launch uses the library of `entry` (a variant of `plan`); the
    runtime's own lookup is back afterwards, also when the body raises. Op calls inside take the
    Python host path (the C++ one launches the library its context remembered)."""
    lib = open_library(entry.so_path, plan)
    own, switch = runtime.library, os.environ.get(host_path.ENV_SWITCH)
    runtime.library = lambda _plan: lib
    os.environ[host_path.ENV_SWITCH] = "python"
    try:
        yield lib
    finally:
        runtime.library = own
        if switch is None:
            os.environ.pop(host_path.ENV_SWITCH, None)
        else:
            os.environ[host_path.ENV_SWITCH] = switch


def prep_ms(forward, repeats: int = 5) -> float:
    """The prep kernel's GPU time per call of forward() (ms), the other kernels left out."""
    per_kernel = kernel_ms_per_call(forward, repeats, lambda kernel: "prep" if "gdn_prep_kernel" in kernel else "other")
    return round(per_kernel["prep"], 4)


def check_fields(o, state, ref_o, ref_state, first: tuple) -> dict:
    """What a variant script records of one variant's run of an oracle check: the relative L2 of
    o and of the final state against the float64 reference, whether an element stayed unwritten
    (NaN: the outputs are poisoned before the run), and whether both equal the first variant's
    run of the same check bit for bit (first: its (o, state); a variant that only moves work
    between threads or CTAs must give the same bits)."""
    return {"o": rel_l2(o, ref_o), "state": rel_l2(state, ref_state),
            "nan": bool(torch.isnan(o).any() or torch.isnan(state).any()),
            "bitwise_as_first": bool(torch.equal(o, first[0]) and torch.equal(state, first[1]))}
