"""Other builds of a plan beside the product's (another csrc/ folder, extra nvcc flags), and the
op's own launch of a call captured through a library registered for its plan, so the launch can be
replayed on each build: how benchmarks/host_launch_ab.py compares this tree's library call with
an older csrc/'s. The builds share the plans' cache; their BuildConfig tells their entries apart.

Nothing here replaces a function of the runtime: the op reaches the recording library through
runtime.register_library, the runtime's public way to give a plan a library."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .. import cache, runtime
from ..build import BuildConfig
from ..plan import KernelPlan


def build_variants(plans: list[KernelPlan], flags: dict[str, tuple[str, ...] | BuildConfig]) -> dict[str, list]:
    """{variant: [cache entry per plan]}, every variant built with its extra nvcc flags (or its whole
    BuildConfig, e.g. another csrc/ folder to time an older tree beside this one); the variants
    build at once (nvcc runs in subprocesses)."""
    configs = {name: extra if isinstance(extra, BuildConfig) else BuildConfig(extra_flags=tuple(extra))
               for name, extra in flags.items()}
    with ThreadPoolExecutor(max(1, len(configs))) as pool:
        built = pool.map(lambda config: cache.get_kernels(plans, config=config), configs.values())
        return dict(zip(configs, built))


class RecordingLibrary:
    """A loaded kernel library that records each launch's (arguments, stream) before it launches;
    everything else is the wrapped library's."""

    def __init__(self, lib):
        self.lib = lib
        self.launches: list[tuple[object, int]] = []

    def launch(self, args, stream):
        self.launches.append((args, stream))
        return self.lib.launch(args, stream)

    def __getattr__(self, name):
        return getattr(self.lib, name)


def capture_launch(plan: KernelPlan, lib, call) -> tuple[object, int]:
    """(arguments, stream) of the last launch that call() makes of `plan`, run on `lib` (a library
    opened for plan). The recording library becomes plan's library for the rest of the process, so
    no call of plan may have loaded one before (the runtime keeps the first library a plan gets);
    call() must take the Python host path, as the first call of an op signature does."""
    recorder = RecordingLibrary(lib)
    runtime.register_library(plan, recorder)
    if runtime.library(plan) is not recorder:
        raise RuntimeError(f"plan {plan.name} already has a library in this process: capture its launch "
                           f"before any call of it")
    call()
    if not recorder.launches:
        raise RuntimeError(f"the call launched nothing on plan {plan.name}'s library (it took the C++ host "
                           f"path, or another plan)")
    return recorder.launches[-1]
