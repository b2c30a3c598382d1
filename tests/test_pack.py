"""Packs without a compiler: manifest round trip, rank slicing, plan choice and every refusal
(pack_doubles writes FakeBinary files and FakeLibraryOpener stands in for ctypes)."""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from pathlib import Path

import pytest
import torch

import flashqla_tune
from flashqla_tune import host_path, ops
from flashqla_tune.abi import ABI_VERSION
from flashqla_tune.environment import GPUInfo
from flashqla_tune.files import sha256_file
from flashqla_tune.pack import (BINARIES, HostExtension, Manifest, PackError, check_binaries, publish, read_manifest,
                                staging_dir)
from flashqla_tune.pack_build import _host_extension, _host_refresh_reason, _reuse_reason, parse_tp, plan_heads

sys.path.insert(0, str(Path(__file__).parent))
from pack_doubles import H200, MODEL_SPEC, SHA, FakeLibraryOpener, edit_manifest, make_pack  # noqa: E402


def _load(pack, rank=0, size=1, gpu=None, **kw):
    return flashqla_tune.load(pack, rank, size, gpu=gpu, open_library=kw.pop("opener", FakeLibraryOpener()), **kw)


def _qv(hqk, hv, dtype=torch.bfloat16, T=5):
    return torch.zeros(1, T, hqk, 128, dtype=dtype), torch.zeros(1, T, hv, 128, dtype=dtype)


def test_parse_tp_and_plan_heads():
    assert parse_tp("4,1,2,2") == (1, 2, 4)
    with pytest.raises(ValueError, match="'1,x'"):
        parse_tp("1,x")
    forms = [(h.tp_size, h.form, h.spec.num_qk_heads, h.spec.num_v_heads) for h in plan_heads(MODEL_SPEC, (1, 2))]
    assert forms == [(1, "native", 2, 8), (1, "qk_repeated", 8, 8), (2, "native", 1, 4), (2, "qk_repeated", 4, 4)]
    with pytest.raises(ValueError, match="degree 4 does not divide.*Hqk=2, Hv=8"):
        plan_heads(MODEL_SPEC, (4,))
    assert [h.form for h in plan_heads(MODEL_SPEC.with_heads(8, 8), (1,))] == ["native"]


def test_round_trip_tables_and_plan_choice(tmp_path):
    pack = make_pack(tmp_path / "p")
    opener = FakeLibraryOpener()
    start = time.perf_counter()
    o = _load(pack, opener=opener)
    assert time.perf_counter() - start < 1.0
    m = read_manifest(pack)
    assert not m.tuned and m.target == "untuned sm_90a" and m.checkpoint_sha256 == SHA
    # rank 0 of 1 opened only its two plans: the model's heads and the q/k-repeated form.
    assert sorted(p for _, p in opener.opened) == sorted(p.plan.name for p in m.plans if p.tp_size == 1)
    assert o.plan_for(*_qv(2, 8), False).spec.num_qk_heads == 2
    assert o.plan_for(*_qv(8, 8), False).spec.num_qk_heads == 8
    cal = o.calibration
    assert o.warmup_table(1).tolist() == cal.layers[1].warmup_table
    assert cal.layers[1].warmup_table[5] == -1                 # the exact head
    assert o.warmup_table().tolist() == cal.model_table()
    assert o.warmup_table()[5] == -1
    assert o.warmup_table()[0] == max(layer.warmup_table[0] for layer in cal.layers)
    assert o.warmup_table(0).dtype == torch.int32 and o.warmup_table(0).shape == (8,)
    for bad in (3, -1, True, "0"):
        with pytest.raises(ValueError, match="GDN layers 0..2"):
            o.warmup_table(bad)


def test_tensor_parallel_rank_slices(tmp_path):
    pack = make_pack(tmp_path / "p")
    r1 = _load(pack, 1, 2)
    assert list(r1.v_heads) == [4, 5, 6, 7]
    assert r1.warmup_table(1).tolist() == r1.calibration.layers[1].warmup_table[4:]
    assert r1.warmup_table().tolist() == r1.calibration.model_table()[4:]
    assert r1.plan_for(*_qv(1, 4), False).spec.num_v_heads == 4
    assert r1.plan_for(*_qv(4, 4), False).spec.num_qk_heads == 4
    with pytest.raises(ops.UnsupportedError) as err:
        r1.plan_for(*_qv(2, 8), False)       # the full model's heads on a rank of 2
    text = str(err.value)
    assert "Hqk=2/Hv=8" in text and "Hqk=1/Hv=4" in text and "Hqk=4/Hv=4" in text
    with pytest.raises(ops.UnsupportedError, match="float16.*bfloat16"):
        r1.plan_for(*_qv(1, 4, torch.float16), False)
    with pytest.raises(ops.UnsupportedError, match="state vk"):
        r1.plan_for(*_qv(1, 4), True)


def test_call_checks_before_the_gpu(tmp_path):
    o = _load(make_pack(tmp_path / "p"))
    q, v = _qv(2, 8)
    g = torch.zeros(1, 5, 8)
    with pytest.raises(ValueError, match="CUDA device"):
        o.chunk_gated_delta_rule(q, q, v, g, g)
    with pytest.raises(ValueError, match="v heads Hv=8 must be a multiple"):
        o.chunk_gated_delta_rule(*_qv(3, 8)[:1], *_qv(3, 8)[:1], v, g, g)


def test_tp_and_rank_refusals(tmp_path):
    pack = make_pack(tmp_path / "p")
    with pytest.raises(PackError, match=r"tp_size=4.*\[1, 2\]"):
        _load(pack, 0, 4)
    with pytest.raises(PackError, match="tp_rank=2 must be in 0..1"):
        _load(pack, 2, 2)


def test_gpu_checks(tmp_path):
    untuned = make_pack(tmp_path / "u")
    _load(untuned, gpu=None)
    _load(untuned, gpu=GPUInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, "550"))
    with pytest.raises(PackError, match=r"untuned sm_90a.*NVIDIA A100.*sm_80"):
        _load(untuned, gpu=GPUInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, "550"))
    tuned = make_pack(tmp_path / "t", gpu=H200)
    assert read_manifest(tuned).tuned
    _load(tuned, gpu=H200)
    with pytest.raises(PackError, match=r"tuned for NVIDIA H200 \(sm_90\).*this GPU is NVIDIA H100 80GB HBM3 \(sm_90\)"):
        _load(tuned, gpu=GPUInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, H200.driver))
    with pytest.raises(PackError, match="tuned for NVIDIA H200.*no CUDA GPU"):
        _load(tuned, gpu=None)
    with pytest.warns(RuntimeWarning, match="driver 570.86.15.*580.1"):
        _load(tuned, gpu=dataclasses.replace(H200, driver="580.1"))


def test_damaged_packs_are_clear_errors(tmp_path):
    with pytest.raises(PackError, match="no pack folder"):
        _load(tmp_path / "missing")
    pack = make_pack(tmp_path / "p")
    so = next((pack / "binaries").iterdir())
    so.write_bytes(b"tampered")
    with pytest.raises(PackError, match=f"{so.name} does not match its recorded sha256"):
        _load(pack)
    so.unlink()
    with pytest.raises(PackError, match=f"lacks binary binaries/{so.name}"):
        _load(pack)

    pack = make_pack(tmp_path / "c")
    (pack / "calibration.json").write_text((pack / "calibration.json").read_text().replace('"n_h"', '"n_h" '))
    with pytest.raises(PackError, match="calibration.json does not match"):
        _load(pack)

    pack = make_pack(tmp_path / "v")
    edit_manifest(pack, lambda d: d.update(schema_version=99))
    with pytest.raises(PackError, match="schema version 99"):
        _load(pack)
    edit_manifest(pack, lambda d: d.update(schema_version=1, plans=[{"form": "native"}]))
    with pytest.raises(PackError, match="damaged pack manifest: KeyError"):
        _load(pack)
    edit_manifest(pack, lambda d: d.update(gpu={"name": "NVIDIA H200"}))
    with pytest.raises(PackError, match="must record its GPU name and arch"):
        _load(pack)
    (pack / "manifest.json").write_text("{not json")
    with pytest.raises(PackError, match="manifest.json is damaged"):
        _load(pack)
    (pack / "manifest.json").unlink()
    with pytest.raises(PackError, match="has no manifest.json"):
        _load(pack)


def test_publish_swaps_whole_folders(tmp_path):
    out = tmp_path / "pack"
    first = staging_dir(out)
    (first / "a").write_text("1")
    publish(first, out)
    second = staging_dir(out)
    (second / "b").write_text("2")
    publish(second, out)
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["pack"]    # no staging or old folder left


def test_reuse_only_for_the_same_checkpoint_and_options(tmp_path):
    pack = make_pack(tmp_path / "p")
    options = {}
    reuse, why = _reuse_reason(pack, SHA, (1, 2), options, None)
    assert reuse and "up to date" in why
    reuse, why = _reuse_reason(pack, "cd" * 32, (1, 2), options, None)
    assert not reuse and "checkpoint changed" in why and "cdcdcdcd" in why
    assert "TP degrees changed" in _reuse_reason(pack, SHA, (1,), options, None)[1]
    assert "build options changed" in _reuse_reason(pack, SHA, (1, 2), {"corpus": "x"}, None)[1]
    assert "tuning for NVIDIA H200 was asked" in _reuse_reason(pack, SHA, (1, 2), options, "NVIDIA H200")[1]
    next((pack / "binaries").iterdir()).write_bytes(b"x")
    assert "existing pack unusable" in _reuse_reason(pack, SHA, (1, 2), options, None)[1]
    other = tmp_path / "notapack"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(PackError, match="not a pack"):
        _reuse_reason(other, SHA, (1,), options, None)


def test_calls_pass_the_layer_table_and_the_calibration_eps(tmp_path, monkeypatch):
    """A pack call hands the kernels its layer's warm-up table (the rank's slice) and the
    calibration's eps, so the guard checks the bound the calibration used."""
    o = _load(make_pack(tmp_path / "p"))
    seen = {}
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(ops, "run_checked", lambda *args, **kw: seen.update(kw))
    q, v = _qv(2, 8)
    g = torch.zeros(1, 5, 8)
    o.chunk_gated_delta_rule(q, q, v, g, g, layer=1)
    assert seen["warmup"] == o.warmup_table(1).tolist() and -1 in seen["warmup"]
    assert seen["warmup_eps"] == o.calibration.settings.eps
    o.chunk_gated_delta_rule(q, q, v, g, g)
    assert seen["warmup"] == o.warmup_table().tolist()


def test_a_packs_op_takes_flas_positional_order_and_refuses_what_the_op_refuses(tmp_path, monkeypatch):
    """PackOps.chunk_gated_delta_rule has the op's FLA signature with layer keyword only in place of
    warmup/warmup_eps; refused options are named before the host path or the kernels are asked."""
    o = _load(make_pack(tmp_path / "p"))
    seen, asked = [], []
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    monkeypatch.setattr(ops, "run_checked", lambda *args, **kw: seen.append((args, kw)))
    monkeypatch.setattr(host_path, "forward", lambda key, *args: asked.append(args))
    q, v = _qv(2, 8)
    g, cu, cu_cpu = torch.zeros(1, 5, 8), torch.tensor([0, 2, 5]), torch.tensor([0, 2, 5])
    o.chunk_gated_delta_rule(q, q, v, g, g, 0.5, None, True, True, False, False, False, cu, cu_cpu,
                             torch.zeros(2, 2, dtype=torch.int64), None, layer=1, chunk_size=64)
    (args, kw), = seen
    assert args[5:11] == (0.5, None, True, True, False, cu) and kw["longest_tokens"] == 3
    assert kw["warmup"] == o.warmup_table(1).tolist()
    for option, match in ((dict(allow_neg_eigval=True), "allow_neg_eigval=True requires use_beta_sigmoid"),
                          (dict(cp_context=object()), "cp_context=object"),
                          (dict(use_gate_in_kernel=True), "use_gate_in_kernel=True needs A_log"),
                          (dict(chunk_size=32), "chunk_size=32")):
        with pytest.raises(ValueError, match=match):   # UnsupportedError is a ValueError
            o.chunk_gated_delta_rule(q, q, v, g, g, layer=1, **option)
    # FLA's in-kernel beta is applied before the plan (which takes precomputed gates) runs
    o.chunk_gated_delta_rule(q, q, v, g, g, layer=1, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    (args, kw) = seen.pop()
    assert torch.equal(args[4], torch.ones_like(g)) and torch.equal(args[3], g)   # 2 sigmoid(0), the gate as given
    with pytest.raises(TypeError, match="'warmup' .*from its calibration: pass layer="):
        o.chunk_gated_delta_rule(q, q, v, g, g, warmup=[3] * 8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'head_first'"):
        o.chunk_gated_delta_rule(q, q, v, g, g, head_first=False)
    with pytest.raises(TypeError, match="positional argument"):
        o.chunk_gated_delta_rule(q, q, v, g, g, None, None, False, False, False, False, False, None, None, None,
                                 None, 1)
    assert len(seen) == 1 and len(asked) == 2


def test_a_packs_segment_table_reaches_the_op_under_a_qualified_name(tmp_path, monkeypatch):
    """A plan's CP segment table in the manifest is registered with its library under a name
    qualified by the table, which the pack's calls pass to the op; older packs (no table) keep
    the plan's own name and the per-call cost model. A malformed table is refused by name."""
    from flashqla_tune import runtime

    table = [0] * 5 + [8] * 27
    pack = make_pack(tmp_path / "p")
    edit_manifest(pack, lambda d: [p.update(segment_chunks=table) for p in d["plans"]])
    o = _load(pack)
    name = o.registered[o.plans[0].plan.name]
    assert name.startswith(o.plans[0].plan.name + "@cp-")
    assert runtime.segment_lengths_for(name) == tuple(table) and runtime.plan_by_name(name) == o.plans[0].plan
    seen = {}
    monkeypatch.setattr(ops, "check_inputs", ops.check_shapes_and_types)
    monkeypatch.setattr(ops, "run_checked", lambda *args, **kw: seen.update(kw))
    q, v = _qv(2, 8)
    o.chunk_gated_delta_rule(q, q, v, torch.zeros(1, 5, 8), torch.zeros(1, 5, 8))
    assert runtime.segment_lengths_for(seen["plan_name"]) == tuple(table)

    old = _load(make_pack(tmp_path / "old"))
    assert old.registered[old.plans[0].plan.name] == old.plans[0].plan.name

    bad = make_pack(tmp_path / "bad")
    edit_manifest(bad, lambda d: d["plans"][0].update(segment_chunks=[4, -1]))
    with pytest.raises(PackError, match="segment_chunks: a segment table has 32 non-negative ints"):
        _load(bad)


def _with_host_extension(pack, **changes):
    """Give a pack double a host/ binary and its manifest record (FakeBinary bytes: nothing imports it
    in these tests), as `flashqla-tune build` writes them."""
    so = pack / "host" / "flashqla_tune_host_0123456789abcdef.so"
    so.parent.mkdir()
    so.write_bytes(b"FakeBinary host extension")
    record = {"so": "host/" + so.name, "sha256": sha256_file(so), "module": so.stem, "torch": torch.__version__,
              "python_abi": host_path.python_abi(), "sources_sha256": host_path.sources_sha256(),
              "abi_version": ABI_VERSION, **changes}
    edit_manifest(pack, lambda d: d.update(host_extension=record))
    return so, record


def test_the_manifest_records_the_host_extension_and_checks_its_binary(tmp_path):
    old = make_pack(tmp_path / "old")
    assert read_manifest(old).host_extension is None  # a pack made without one reads as such
    pack = make_pack(tmp_path / "p")
    so, record = _with_host_extension(pack)
    m = read_manifest(pack)
    assert m.host_extension == HostExtension(**record)
    assert Manifest.from_dict(m.to_dict(), "round trip") == m
    check_binaries(pack, m, [])  # the host binary is checked even when no plan is asked for
    so.write_bytes(b"tampered")
    with pytest.raises(PackError, match=f"host/{so.name} does not match its recorded sha256"):
        check_binaries(pack, m, [])
    so.unlink()
    with pytest.raises(PackError, match=f"lacks binary host/{so.name} of the C\\+\\+ host path"):
        check_binaries(pack, m, [])
    edit_manifest(pack, lambda d: d["host_extension"].update(so="../elsewhere.so"))
    with pytest.raises(PackError, match="host extension entry names binary '../elsewhere.so'"):
        read_manifest(pack)


def test_reuse_needs_a_host_extension_that_fits_this_process(tmp_path):
    pack = make_pack(tmp_path / "p")
    _with_host_extension(pack)
    assert _reuse_reason(pack, SHA, (1, 2), {}, None)[0]
    assert _host_refresh_reason(read_manifest(pack)) is None
    pack = make_pack(tmp_path / "q")
    _with_host_extension(pack, torch="1.0.0")
    assert _reuse_reason(pack, SHA, (1, 2), {}, None)[0]   # the kernels are up to date: only host/ is rebuilt
    why = _host_refresh_reason(read_manifest(pack))
    assert "C++ host extension does not fit" in why and "torch 1.0.0" in why


def test_the_build_records_the_host_extension_or_says_why_there_is_none(tmp_path):
    def builder(folder):
        folder.mkdir(parents=True)
        (folder / "m.so").write_bytes(b"FakeBinary host extension")
        return host_path.PrebuiltExtension(folder / "m.so", "m", "9.9", "cpython-x", "ab" * 32, 4)

    lines = []
    record = _host_extension(tmp_path, builder, lines.append)
    assert (record.so, record.module, record.torch, record.python_abi, record.abi_version) == (
        "host/m.so", "m", "9.9", "cpython-x", 4)
    assert record.sha256 == hashlib.sha256(b"FakeBinary host extension").hexdigest() and not lines

    def no_compiler(folder):
        raise OSError("no C++ compiler")

    assert _host_extension(tmp_path / "other", no_compiler, lines.append) is None
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "Python host path" in lines[0]


def test_loading_a_pack_hands_its_host_extension_to_the_host_path(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(host_path, "use_pack_extension", lambda pack, record: seen.append((pack, record)))
    pack = make_pack(tmp_path / "p")
    _, record = _with_host_extension(pack)
    _load(pack)
    assert seen == [(pack, HostExtension(**record))]


def _backward_modules():
    from flashqla_tune.backward import libraries

    return libraries.modules()


def test_the_manifest_records_each_backward_library_and_checks_its_binary(tmp_path):
    from flashqla_tune.backward import libraries
    from flashqla_tune.pack import BACKWARD_KINDS
    from flashqla_tune.pack_signing import signed_files

    assert BACKWARD_KINDS == libraries.KINDS
    pack = make_pack(tmp_path / "p")
    m = read_manifest(pack)
    assert [b.kind for b in m.backward] == ["chain", "prep", "chunk"]
    for kind, module in _backward_modules().items():
        record = m.backward_library(kind)
        assert record.spec == module.spec_for(128, 128).to_dict() and record.abi_version == module.ABI_VERSION
        assert record.so in signed_files(m)   # a signature covers each like every other binary
    assert Manifest.from_dict(m.to_dict(), "round trip") == m
    assert _reuse_reason(pack, SHA, (1, 2), {}, None)[0]
    check_binaries(pack, m, [])
    for record in m.backward:
        so = pack / record.so
        good = so.read_bytes()
        so.write_bytes(b"tampered")
        with pytest.raises(PackError, match=f"{record.so} does not match its recorded sha256"):
            check_binaries(pack, m, [])
        so.write_bytes(good)
    edit_manifest(pack, lambda d: d["backward_libraries"][1].update(abi_version=m.backward[1].abi_version + 1))
    assert "backward prep kernels are stale (prep ABI" in _reuse_reason(pack, SHA, (1, 2), {}, None)[1]
    edit_manifest(pack, lambda d: d["backward_libraries"].pop(1))
    assert _reuse_reason(pack, SHA, (1, 2), {}, None)[1] == "the pack carries no backward prep kernels"
    assert read_manifest(pack).backward_library("prep") is None
    old = make_pack(tmp_path / "old", backward=False)
    assert read_manifest(old).backward == ()
    assert _reuse_reason(old, SHA, (1, 2), {}, None)[1] == "the pack carries no backward chain kernels"
    edit_manifest(pack, lambda d: d["backward_libraries"][0].update(so="/elsewhere.so"))
    with pytest.raises(PackError, match=r"backward_libraries\[0\]"):
        read_manifest(pack)
    edit_manifest(pack, lambda d: d.update(backward_libraries=[{"kind": "chain", "so": "binaries/x.so"}]))
    with pytest.raises(PackError, match=r"backward_libraries\[0\]"):
        read_manifest(pack)
    edit_manifest(pack, lambda d: d.update(backward_libraries={"chain": {}}))
    with pytest.raises(PackError, match="backward_libraries is dict, expected a list"):
        read_manifest(pack)


def _single_backward_entry(pack, **changes):
    """Give a pack double the manifest of a pack that lists only the chain library, as the single
    "backward" entry without a kind (and its FakeBinary file)."""
    from flashqla_tune.backward import chain_kernels

    spec = chain_kernels.spec_for(128, 128)
    so = pack / BINARIES / f"{spec.name}.so"
    so.write_bytes(b"FakeBinary backward chains")
    record = {"so": f"{BINARIES}/{so.name}", "sha256": sha256_file(so), "spec": spec.to_dict(),
              "abi_version": chain_kernels.ABI_VERSION, **changes}

    def change(d):
        d.pop("backward_libraries")
        d["backward"] = record

    edit_manifest(pack, change)
    return so, record, spec


def test_a_manifest_with_the_single_backward_entry_reads_as_the_chain_library(tmp_path, monkeypatch):
    from flashqla_tune.backward import chain_kernels
    from flashqla_tune.pack import BackwardLibrary
    from flashqla_tune.pack_signing import signed_files

    pack = make_pack(tmp_path / "p", backward=False)
    so, record, spec = _single_backward_entry(pack)
    m = read_manifest(pack)
    assert m.backward == (BackwardLibrary("chain", **record),) and m.backward_library("chain").so == record["so"]
    assert Manifest.from_dict(m.to_dict(), "round trip") == m   # written back under backward_libraries
    assert record["so"] in signed_files(m)
    check_binaries(pack, m, [])
    # it loads, offering its chain library; the build rebuilds it for the other two
    assert _reuse_reason(pack, SHA, (1, 2), {}, None)[1] == "the pack carries no backward prep kernels"
    offered = []
    monkeypatch.setattr(chain_kernels.LIBRARIES, "offer", lambda *a: offered.append(a))
    _load(pack)
    assert offered == [(spec, so, record["sha256"])]
    # a single entry and the list together are refused; so is a damaged single entry
    edit_manifest(pack, lambda d: d.update(backward_libraries=[]))
    with pytest.raises(PackError, match="both backward_libraries and a single backward entry"):
        read_manifest(pack)
    edit_manifest(pack, lambda d: d.pop("backward_libraries"))
    edit_manifest(pack, lambda d: d["backward"].update(so="/elsewhere.so"))
    with pytest.raises(PackError, match="backward"):
        read_manifest(pack)
    edit_manifest(pack, lambda d: d.update(backward={"so": "binaries/x.so"}))
    with pytest.raises(PackError, match="backward"):
        read_manifest(pack)


@pytest.mark.parametrize("change, named", [
    (lambda libs: libs[1].update(kind="dense"),
     "backward_libraries\\[1\\]: kind is 'dense', expected one of chain, prep, chunk"),
    (lambda libs: libs[2].pop("kind"), "backward_libraries\\[2\\]: kind is None"),
    (lambda libs: libs[2].update(kind="prep"), "backward_libraries\\[2\\]: kind 'prep' is listed twice"),
    (lambda libs: libs.append(dict(libs[0])), "backward_libraries\\[3\\]: kind 'chain' is listed twice"),
])
def test_an_unknown_or_repeated_backward_kind_is_refused_by_name(tmp_path, change, named):
    pack = make_pack(tmp_path / "p")
    edit_manifest(pack, lambda d: change(d["backward_libraries"]))
    with pytest.raises(PackError, match=named):
        read_manifest(pack)


def test_loading_a_pack_offers_each_backward_library_or_says_why_not(tmp_path, monkeypatch, caplog):
    offered = []
    for kind, module in _backward_modules().items():
        monkeypatch.setattr(module.LIBRARIES, "offer",
                            lambda spec, path, sha, kind=kind: offered.append((kind, spec, path, sha)))
    pack = make_pack(tmp_path / "p")
    m = read_manifest(pack)
    _load(pack)
    assert offered == [(b.kind, _backward_modules()[b.kind].spec_for(128, 128), pack / b.so, b.sha256)
                       for b in m.backward]
    assert [kind for kind, *_ in offered] == ["chain", "prep", "chunk"]
    offered.clear()
    # a record of another ABI is passed over with one warning; the others are offered
    other = make_pack(tmp_path / "q")
    edit_manifest(other, lambda d: d["backward_libraries"][1].update(abi_version=d["backward_libraries"][1]
                                                                     ["abi_version"] + 1))
    with caplog.at_level("WARNING", logger="flashqla_tune"):
        _load(other)
    assert [kind for kind, *_ in offered] == ["chain", "chunk"]
    warned = [r.getMessage() for r in caplog.records if "backward" in r.getMessage()]
    assert len(warned) == 1 and "backward prep kernels" in warned[0] and "builds them on first use" in warned[0]
    # a record of a kind this flashqla_tune has none of for these dims: passed over with one warning
    offered.clear()
    caplog.clear()

    def no_chunk_kernels(K, V):
        raise ValueError(f"no chunk kernels for K={K}, V={V} in this test")

    monkeypatch.setattr(_backward_modules()["chunk"], "spec_for", no_chunk_kernels)
    with caplog.at_level("WARNING", logger="flashqla_tune"):
        _load(pack)
    assert [kind for kind, *_ in offered] == ["chain", "prep"]
    warned = [r.getMessage() for r in caplog.records if "backward" in r.getMessage()]
    assert len(warned) == 1 and "backward chunk kernels" in warned[0] and "runs that part in torch" in warned[0]


@pytest.mark.parametrize("kind", ["chain", "prep", "chunk"])
def test_a_packs_backward_library_is_opened_on_first_use_only_and_refused_when_changed(tmp_path, monkeypatch,
                                                                                        kind):
    from flashqla_tune.backward import kernel_library

    module = _backward_modules()[kind]
    opened = []
    monkeypatch.setattr(kernel_library, "OpenedLibrary",
                        lambda lib_kind, path, spec: opened.append((lib_kind.symbol, path)) or ("library", path))
    monkeypatch.setattr(module.LIBRARIES, "cache_entry", lambda *a, **k: pytest.fail("built instead"))
    pack = make_pack(tmp_path / "p")
    record = read_manifest(pack).backward_library(kind)
    spec = module.spec_for(128, 128)
    _load(pack)
    assert opened == []   # loading opens none of them
    assert module.LIBRARIES.get(spec) == ("library", pack / record.so) and opened == [(module.KIND.symbol, pack / record.so)]
    assert module.LIBRARIES.get(spec) == ("library", pack / record.so) and len(opened) == 1
    # a library changed between the pack's load and its first backward is refused, not opened
    module.LIBRARIES.forget()
    _load(pack)
    (pack / record.so).write_bytes(b"swapped")
    with pytest.raises(module.KIND.error, match="does not match the sha256 its pack recorded"):
        module.LIBRARIES.get(spec)
    assert len(opened) == 1
