"""Build (ninja + nvcc sm_90a), content-addressed cache, ctypes loading and SASS reading.

Everything that compiles uses the trivial fixture template (a few seconds per build) and is
marked slow; CI runs it anyway.
"""
from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
from pathlib import Path

import pytest

from flashqla_tune import cache, environment, loader, sass
from flashqla_tune.build import BuildConfig, BuildError, parse_ptxas_report
from flashqla_tune.cli import main as cli_main
from flashqla_tune.plan import KernelPlan, TileParams, default_plan
from flashqla_tune.render import Renderer, csrc_dir
from flashqla_tune.spec import GDNSpec

from toolchain import needs_nvcc

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_TEMPLATES = FIXTURES / "templates"
PLAN = default_plan(GDNSpec(2, 8))
OTHER = KernelPlan(GDNSpec(2, 8), TileParams(block_v=128))


compiles = [pytest.mark.slow, needs_nvcc]


class Toolchain:
    """A private copy of the fixture template and csrc headers (so tests can edit them) and a cache root."""

    def __init__(self, tmp: Path):
        self.templates = tmp / "templates"
        self.csrc = tmp / "csrc"
        self.root = tmp / "cache" / "kernels"
        shutil.copytree(FIXTURE_TEMPLATES, self.templates, ignore=shutil.ignore_patterns("csrc"))
        shutil.copytree(FIXTURE_TEMPLATES / "csrc", self.csrc)
        shutil.copy(csrc_dir() / "gdn_abi.h", self.csrc / "gdn_abi.h")   # the real ABI header
        self.renderer = Renderer(self.templates)
        self.config = BuildConfig(csrc=self.csrc)

    def get(self, plan=PLAN, config=None, **kw) -> cache.CacheEntry:
        return cache.get_kernel(plan, self.renderer, config or self.config, self.root, **kw)


@pytest.fixture
def tc(tmp_path) -> Toolchain:
    return Toolchain(tmp_path)


# ---- pure-Python parts (fast) ----

def test_include_scanner_follows_nested_quoted_and_angle_includes(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.cuh").write_text('#pragma once\n  #  include "sub/b.cuh"\n#include <cute/tensor.hpp>\n')
    (tmp_path / "sub" / "b.cuh").write_text('#include "c.cuh"\n#include <d.cuh>\n')   # c beside b; d from -I
    (tmp_path / "sub" / "c.cuh").write_text("// leaf\n")
    (tmp_path / "d.cuh").write_text('#include "a.cuh"\n')                                # a cycle
    (tmp_path / "unused.cuh").write_text("// not included\n")
    found = cache.included_headers('#include "a.cuh"\n#include <cuda_runtime.h>\n', tmp_path)
    names = sorted(str(p.relative_to(tmp_path.resolve())) for p in found)
    assert names == ["a.cuh", "d.cuh", "sub/b.cuh", "sub/c.cuh"]


def test_include_scanner_takes_all_of_csrc_for_computed_includes(tmp_path):
    (tmp_path / "a.cuh").write_text("#include KERNEL_HEADER\n")
    (tmp_path / "b.cuh").write_text("")
    found = cache.included_headers('#include "a.cuh"\n', tmp_path)
    assert {p.name for p in found} == {"a.cuh", "b.cuh"}


def test_ptxas_report_is_parsed_per_function():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z4kernPf' for 'sm_90a'
ptxas info    : Function properties for _Z4kernPf
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1024 bytes smem, 560 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    report = parse_ptxas_report(text)
    assert report["_Z4kernPf"] == {"entry": True, "stack_frame": 8, "spill_stores": 12, "spill_loads": 16,
                                   "registers": 168, "barriers": 16, "smem": 1024, "cmem": {"cmem[0]": 560}}
    assert report["_Z6helperv"] == {"entry": False, "stack_frame": 24, "spill_stores": 0, "spill_loads": 0}
    serialized = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
                  "serialized due to non wgmma instructions reading accumulator registers of  a wgmma between "
                  "start and end of the pipeline stage in the function '_Z4kernPf'\n")
    report = parse_ptxas_report(serialized + text)
    assert report["_Z4kernPf"]["wgmma_serialized"].startswith("non wgmma instructions reading accumulator")
    assert report["_Z4kernPf"]["registers"] == 168 and "wgmma_serialized" not in report["_Z6helperv"]


def test_sass_parser_counts_opcodes_without_modifiers():
    text = """
\t\tFunction : _Z4kernv
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 HGMMA.64x64x16.F32.BF16 gdesc[UR4], RZ, !UPT ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 gdesc[UR8], R24, gsb0 ;
        /*0030*/               @P1 UTMALDG.2D [UR8], [UR4] ;
\t\tFunction : _Z5otherv
        /*0000*/                   EXIT ;
"""
    summary = sass.parse_sass(text)
    assert summary.count("HGMMA") == 2 and summary.count("UTMALDG") == 1
    assert summary.count("EXIT", "_Z5otherv") == 1 and summary.count("HGMMA", "_Z5otherv") == 0


# ---- builds with nvcc (slow) ----

@pytest.mark.slow
@needs_nvcc
def test_hit_after_build(tc):
    first = tc.get()
    assert first.built and first.so_path.is_file() and first.source_path.is_file()
    assert first.path.name == f"{PLAN.name}-{first.key[:16]}"
    m = first.manifest
    assert m["plan"] == PLAN.to_dict() and m["so_sha256"] == cache.sha256_file(first.so_path)
    assert set(m["inputs"]["headers"]) == {"gdn_abi.h", "fixture_kernel.cuh", "detail/fixture_math.cuh"}
    assert m["inputs"]["nvcc"] and m["inputs"]["cutlass"] == environment.cutlass_version()
    kernels = {n: r for n, r in first.resources.items() if r["entry"]}
    assert len(kernels) == 1 and next(iter(kernels.values()))["registers"] > 0
    assert (first.path / f"{PLAN.name}.resources.json").is_file()
    assert "ptxas info" in (first.path / m["ptxas_log"]).read_text()
    second = tc.get()
    assert not second.built and second.path == first.path and second.key == first.key
    assert cache.lookup(PLAN, tc.renderer, tc.config, tc.root).path == first.path


@pytest.mark.slow
@needs_nvcc
def test_miss_on_changed_source_nested_header_and_flags(tc):
    base = tc.get()
    template = tc.templates / "gdn_fwd.cu.j2"
    template.write_text(template.read_text() + "// a template edit\n")
    edited_source = tc.get()
    assert edited_source.built and edited_source.key != base.key

    nested = tc.csrc / "detail" / "fixture_math.cuh"
    nested.write_text(nested.read_text() + "// a nested header edit\n")
    edited_header = tc.get()
    assert edited_header.built and edited_header.key not in {base.key, edited_source.key}

    flagged = tc.get(config=BuildConfig(csrc=tc.csrc, extra_flags=("-DNDEBUG", "-DFIXTURE_FLAG=1")))
    assert flagged.built and flagged.key not in {base.key, edited_source.key, edited_header.key}
    assert "-DFIXTURE_FLAG=1" in flagged.manifest["inputs"]["flags"]
    # An unrelated csrc file is not part of the key.
    (tc.csrc / "unrelated.cuh").write_text("// nobody includes me\n")
    assert not tc.get(config=BuildConfig(csrc=tc.csrc, extra_flags=("-DNDEBUG", "-DFIXTURE_FLAG=1"))).built
    assert len([e for e in cache.list_entries(tc.root) if e.valid]) == 4


@pytest.mark.slow
@needs_nvcc
def test_corrupt_entries_are_rebuilt(tc):
    entry = tc.get()
    entry.so_path.write_bytes(entry.so_path.read_bytes()[:-64] + b"\0" * 64)   # library bit rot
    assert cache.check_entry(entry.path, entry.key)[0] is None
    rebuilt = tc.get()
    assert rebuilt.built and cache.check_entry(rebuilt.path, rebuilt.key)[0] is not None
    (rebuilt.path / "manifest.json").write_text("{ truncated")                    # half-written manifest
    again = tc.get()
    assert again.built and again.manifest["so_sha256"] == cache.sha256_file(again.so_path)
    (again.path / "manifest.json").unlink()
    assert tc.get().built
    assert [e.valid for e in cache.list_entries(tc.root)] == [True]


def _build_in_child(args):
    tmp, plan_dict = args
    tc = Toolchain.__new__(Toolchain)
    tc.templates, tc.csrc, tc.root = Path(tmp) / "templates", Path(tmp) / "csrc", Path(tmp) / "cache" / "kernels"
    tc.renderer, tc.config = Renderer(tc.templates), BuildConfig(csrc=tc.csrc)
    entry = tc.get(KernelPlan.from_dict(plan_dict))
    return str(entry.path), entry.built, entry.manifest["so_sha256"]


@pytest.mark.slow
@needs_nvcc
def test_two_concurrent_builds_of_one_key(tc, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_build_in_child, [(str(tmp_path), PLAN.to_dict())] * 2)
    assert len({r[0] for r in results}) == 1 and len({r[2] for r in results}) == 1
    assert sorted(r[1] for r in results) == [False, True]      # one built, the other waited and reused
    entries = cache.list_entries(tc.root)
    assert len(entries) == 1 and entries[0].valid
    assert not list((tc.root / ".tmp").glob("build-*"))


@pytest.mark.slow
@needs_nvcc
def test_several_plans_build_in_one_parallel_run(tc):
    entries = cache.get_kernels([PLAN, OTHER], tc.renderer, tc.config, tc.root, jobs=2)
    assert [e.plan for e in entries] == [PLAN, OTHER] and all(e.built for e in entries)
    assert len({e.path for e in entries}) == 2


@pytest.mark.slow
@needs_nvcc
def test_build_error_names_plan_file_and_message(tc):
    (tc.templates / "broken.cu.j2").write_text("// {{ plan_name }}\nint broken = ;\n")
    with pytest.raises(BuildError) as info:
        cache.get_kernel(PLAN, Renderer(tc.templates, "broken.cu.j2"), tc.config, tc.root)
    text = str(info.value)
    assert PLAN.name in text and f"{PLAN.name}.cu" in text and "expected an expression" in text
    assert cache.list_entries(tc.root) == []


@pytest.mark.slow
@needs_nvcc
def test_loader_checks_abi_and_plan(tc):
    lib = loader.load_kernel(PLAN, tc.renderer, tc.config, tc.root)
    assert lib.workspace_bytes(1000, 3) == ((1000 + 3) * 8 * 4 + 255) // 256 * 256
    assert loader.open_library(lib.path, PLAN) is lib
    with pytest.raises(loader.StaleKernelError, match="loaded for plan"):
        loader.open_library(lib.path, OTHER)


@pytest.mark.slow
@needs_nvcc
def test_stale_entry_is_dropped_and_rebuilt(tc):
    good = tc.get(PLAN)
    wrong = tc.get(OTHER)
    # Put PLAN's library into OTHER's entry with a self-consistent manifest: only the library's
    # embedded plan JSON can tell that it is stale.
    stale_so = wrong.path / f"{OTHER.name}.{cache.sha256_file(good.so_path)[:12]}.so"
    shutil.copy(good.so_path, stale_so)
    wrong.so_path.unlink()
    manifest = dict(wrong.manifest, so=stale_so.name, so_sha256=cache.sha256_file(stale_so))
    (wrong.path / "manifest.json").write_text(json.dumps(manifest))
    lib = loader.load_kernel(OTHER, tc.renderer, tc.config, tc.root)
    assert lib.plan == OTHER and lib.path != stale_so.resolve()
    assert json.loads(lib._lib.fqt_plan_json().decode()) == OTHER.to_dict()


@pytest.mark.slow
@needs_nvcc
def test_launch_error_is_reported_without_a_gpu(tc):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the fixture launch would succeed")
    lib = loader.load_kernel(PLAN, tc.renderer, tc.config, tc.root)
    from flashqla_tune.abi import FqtGdnFwdArgs

    with pytest.raises(loader.KernelLaunchError, match=r"CUDA error \d+: "):
        lib.launch(FqtGdnFwdArgs(total_tokens=4, num_seqs=1, scale=1.0), 0)


@pytest.mark.slow
@needs_nvcc
def test_sass_of_built_library(tc):
    try:
        sass.find_tool("cuobjdump"), sass.find_tool("nvdisasm")
    except sass.SassError as exc:
        pytest.skip(str(exc))
    summary = sass.instruction_counts(tc.get().so_path)
    (name, counts), = summary.per_function.items()
    assert "scale_copy" in name and counts["LDG"] >= 1 and counts["STG"] >= 1 and counts["EXIT"] >= 1
    assert summary.count("HGMMA") == 0


# ---- CLI ----

@pytest.mark.slow
@needs_nvcc
def test_library_exports_only_the_abi(tc):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on this machine")
    out = subprocess.run([nm, "-D", "--defined-only", str(tc.get().so_path)], capture_output=True, text=True,
                         check=True).stdout
    functions = {line.split()[-1] for line in out.splitlines() if len(line.split()) == 3 and line.split()[1] == "T"}
    assert functions == {"fqt_abi_version", "fqt_plan_json", "fqt_gdn_fwd_workspace_bytes", "fqt_gdn_fwd",
                         "fqt_error_string"}


@pytest.mark.slow
@needs_nvcc
def test_cli_cache_ls_and_clear(tc, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "envcache"))
    entry = cache.get_kernel(PLAN, tc.renderer, tc.config)
    assert entry.path.parent == tmp_path / "envcache" / "kernels"
    broken = entry.path.parent / f"{OTHER.name}-0123456789abcdef"
    broken.mkdir()
    assert cli_main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and entry.path.name in out and "INVALID" in out and "registers" not in out
    assert cli_main(["cache", "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e["valid"] for e in listed["entries"]} == {True, False}
    assert cli_main(["cache", "clear", "bv128"]) == 0
    assert "removed 1" in capsys.readouterr().out and entry.path.is_dir() and not broken.exists()
    assert cli_main(["cache", "clear"]) == 0
    assert "removed 1" in capsys.readouterr().out and not entry.path.exists()
    assert cli_main(["cache", "ls"]) == 0 and "0 entries" in capsys.readouterr().out


@pytest.mark.slow
@needs_nvcc
def test_cli_compile_checkpoint_builds_gva_and_repeated_forms(tc, tmp_path, monkeypatch, capsys):
    import flashqla_tune.build as build_mod
    import flashqla_tune.render as render_mod

    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(tmp_path / "envcache"))
    monkeypatch.setattr(render_mod, "templates_dir", lambda: tc.templates)
    monkeypatch.setattr(build_mod, "csrc_dir", lambda: tc.csrc)
    checkpoint = FIXTURES / "configs" / "qwen3.5-4b"   # Hqk=16, Hv=32
    assert cli_main(["compile", str(checkpoint), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("built in") == 2 and "registers" in out
    assert "gdn_qk16_v32_" in out and "gdn_qk32_v32_" in out
    assert cli_main(["compile", str(checkpoint), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["built"] for r in rows] == [False, False]
    assert cli_main(["compile", "--hqk", "3", "--hv", "5"]) == 2    # bad spec: clear error, exit 2
    assert "num_v_heads=5" in capsys.readouterr().err


@pytest.mark.slow
@needs_nvcc
def test_ninja_is_idle_when_nothing_changed_and_tracks_headers(tc, tmp_path):
    from flashqla_tune.build import BuildJob, build

    out = tmp_path / "work"
    source = tc.renderer.write(PLAN, out)
    job = BuildJob(PLAN.name, source, out / f"{PLAN.name}.so")
    first, = build([job], out, tc.config)
    assert first.seconds is not None and first.resources
    assert (tc.csrc / "detail" / "fixture_math.cuh").resolve() in {p.resolve() for p in first.headers}
    tc.renderer.write(PLAN, out)                      # same text: the file keeps its mtime
    idle, = build([job], out, tc.config)
    assert idle.seconds is None
    nested = tc.csrc / "detail" / "fixture_math.cuh"
    nested.write_text(nested.read_text() + "// touched\n")
    rebuilt, = build([job], out, tc.config)           # the depfile made ninja see the nested header
    assert rebuilt.seconds is not None


# Shipped configurations CI compiles for sm_90a with the real template and csrc/ (3 plans with
# ninja -j2). The spill budget leaves room above what the kernels spill today: nothing, except the
# two-CTAs-per-SM sequential kernel (TwoPerSmConfig), which spills a few bytes as the tuner's
# ctas_per_sm=2 plans do. No plan may have its wgmma serialized by ptxas (warning C7514, see
# docs/kernel-notes.md).
SHIPPED_PLANS = (
    default_plan(GDNSpec(2, 8)),
    default_plan(GDNSpec(16, 16, qkv_dtype="float16", state_layout="vk", qk_l2norm_in_kernel=True)),
    KernelPlan(GDNSpec(4, 16), TileParams(block_v=128, producer_regs=24, consumer_regs=240)),
)
SPILL_BUDGET_BYTES = 64


def gnu_unique_symbols(library: Path) -> list[str]:
    """The library's GNU-unique dynamic symbols (nm type 'u'): the loader binds each to one copy per
    process even under RTLD_LOCAL, so two libraries of one plan would share the launcher's
    per-device setup (csrc/gdn_abi.h, FQT_EXPORT)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on this machine")
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if len(line.split()) == 3 and line.split()[1] == "u"]


@pytest.mark.slow
@needs_nvcc
def test_shipped_plans_compile_for_sm90a_on_tensor_cores_and_tma(tmp_path):
    from flashqla_tune.render import templates_dir

    if not (templates_dir() / "gdn_fwd.cu.j2").is_file():
        pytest.skip("templates/gdn_fwd.cu.j2 has not landed")
    try:
        sass.find_tool("cuobjdump"), sass.find_tool("nvdisasm")
    except sass.SassError as exc:
        pytest.skip(str(exc))
    entries = cache.get_kernels(list(SHIPPED_PLANS), root=tmp_path / "kernels")
    for entry in entries:
        kernels = {n: r for n, r in entry.resources.items() if r["entry"]}
        assert kernels, f"{entry.plan.name}: ptxas reported no kernel"
        for name, r in kernels.items():
            assert r["registers"] <= 255, (entry.plan.name, name, r)
            assert "wgmma_serialized" not in r, \
                f"{entry.plan.name}: ptxas serialized the wgmma pipeline of {name}: {r['wgmma_serialized']}"
            assert r["spill_stores"] <= SPILL_BUDGET_BYTES and r["spill_loads"] <= SPILL_BUDGET_BYTES, \
                f"{entry.plan.name}: {name} spills {r} beyond the {SPILL_BUDGET_BYTES} B budget"
        unique = gnu_unique_symbols(entry.so_path)
        assert not unique, f"{entry.plan.name}: GNU-unique symbols would be shared with another library " \
                           f"of this plan in the process: {unique[:3]}"
        summary = sass.instruction_counts(entry.so_path)
        fwd = [f for f in summary.per_function if "gdn_fwd_kernel" in f]
        assert fwd, f"{entry.plan.name}: no gdn_fwd_kernel in {list(summary.per_function)}"
        # the plan's sequential kernel, its CP state pass, and (one consumer warp group at one CTA per
        # SM, no output group: csrc/gdn_fwd_mainloop.cuh TwoPerSmConfig) its two-CTAs-per-SM copy
        t = entry.plan.tiles
        two_per_sm = t.block_v == 64 and t.ctas_per_sm == 1 and not t.output_group
        assert len(fwd) == (3 if two_per_sm else 2), f"{entry.plan.name}: sequential kernels {fwd}"
        for f in fwd:
            assert summary.count("HGMMA", f) > 0, f"{entry.plan.name}: {f} does not use wgmma"
            assert summary.count("UTMALDG", f) > 0, f"{entry.plan.name}: {f} does not load with TMA"
