"""The C++ host path (csrc/gdn_torch_host.cpp) on the CPU: the torch extension is built for real,
and a C test double stands in for a kernel library (it records the FqtGdnFwdArgs it is handed and
the offsets they point to, instead of launching). Contexts here hold CPU devices, so ATen
allocates on the CPU; the GPU tests compare the C++ and Python paths bit for bit on the H200."""
from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
import threading
import types
import warnings

import pytest
import torch

from gdn_inputs import off_16_byte_boundary

from flashqla_tune import abi, environment, host_path, warmup_tables
from flashqla_tune.plan import default_plan
from flashqla_tune.package_data import csrc_dir
from flashqla_tune.spec import GDNSpec
from flashqla_tune.warmup_tables import CP_SCRATCH_LIMIT_BYTES, MAX_SEGMENTS, SegmentBound, WarmupTables

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")

# Test double of a kernel library: the two ABI functions the C++ path calls.
LIBRARY_DOUBLE = r"""
#include "gdn_abi.h"
#include <string.h>
static FqtGdnFwdArgs last;
static long long offsets[64];
static int calls;
extern "C" {
FQT_EXPORT int32_t fqt_gdn_fwd(const FqtGdnFwdArgs* a, void* stream) {
  last = *a;
  for (long long i = 0; i <= a->num_seqs && i < 64; ++i) offsets[i] = a->cu_seqlens[i];
  ++calls;
  return stream == (void*)0x77 ? 700 : 0;  /* a stream value the tests use to ask for an error */
}
FQT_EXPORT int64_t fqt_gdn_fwd_workspace_bytes(int64_t t, int64_t n, int64_t s) { return 4096 + t + 10 * n + 100 * s; }
FQT_EXPORT const FqtGdnFwdArgs* double_last(void) { return &last; }
FQT_EXPORT const long long* double_offsets(void) { return offsets; }
FQT_EXPORT int double_calls(void) { return calls; }
}
"""

HQK, HV, D = 2, 4, 128


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("host-cache")


@pytest.fixture(scope="module")
def ext(cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHQLA_TUNE_CACHE", str(cache_root))
        assert environment.cache_dir() == cache_root
        return host_path._build_and_load()


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    where = tmp_path_factory.mktemp("double")
    src = where / "double.c"
    src.write_text(LIBRARY_DOUBLE)
    so = where / "libdouble.so"
    subprocess.run(["g++", "-x", "c++", "-shared", "-fPIC", "-O1", f"-I{csrc_dir()}", str(src), "-o", str(so)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.double_last.restype = ctypes.POINTER(abi.FqtGdnFwdArgs)
    lib.double_offsets.restype = ctypes.POINTER(ctypes.c_longlong)
    return lib


def address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def tables_of(lengths, table=(8, -1, 8, 8)):
    return WarmupTables(torch.tensor(table, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                        tuple(lengths), -9.2, SegmentBound.of(tuple(lengths)), list(table).count(-1))


NO_SPLIT = [0] * 32
SPLITS = [0] * 6 + [16] * 26   # sequences over 32 chunks cut every 16 chunks


def context(ext, double, tables, device="cpu", dtype=torch.bfloat16, state_v_first=False):
    b = tables.bound
    return ext.make_context(address(double, "fqt_gdn_fwd"), address(double, "fqt_gdn_fwd_workspace_bytes"),
                            torch.device(device), dtype, HQK, HV, D, D, state_v_first, tables.warmup.data_ptr(),
                            tables.segment_chunks.data_ptr(), tables.log_eps, list(b.lengths), list(b.top_extra),
                            list(b.top_shortest), MAX_SEGMENTS, CP_SCRATCH_LIMIT_BYTES, 3 * HV * D * D * 4,
                            tables.exact_heads)


def inputs(B, T, dtype=torch.bfloat16):
    return (torch.randn(B, T, HQK, D, dtype=dtype), torch.randn(B, T, HQK, D, dtype=dtype),
            torch.randn(B, T, HV, D, dtype=dtype), -torch.rand(B, T, HV), torch.rand(B, T, HV))


def call(ext, ctx, q, k, v, g, beta, cu=None, cu_cpu=None, h0=None, scale=None, final=True, l2norm=False, stream=0x55):
    return ext.forward(ctx, q, k, v, g, beta, cu, cu_cpu, h0, scale, final, l2norm, stream)


def test_varlen_call_fills_the_launch_struct(ext, double):
    tables = tables_of(SPLITS)
    ctx = context(ext, double, tables)
    q, k, v, g, beta = inputs(1, 3000)
    cu = torch.tensor([0, 700, 700, 3000])
    h0 = torch.randn(3, HV, D, D)
    o, final, code = call(ext, ctx, q, k, v, g, beta, cu, h0=h0, scale=0.25, l2norm=True)
    assert code == 0
    assert o.shape == v.shape and o.dtype == torch.bfloat16 and final.shape == (3, HV, D, D)
    a = double.double_last().contents
    assert (a.q, a.k, a.v, a.g, a.beta) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr())
    assert (a.cu_seqlens, a.initial_state, a.final_state, a.o) == (cu.data_ptr(), h0.data_ptr(),
                                                                  final.data_ptr(), o.data_ptr())
    assert (a.total_tokens, a.num_seqs, a.scale, a.use_qk_l2norm, a.prep_schedule) == (3000, 3, 0.25, 1, 0)
    # CP as the Python path decides it: the longest sequence is unknown without host offsets
    segments = warmup_tables.call_segments(tables, 3000, 3, 3 * HV * D * D * 4, 0)
    assert segments > 3 and a.max_segments == segments
    assert (a.warmup, a.segment_chunks) == (tables.warmup.data_ptr(), tables.segment_chunks.data_ptr())
    assert a.log_eps == pytest.approx(-9.2) and a.exact_heads == 1  # the table's one -1


def test_host_offsets_that_no_sequence_splits_skip_cp(ext, double):
    ctx = context(ext, double, tables_of(SPLITS))
    q, k, v, g, beta = inputs(1, 3000)
    cu = torch.tensor([0, 1000, 2000, 3000])
    _, final, code = call(ext, ctx, q, k, v, g, beta, cu, cu_cpu=cu.clone(), final=False)
    a = double.double_last().contents
    assert code == 0 and final is None and a.final_state is None
    assert (a.max_segments, a.warmup, a.segment_chunks, a.log_eps, a.exact_heads) == (0, None, None, 0.0, 0)


def test_batch_rows_get_device_offsets_and_the_default_scale(ext, double):
    ctx = context(ext, double, tables_of(NO_SPLIT), state_v_first=True)
    q, k, v, g, beta = inputs(3, 100)
    h0 = torch.randn(3, HV, D, D)
    o, final, code = call(ext, ctx, q, k, v, g, beta, h0=h0)
    a = double.double_last().contents
    assert code == 0 and o.shape == (3, 100, HV, D) and final.shape == (3, HV, D, D)
    assert (a.total_tokens, a.num_seqs) == (300, 3)
    assert [double.double_offsets()[i] for i in range(4)] == [0, 100, 200, 300]
    assert a.scale == ctypes.c_float(D ** -0.5).value
    assert a.workspace != 0 and a.max_segments == 0


def test_int32_offsets_are_taken_as_the_python_path_converts_them(ext, double):
    ctx = context(ext, double, tables_of(NO_SPLIT))
    q, k, v, g, beta = inputs(1, 90)
    assert call(ext, ctx, q, k, v, g, beta, torch.tensor([0, 40, 90], dtype=torch.int32))[2] == 0
    assert [double.double_offsets()[i] for i in range(3)] == [0, 40, 90]


def test_a_launch_error_code_comes_back(ext, double):
    ctx = context(ext, double, tables_of(NO_SPLIT))
    assert call(ext, ctx, *inputs(1, 64), torch.tensor([0, 64]), stream=0x77)[2] == 700


def test_calls_it_does_not_take_fall_back_without_launching(ext, double):
    ctx = context(ext, double, tables_of(NO_SPLIT))
    q, k, v, g, beta = inputs(1, 128)
    cu = torch.tensor([0, 64, 128])
    before = double.double_calls()
    grad_q = q.clone().requires_grad_()
    cases = {
        "fp16 q, k, v for a bf16 plan": (q.half(), k.half(), v.half(), g, beta, cu),
        "bf16 gates (the Python path upcasts)": (q, k, v, g.bfloat16(), beta, cu),
        "strided v": (q, k, v.transpose(2, 3).contiguous().transpose(2, 3), g, beta, cu),
        "k off a 16-byte boundary (TMA)": (q, off_16_byte_boundary(k), v, g, beta, cu),
        "other heads": (q[:, :, :1].contiguous(), k[:, :, :1].contiguous(), v, g, beta, cu),
        "grad-requiring q": (grad_q, k, v, g, beta, cu),
        "batch rows with offsets": (*inputs(2, 64), torch.tensor([0, 64])),
        "2-D offsets": (q, k, v, g, beta, cu.view(1, 3)),
        "no tokens": (*inputs(1, 0), torch.tensor([0, 0])),
        "no batch rows": (*inputs(0, 64), None),
    }
    for name, args in cases.items():
        assert call(ext, ctx, *args) is None, name
    assert call(ext, ctx, q, k, v, g, beta, cu, cu_cpu=torch.tensor([0, 100, 64])) is None  # decreasing
    assert call(ext, ctx, q, k, v, g, beta, cu, cu_cpu=torch.tensor([0, 64, 129])) is None  # past T
    assert call(ext, ctx, q, k, v, g, beta, cu, cu_cpu=torch.tensor([0, 128])) is None     # wrong length
    assert call(ext, ctx, q, k, v, g, beta, cu, h0=torch.randn(2, HV, D, D).double()) is None
    assert call(ext, ctx, q, k, v, g, beta, cu, h0=torch.randn(1, HV, D, D)) is None         # N = 2
    assert call(ext, context(ext, double, tables_of(NO_SPLIT), device="cuda"), q, k, v, g, beta, cu) is None
    assert double.double_calls() == before
    with torch.no_grad():  # under no_grad a grad-requiring tensor is fine, as on the Python path
        assert call(ext, ctx, grad_q, k, v, g, beta, cu)[2] == 0


def test_segment_bound_agrees_with_the_python_one(ext, double):
    rng = random.Random(5)
    for _ in range(300):
        lengths = [0] * 32
        for b in range(rng.randrange(1, 12), 32):
            lengths[b] = rng.choice([0, 2, 5, 8, 16, 33, 64, 200])
        tables = tables_of(lengths)
        ctx = context(ext, double, tables)
        N = rng.choice([1, 2, 3, 7, 40, 5000, 30000])
        T = rng.choice([N, 64 * N, rng.randrange(N, 2_000_000)])
        longest = rng.choice([0, T, rng.randrange(0, T + 1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            python = warmup_tables.call_segments(tables, T, N, 3 * HV * D * D * 4, longest)
        ours = ext.call_segments(ctx, T, N, longest)
        # -1: the C++ path hands the call to Python, which turns CP off with a warning
        assert ours == python or (ours == -1 and python == 0 and caught), (lengths, T, N, longest)


class LibraryDouble:
    """Test double for loader.KernelLibrary as host_path.remember uses it: the C double's entry points."""

    def __init__(self, lib):
        self.lib = lib

    def entry_address(self, symbol):
        return address(self.lib, symbol)


def test_remember_starts_the_build_and_keeps_a_context_once_it_is_loaded(ext, double, cache_root, monkeypatch,
                                                                         fresh_host_state):
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(cache_root))  # the fixture's build: loading it is quick
    plan, tables = default_plan(GDNSpec(HQK, HV)), tables_of(SPLITS)
    key = ("a signature", 1)
    host_path.remember(key, plan, LibraryDouble(double), tables, torch.device("cpu"))
    assert not host_path.known(key)            # the call that starts the build does not wait for it
    module = host_path.extension()             # waits for the background build
    host_path.remember(key, plan, LibraryDouble(double), tables, torch.device("cpu"))
    assert host_path.known(key)
    q, k, v, g, beta = inputs(1, 3000)
    _, _, code = module.forward(host_path._contexts[key].handle, q, k, v, g, beta, torch.tensor([0, 3000]), None, None,
                                None, True, False, 0)
    a = double.double_last().contents
    assert code == 0 and a.warmup == tables.warmup.data_ptr() and a.max_segments > 1
    monkeypatch.setenv(host_path.ENV_SWITCH, "python")  # switched off: nothing is kept
    host_path.remember(("another", 2), plan, LibraryDouble(double), tables, torch.device("cpu"))
    assert not host_path.known(("another", 2))


def test_a_build_lock_left_by_a_dead_process_does_not_hang_the_next_load(ext, cache_root, monkeypatch):
    # torch's baton file: a process that exits while its background build still compiles leaves
    # it behind, and torch waits for it to disappear. The load must clear it and go on.
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(cache_root))
    baton = environment.cache_dir() / "host" / host_path.build_key() / host_path.TORCH_BATON
    baton.write_text("")
    result = {}

    def load():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result["module"] = host_path._build_and_load()
        result["warnings"] = [str(w.message) for w in seen]

    loader = threading.Thread(target=load, daemon=True)  # daemon: a hang fails the test instead of the run
    loader.start()
    loader.join(timeout=120)
    assert not loader.is_alive(), "the load waited on the stale lock"
    assert result["module"].ABI_VERSION == ext.ABI_VERSION and not baton.exists()
    assert any("stale build lock" in w for w in result["warnings"])


# --- a kernel pack's prebuilt extension -----------------------------------------------------------

class PackLibraryDouble(LibraryDouble):
    """LibraryDouble at a path inside a pack folder, as packed_ops.load opens a pack's libraries."""

    def __init__(self, lib, path):
        super().__init__(lib)
        self.path = path


def compiler_must_not_run(*args, **kwargs):
    raise AssertionError("torch.utils.cpp_extension.load was called: a pack's op must not compile")


@pytest.fixture
def fresh_host_state(monkeypatch):
    for name, value in (("_extension", None), ("_build_thread", None), ("_unavailable", None), ("_contexts", {})):
        monkeypatch.setattr(host_path, name, value)
    monkeypatch.delenv(host_path.ENV_SWITCH, raising=False)


@pytest.fixture
def prebuilt_pack(ext, cache_root, tmp_path, monkeypatch):
    """A pack folder holding the extension as `flashqla-tune build` puts it there (host/<module>.so),
    the manifest's record of it, and a kernel library path inside the pack."""
    monkeypatch.setenv("FLASHQLA_TUNE_CACHE", str(cache_root))  # the fixture's build: copying it is quick
    pack = tmp_path / "pack"
    built = host_path.build_into(pack / "host")
    record = types.SimpleNamespace(so=built.path.relative_to(pack).as_posix(), module=built.module,
                                   torch=built.torch, python_abi=built.python_abi,
                                   sources_sha256=built.sources_sha256, abi_version=built.abi_version)
    (pack / "binaries").mkdir()
    library = pack / "binaries" / "plan.so"
    library.write_bytes(b"a kernel library stands here")
    return pack, record, library


def test_build_into_records_what_the_extension_was_built_for(prebuilt_pack):
    pack, record, _ = prebuilt_pack
    so = pack / record.so
    assert so.is_file() and so.parent.name == "host" and so.name == f"{record.module}.so"
    assert record.module == host_path.module_name() and record.torch == torch.__version__
    assert record.python_abi == host_path.python_abi() and record.abi_version == abi.ABI_VERSION
    assert record.sources_sha256 == host_path.sources_sha256()
    assert host_path.mismatch(record) is None
    names = {p.name for p in host_path.source_files()}
    assert {host_path.SOURCE_NAME, "gdn_abi.h"} <= names  # the headers it includes count too


def test_a_packs_op_uses_the_prebuilt_extension_without_the_compiler(prebuilt_pack, double, fresh_host_state,
                                                                     monkeypatch):
    from torch.utils import cpp_extension

    pack, record, library = prebuilt_pack
    monkeypatch.setattr(cpp_extension, "load", compiler_must_not_run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usable prebuilt extension loads without a word
        assert host_path.use_pack_extension(pack, record)
    plan, tables = default_plan(GDNSpec(HQK, HV)), tables_of(SPLITS)
    key = ("a pack signature", HV, torch.bfloat16, -1)  # [3]: the device index forward reads
    host_path.remember(key, plan, PackLibraryDouble(double, library), tables, torch.device("cpu"),
                       may_build=False)
    assert host_path.known(key) and host_path._build_thread is None  # kept at once: nothing to build
    assert host_path.extension().ABI_VERSION == abi.ABI_VERSION
    before = host_path.taken
    q, k, v, g, beta = inputs(1, 3000)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0x55, raising=False)
    o, final = host_path.forward(key, q, k, v, g, beta, None, None, True, False, torch.tensor([0, 3000]), None)
    a = double.double_last().contents
    assert host_path.taken == before + 1 and o.shape == v.shape and final.shape == (1, HV, D, D)
    assert a.warmup == tables.warmup.data_ptr() and a.max_segments > 1


@pytest.mark.parametrize("field, value, named", [
    ("torch", "1.0.0", "built for torch 1.0.0, this process runs torch"),
    ("python_abi", "cpython-39-x86_64-linux-gnu", "built for Python ABI cpython-39-x86_64-linux-gnu"),
    ("sources_sha256", "0" * 64, "other csrc/ sources"),
    ("abi_version", abi.ABI_VERSION + 1, f"speaks kernel ABI {abi.ABI_VERSION + 1}"),
])
def test_a_mismatched_prebuilt_extension_falls_back_to_python_with_one_warning(prebuilt_pack, double,
                                                                                fresh_host_state, monkeypatch,
                                                                                field, value, named):
    from torch.utils import cpp_extension

    pack, record, library = prebuilt_pack
    setattr(record, field, value)
    monkeypatch.setattr(cpp_extension, "load", compiler_must_not_run)
    with pytest.warns(RuntimeWarning) as seen:
        assert not host_path.use_pack_extension(pack, record)
    assert len(seen) == 1 and named in str(seen[0].message) and "Python host path" in str(seen[0].message)
    plan, tables = default_plan(GDNSpec(HQK, HV)), tables_of(SPLITS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the calls say nothing more
        for _ in range(2):
            host_path.remember(("sig", 1), plan, PackLibraryDouble(double, library), tables, torch.device("cpu"),
                       may_build=False)
    assert not host_path.known(("sig", 1)) and host_path._build_thread is None and host_path._extension is None


def test_a_pack_without_a_prebuilt_extension_says_so_and_builds_nothing(tmp_path, double, fresh_host_state):
    library = tmp_path / "binaries" / "plan.so"
    with pytest.warns(RuntimeWarning, match="carries no prebuilt C\\+\\+ host extension"):
        assert not host_path.use_pack_extension(tmp_path, None)
    plan, tables = default_plan(GDNSpec(HQK, HV)), tables_of(SPLITS)
    host_path.remember(("sig", 2), plan, PackLibraryDouble(double, library), tables, torch.device("cpu"),
                       may_build=False)
    assert host_path._build_thread is None


def test_switched_off_the_pack_extension_is_neither_loaded_nor_warned_about(prebuilt_pack, fresh_host_state,
                                                                            monkeypatch):
    pack, record, library = prebuilt_pack
    monkeypatch.setenv(host_path.ENV_SWITCH, "python")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not host_path.use_pack_extension(pack, None)
    assert host_path._extension is None
