"""The backward's three kernel libraries (chain, prep, per-chunk gradients) build for sm_90a without a
GPU, and speak the Python side's ABI.

One module fixture builds the three side by side into the run's shared build cache (conftest's
build_cache; the tests that use it are marked slow: about two minutes on two cores). For each library: ptxas reports no spills,
no stack frame and no serialised wgmma in any of its kernels; SASS holds the wgmma (HGMMA)
instructions its GEMMs need; opened through ctypes it reports the ABI version, argument struct size
and spec the Python mirror expects, and refuses to open for another spec ("stale"); a registered
library is used without a build; a second lookup hits the cache. Without nvcc these tests skip.
"""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from flashqla_tune.backward import chain_kernels, chunk_kernels, prep_kernels
from flashqla_tune.backward.kernel_library import LibraryTable

from toolchain import needs_nvcc

pytestmark = [pytest.mark.slow, needs_nvcc]


@dataclass(frozen=True)
class Library:
    module: object
    spec: object          # what the backward uses at K = V = 128
    other_spec: object    # a spec the built library is not (opening it for this one is "stale")
    kernels: dict         # a piece of each kernel's mangled name -> its HGMMA count in SASS


LIBRARIES = {
    # kStates: S^T w^T (N = 64, K = 128: 8 k-steps) and Vn^T Kd (N = 128, K = 64: 4); kGradients adds
    # dO^T (D Q) (4 more)
    "chain": Library(chain_kernels, chain_kernels.ChainSpec(), chain_kernels.ChainSpec(stages=3),
                     {"ChainDirectionE0": 8 + 4, "ChainDirectionE1": 8 + 4 + 4}),
    # K K^T and Q K^T (N = 64, K = 128: 8 k-steps each), then u, P^T dO and w (N = 128, 64 tokens: 4 each)
    "prep": Library(prep_kernels, prep_kernels.PrepSpec(), prep_kernels.PrepSpec(head_v_dim=64),
                    {"gdn_bwd_prep_kernel": 2 * 8 + 3 * 4}),
    # k-steps of 16 at K = V = 128: over k or v (8 steps) dO Vn^T, Q K^T, K K^T, dO S^T, dVn S^T,
    # Vn dS'^T, dw K^T, dVn V^T; over the chunk's 64 tokens (4 steps) dQK K, T^T dVn, (T diag(d))^T dw,
    # A0^T X, (A0^T X) A0^T, dLb K, dLb^T K, dQK^T Q
    "chunk": Library(chunk_kernels, chunk_kernels.ChunkSpec(walk=True), chunk_kernels.ChunkSpec(operand_dtype="bfloat16"),
                     {"gdn_bwd_chunk_kernel": 8 * 8 + 8 * 4}),
}
KINDS = list(LIBRARIES)


@pytest.fixture(scope="module")
def built(build_cache):
    """kind -> (the kernel cache root, its cache entry), the three built at once into the run's
    shared build cache (tests/test_pack_build.py's pack then finds them there)."""
    root = build_cache / "kernels"
    with ThreadPoolExecutor(max_workers=len(LIBRARIES)) as pool:
        futures = {kind: pool.submit(lib.module.LIBRARIES.cache_entry, lib.spec, root)
                   for kind, lib in LIBRARIES.items()}
        return {kind: (root, f.result()) for kind, f in futures.items()}


def _entries(kind, resources) -> dict:
    """Kernel name piece -> (mangled name, ptxas info) of each kernel the library should hold."""
    entries = {name: info for name, info in resources.items() if info.get("entry")}
    out = {}
    for piece in LIBRARIES[kind].kernels:
        names = [n for n in entries if piece in n]
        assert len(names) == 1, (kind, piece, sorted(entries))
        out[piece] = (names[0], entries[names[0]])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_builds_without_spills(kind, built):
    for name, info in _entries(kind, built[kind][1].resources).values():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (name, info)
        assert info.get("stack_frame", 0) == 0, (name, info)
        assert "wgmma_serialized" not in info, (name, info)
        assert info["registers"] <= 255, (name, info)


@pytest.mark.parametrize("kind", KINDS)
def test_sass_runs_the_gemms_on_wgmma(kind, built):
    from flashqla_tune import sass

    entry = built[kind][1]
    try:
        summary = sass.instruction_counts(entry.so_path)
    except sass.SassError as exc:
        pytest.skip(str(exc))
    for piece, (name, _) in _entries(kind, entry.resources).items():
        assert summary.count("HGMMA", name) == LIBRARIES[kind].kernels[piece], (kind, piece)
        assert summary.count("LDL", name) == 0 and summary.count("STL", name) == 0, (kind, piece)
    if kind == "chain":   # the gradients' direction loads dO and D Q as well
        (states, _), (gradients, _) = (_entries(kind, entry.resources)[p] for p in LIBRARIES[kind].kernels)
        assert 0 < summary.count("UTMALDG", states) < summary.count("UTMALDG", gradients)
    if kind == "prep":    # q and k come by TMA
        name, _ = _entries(kind, entry.resources)["gdn_bwd_prep_kernel"]
        assert summary.count("UTMALDG", name) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_library_speaks_the_python_abi(kind, built):
    lib, entry = LIBRARIES[kind], built[kind][1]
    opened = lib.module.LIBRARIES.open(entry.so_path, lib.spec)   # checks ELF, version, struct size and spec
    assert opened.args_bytes() == ctypes.sizeof(lib.module.KIND.args_type)
    with pytest.raises(lib.module.KIND.error, match="stale"):
        lib.module.LIBRARIES.open(entry.so_path, lib.other_spec)


@pytest.mark.parametrize("kind", KINDS)
def test_a_registered_library_is_used_without_a_build(kind, built, monkeypatch):
    lib = LIBRARIES[kind]
    table = LibraryTable(lib.module.KIND)
    monkeypatch.setattr(lib.module, "LIBRARIES", table)
    opened = table.register(lib.spec, built[kind][1].so_path)
    monkeypatch.setattr(table, "cache_entry", lambda *a, **k: pytest.fail("built again"))
    assert lib.module.LIBRARIES.get(lib.spec) is opened


@pytest.mark.parametrize("kind", KINDS)
def test_second_lookup_hits_the_cache(kind, built):
    root, entry = built[kind]
    again = LIBRARIES[kind].module.LIBRARIES.cache_entry(LIBRARIES[kind].spec, root)
    assert again.path == entry.path and again.manifest["so_sha256"] == entry.manifest["so_sha256"]
    assert not again.built
