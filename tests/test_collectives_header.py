"""The kernels' collectives compile for head dims other than the plans' 128.

The plans instantiate the kernels at K = V = 128 only (plan validation refuses other dims), but
the collectives in csrc/ take K and V as template parameters: the forward kernel's producer,
consumer chunk step and epilogue (gdn_fwd_mainloop.cuh, its pipelines in gdn_pipeline.cuh), the
prep (gdn_prep.cuh, with the CP job planner it runs) and the CP chain (gdn_cp.cuh); the forward,
prep and chain kernels fill their rings through one TMA producer (gdn_tma_producer.cuh). This test
instantiates them with nvcc -arch=sm_90a -ptx (through the front end and NVVM to PTX, never
launched; ptxas, a third of the time, only allocates registers, and the plans' own builds run it
for the shapes that launch) for K, V in {64, 128, 256},
with the forward kernel's, the prep's and the chain's composed shared storage and the CP scheduler,
and checks that the combinations a collective does not support yet stop at their static_assert:

- the CP chain needs K = V (its M maps a state to a state) and two K x K fp32 buffers in shared
  memory, so K = V = 256 does not fit; at K = 64 four threads share a state row, so a CTA of
  4 columns is too narrow (each thread reads whole float2s);
- the 128-thread prep keeps Q K^T's fp32 tile in the q tile, which needs K >= 128.
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flashqla_tune import environment
from flashqla_tune.render import csrc_dir

from toolchain import needs_nvcc

DIMS = (64, 128, 256)


pytestmark = [pytest.mark.slow, needs_nvcc]

HEADER = r'''
#include <stddef.h>  // offsetof
#include "gdn_fwd_host.cuh"   // every collective: pipelines, forward, prep, CP planner and chain
namespace {
template <int K, int V, bool OutputGroup = false>
using Fwd = fqt::FwdConfig<cutlass::bfloat16_t, /*Hqk=*/1, /*Hv=*/2, K, V, /*block_v=*/64, /*stages=*/1,
                           /*state_v_first=*/false, /*producer_regs=*/40, /*consumer_regs=*/232,
                           /*ctas_per_sm=*/1, OutputGroup, /*prep_threads=*/256>;
template <int K, int Threads>
using Prep = fqt::PrepArgs<fqt::PrepConfig<cutlass::half_t, 1, K, Threads>>;
}  // namespace
'''


def forward(k: int, v: int) -> str:
    lines = [f"template __global__ void fqt::gdn_fwd_kernel<Fwd<{k}, {v}>, false>("
             f"CUTE_GRID_CONSTANT const fqt::FwdParams<Fwd<{k}, {v}>>);"]
    if k == v:  # the CP state pass (a transition job starts from S = I)
        lines.append(f"template __global__ void fqt::gdn_fwd_kernel<Fwd<{k}, {v}>, true>("
                     f"CUTE_GRID_CONSTANT const fqt::FwdParams<Fwd<{k}, {v}>>);")
    if k == v == 128:  # the output warp group
        lines.append("template __global__ void fqt::gdn_fwd_kernel<Fwd<128, 128, true>, false>("
                     "CUTE_GRID_CONSTANT const fqt::FwdParams<Fwd<128, 128, true>>);")
    return "\n".join(lines)


def prep(k: int, threads: int) -> str:
    return (f"template __global__ void fqt::gdn_prep_kernel<cutlass::half_t, 1, 2, {k}, {threads}>("
            f"CUTE_GRID_CONSTANT const Prep<{k}, {threads}>);")


def storage(k: int, v: int) -> str:
    """The forward kernel's shared storage composed of its collectives' parts, each where its
    accesses need it (the TMA tiles and an output warp group's handoff on 1024 bytes), and the
    size the launch asks for; the producer type over its ring."""
    lines = [f"template struct fqt::TmaProducer<Fwd<{k}, {v}>::MainPipeline>;"]
    for og in ("false", "true") if v == 128 else ("false",):
        cfg = f"Fwd<{k}, {v}, {og}>"
        s = f"FwdStorage_{og}"  # an alias: offsetof is a macro, its type argument may not hold commas
        lines += [
            f"using {s} = fqt::FwdSharedStorage<{cfg}>;",
            f"static_assert(sizeof({s}) == {cfg}::SmemBytes, \"the launch's size is the composed storage's\");",
            f"static_assert(offsetof({s}, tiles) == 0 && alignof({s}) == 1024, \"the stage tiles open the storage\");",
            f"static_assert(offsetof({s}, handoff) % ({og} ? 1024 : 16) == 0, \"the handoff buffers' alignment\");",
            f"static_assert(offsetof({s}, gates) % 16 == 0 && offsetof({s}, pipelines) % 8 == 0, "
            f"\"the gates' bulk copy and the barriers' alignment\");",
        ]
    return "\n".join(lines)


def chain_storage(k: int, columns: int) -> str:
    s = f"ChainStorage_{k}_{columns}"
    return "\n".join([
        f"using {s} = fqt::ChainSharedStorage<{k}, {columns}>;",
        f"static_assert(fqt::chain_smem_bytes<{k}, {columns}>() == int(sizeof({s})), \"the chain's launch size\");",
        f"static_assert(offsetof({s}, m) == 0 && offsetof({s}, ring) % 8 == 0, \"M's buffers, then the barriers\");",
    ])


def prep_storage(k: int, threads: int) -> str:
    """The prep's shared storage composed of its parts (the layout's static_asserts in PrepConfig
    run on its instantiation) and the size the launch asks for."""
    cfg = f"fqt::PrepConfig<cutlass::half_t, 1, {k}, {threads}>"
    s = f"PrepStorage_{k}_{threads}"
    return "\n".join([
        f"template struct {cfg};",
        f"using {s} = {cfg}::SharedStorage;",
        f"static_assert({cfg}::SmemBytes <= int(sizeof({s})) && alignof({s}) == 1024, "
        f"\"the launch's bytes lie in the storage\");",
        f"static_assert(offsetof({s}, gates) % 16 == 0 && offsetof({s}, loaded) % 8 == 0, "
        f"\"the gates' 16-byte reads and the barrier's alignment\");",
        *([f"static_assert(offsetof({s}, extra_x) % 16 == 0 && {cfg}::SmemBytes == "
           f"int(offsetof({s}, extra_x) + sizeof({s}::extra_x)), \"the extra X tiles end the launch's bytes\");"]
          if threads == 256 else []),
        # the plans' K: the CTAs per SM that the kernel's launch bounds promise fit an SM's 228 KB
        # of shared memory (1 KB of it reserved per CTA)
        *([f"static_assert({cfg}::CtasPerSm * ({cfg}::SmemBytes + 1024) <= 228 * 1024, "
           f"\"CtasPerSm CTAs fit an SM's shared memory\");"] if k == 128 else []),
    ])


def chain(k: int, columns: int) -> str:
    return f"template __global__ void fqt::cp_chain_kernel<2, {k}, {k}, false, {columns}>(const fqt::CpPlanArgs);"


SUPPORTED = {
    **{f"forward-k{k}-v{v}": forward(k, v) for k in DIMS for v in DIMS},
    **{f"storage-k{k}-v{v}": storage(k, v) for k in DIMS for v in DIMS},
    "chain-storage": "\n".join([*(chain_storage(k, c) for k in (64, 128) for c in (8, 16)),
                                 "template struct fqt::TmaProducer<fqt::ChainRing>;",
                                 "template struct fqt::CpScheduler<2>;"]),
    **{f"prep-k{k}-t256": prep(k, 256) for k in DIMS},
    **{f"prep-k{k}-t128": prep(k, 128) for k in (128, 256)},
    "prep-storage": "\n".join([*(prep_storage(k, 256) for k in DIMS), *(prep_storage(k, 128) for k in (128, 256))]),
    "chain-k64": "\n".join(chain(64, c) for c in (8, 16)),
    "chain-k128": "\n".join(chain(128, c) for c in (4, 8, 16)),
}

UNSUPPORTED = {
    "chain-k256": (chain(256, 16), "two K x K fp32 M buffers must fit in shared memory"),
    "chain-k64-c4": (chain(64, 4), "a thread's columns are read as one float2 or float4s"),
    "chain-k-ne-v": ("template __global__ void fqt::cp_chain_kernel<2, 128, 64, false, 8>(const fqt::CpPlanArgs);",
                     "the exact chain needs K = V"),
    "prep-k64-t128": (prep(64, 128), "Q K^T's fp32 tile fits the q tile"),
}


def _compile(folder: Path, name: str, body: str) -> subprocess.CompletedProcess:
    source = folder / f"{name}.cu"
    source.write_text(HEADER + body + "\n")
    cmd = [str(environment.find_nvcc()), "-arch=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", "-O3",
           "-DNDEBUG", f"-I{csrc_dir()}", f"-I{environment.cutlass_include_dir()}", "-ptx", str(source),
           "-o", str(folder / f"{name}.ptx")]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every unit compiled once, as many at a time as there are cores (each nvcc is one process)."""
    folder = tmp_path_factory.mktemp("collectives")
    units = {**SUPPORTED, **{name: body for name, (body, _) in UNSUPPORTED.items()}}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        procs = dict(zip(units, pool.map(lambda name: _compile(folder, name, units[name]), units)))
    return {name: (proc, folder / f"{name}.ptx") for name, proc in procs.items()}


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_collectives_instantiate(compiled, name):
    proc, obj = compiled[name]
    assert proc.returncode == 0, f"{name} does not compile:\n{proc.stderr[-6000:]}"
    assert obj.stat().st_size > 0
    if name.startswith(("forward", "prep-k", "chain-k")):
        assert ".entry" in obj.read_text(), f"{name}'s PTX holds no kernel entry"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_dims_stop_at_their_static_assert(compiled, name):
    message = UNSUPPORTED[name][1]
    proc, _ = compiled[name]
    assert proc.returncode != 0, f"{name} compiled, but the collective does not support it"
    assert message in proc.stderr, f"{name} failed for another reason:\n{proc.stderr[-6000:]}"
