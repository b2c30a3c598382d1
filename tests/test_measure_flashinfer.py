"""CPU tests of the FlashInfer and cuDNN scoreboard columns (through the named test doubles in
flashinfer_doubles.py: the libraries' conventions, no GPU), of the scoreboard's row sets and of
the best-peer summary."""
from __future__ import annotations

import pytest
import torch

from flashqla_tune.bench import report, runner
from flashqla_tune.cli import main as cli_main
from flashqla_tune.measure import cases as C
from flashqla_tune.measure import impls as I
from flashqla_tune.measure import peer_flashinfer
from flashqla_tune.measure.inputs import make_inputs
from flashqla_tune.measure.timing import Timing
from flashqla_tune.measure.torch_chunked import chunk_gated_delta_rule_torch

from flashinfer_doubles import install_cudnn, install_flashinfer
from gdn_inputs import rel_l2

CASE = C.Case(2, 4, (40, 24), 16, 16)  # GVA, two sequences, a partial chunk in each


def _reference(x):
    return chunk_gated_delta_rule_torch(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
                                        output_final_state=True, cu_seqlens=x.cu_seqlens_long,
                                        cu_seqlens_cpu=x.cu_seqlens_cpu)


def _load(name):
    loaded, skipped = I.load_impls([name])
    assert not skipped, skipped
    return loaded[0]


def test_flashinfer_column_hands_over_its_conventions_and_returns_ours(monkeypatch):
    double = install_flashinfer(monkeypatch)
    impl = _load("flashinfer")
    x = make_inputs(CASE, "cpu", seed=3)
    o, s = I.call(impl, x)
    ref_o, ref_s = _reference(x)
    assert o.shape == x.v.shape and s.shape == x.initial_state.shape  # [1, T, Hv, V], [N, Hv, K, V]
    assert rel_l2(o, ref_o) < 1e-5 and rel_l2(s, ref_s) < 1e-5
    got = double.calls[-1]
    assert got["backend"] == "auto" and got["use_cp"] == "auto" and got["output_final_state"]
    assert torch.equal(got["g"], x.g[0].exp())  # the decay, not its logarithm
    assert torch.equal(got["initial_state"], x.initial_state.transpose(-1, -2))  # V-major
    assert got["cu_seqlens"] is x.cu_seqlens and got["cu_seqlens"].dtype == torch.int32
    assert got["scale"] == x.scale
    # q, k, v, beta are views of the protocol's tensors: nothing copied
    for name in ("q", "k", "v", "beta"):
        assert got[name].data_ptr() == getattr(x, name).data_ptr()
    assert "flashinfer" in I.LOADERS and "outside the timed call" in impl.note


def test_flashinfer_conversions_happen_once_per_input_set(monkeypatch):
    """The timed call (impls.call) reuses the set's prepared gate and state; the op-signature
    wrapper converts in every call and gives the same numbers."""
    double = install_flashinfer(monkeypatch)
    impl = _load("flashinfer")
    x = make_inputs(CASE, "cpu", seed=4)
    o1, s1 = I.call(impl, x)
    o2, s2 = I.call(impl, x)
    assert double.calls[0]["g"] is double.calls[1]["g"]
    assert double.calls[0]["initial_state"] is double.calls[1]["initial_state"]
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    o3, s3 = impl.fn(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.initial_state,
                     output_final_state=True, cu_seqlens=x.cu_seqlens)
    assert double.calls[2]["g"] is not double.calls[0]["g"]
    assert torch.equal(o3, o1) and torch.equal(s3, s1)
    o4, s4 = impl.fn(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, cu_seqlens=x.cu_seqlens)
    assert s4 is None and double.calls[3]["initial_state"] is None and not double.calls[3]["output_final_state"]


def test_flashinfer_state_v_first_passes_the_state_through(monkeypatch):
    double = install_flashinfer(monkeypatch)
    impl = _load("flashinfer")
    x = make_inputs(CASE, "cpu", seed=5)
    h0_vk = x.initial_state.transpose(-1, -2).contiguous()
    o, s = impl.fn(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=h0_vk, output_final_state=True,
                   state_v_first=True, cu_seqlens=x.cu_seqlens)
    assert double.calls[-1]["initial_state"] is h0_vk
    _, ref_s = _reference(x)
    assert s.is_contiguous() and rel_l2(s, ref_s.transpose(-1, -2)) < 1e-5
    with pytest.raises(ValueError, match="varlen-only"):
        impl.fn(x.q, x.k, x.v, x.g, x.beta)
    with pytest.raises(ValueError, match="batch size 1"):
        impl.fn(x.q.expand(2, -1, -1, -1), x.k, x.v, x.g, x.beta, cu_seqlens=x.cu_seqlens)


def test_flashinfer_column_goes_through_the_oracle_check(monkeypatch):
    install_flashinfer(monkeypatch)
    impl = _load("flashinfer")

    class FixedTimesForTests:  # test double: a number per implementation, nothing timed
        def warmup(self, call, sets):
            call(sets[0])

        def graph(self, call, sets):
            return Timing(0.5, [0.5])

    torch_impl, _ = I.load_impls(["torch"])
    res = runner.run([CASE], [impl, *torch_impl], {}, FixedTimesForTests(), modes=("graph",), device="cpu",
                     log=lambda m: None)
    acc, plain = res["rows"][0]["accuracy"]["flashinfer"], res["rows"][0]["accuracy"]["torch"]
    # the double runs the float32 algorithm the torch column runs: the same errors (o in bf16)
    assert acc["o"] < 4e-3 and acc["state"] < 1e-5
    assert acc["o"] == pytest.approx(plain["o"], rel=0.05)
    assert acc["state"] == pytest.approx(plain["state"], rel=0.5, abs=1e-6)
    assert res["rows"][0]["times"]["flashinfer"]["graph"]["median_ms"] == 0.5


def test_flashinfer_skip_reasons(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", None)
    _, skipped = I.load_impls(["flashinfer"])
    assert "flashinfer" in skipped["flashinfer"] and "Error" in skipped["flashinfer"]
    # On an sm_90 GPU whose SM90 kernels did not import, the column is skipped with the import's
    # own error rather than timing a call that fails with "kernel is unavailable".
    install_flashinfer(monkeypatch, sm90_kernels=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    _, skipped = I.load_impls(["flashinfer"])
    assert "flashinfer.gdn_kernels.delta_rule_dsl" in skipped["flashinfer"]


def test_cudnn_column_keeps_the_log_gate_and_converts_the_state(monkeypatch):
    double = install_cudnn(monkeypatch)
    fn, native, version = peer_flashinfer.load_cudnn(device="cpu")
    assert version == "0.0-test-double" and len(double.calls) == 1  # the probe
    impl = I._peer("cudnn", (fn, native, version), torch.int32, False, "test double")
    x = make_inputs(CASE, "cpu", seed=6)
    o, s = I.call(impl, x)
    ref_o, ref_s = _reference(x)
    assert rel_l2(o, ref_o) < 1e-5 and rel_l2(s, ref_s) < 1e-5
    assert double.calls[-1]["g"].data_ptr() == x.g.data_ptr()  # log-domain: no conversion


def test_cudnn_decline_is_a_skip_with_cudnns_reason_listed_in_the_scoreboard(monkeypatch):
    engine = "GdnFrostEngine requires SM100 / SM103 / SM107 (found 90)"
    install_cudnn(monkeypatch, decline=engine)
    with pytest.raises(RuntimeError, match="does not run on cpu .*NotImplementedError: GdnFrostEngine") as e:
        peer_flashinfer.load_cudnn(device="cpu")
    reason = f"RuntimeError: {e.value}"
    torch_impl, _ = I.load_impls(["torch"])
    res = runner.run([CASE], torch_impl, {"cudnn": reason}, _TorchOnlyTimer(), modes=("graph",), device="cpu",
                     log=lambda m: None)
    md = report.render_markdown(res)
    assert f"cudnn skipped: {reason}" in md and engine in md and "| cudnn |" not in md
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, skipped = I.load_impls(["cudnn"])
    assert skipped["cudnn"] == "RuntimeError: cuDNN's GDN needs a CUDA GPU"


class _TorchOnlyTimer:  # test double: a fixed time, nothing measured
    def warmup(self, call, sets):
        call(sets[0])

    def graph(self, call, sets):
        return Timing(40.0, [40.0])


def test_row_sets_leave_the_protocol_and_the_tuners_mix_as_they_are():
    protocol = C.select_cases()
    assert protocol == C.all_cases() and len(protocol) == 80 == len(C.select_cases(rows="protocol"))
    assert len(C.SEQLENS) == 10 and (65536,) not in C.SEQLENS  # the tuner's mix: the ten lengths
    everything = C.select_cases(rows="all")
    users = C.select_cases(rows="users")
    assert len(everything) == 12 * 12 and len(users) == 144 - 80
    assert {c.name for c in users} | {c.name for c in protocol} == {c.name for c in everything}
    assert not {c.name for c in users} & {c.name for c in protocol}
    assert {c.heads for c in users} == {c.heads for c in everything}
    assert {"1x65536", "1x131072"} <= {c.seqlens_label for c in users}
    picked = C.select_cases(heads=["2/8"], rows="users")
    assert [c.name for c in picked] == ["2/8 1x65536", "2/8 1x131072"]
    assert [c.name for c in C.select_cases(heads=["16/128"], seqlens=["1x2048"], rows="users")] == ["16/128 1x2048"]
    with pytest.raises(ValueError, match="only protocol rows"):
        C.select_cases(heads=["2/8"], seqlens=["1x2048"], rows="users")
    with pytest.raises(ValueError, match="unknown row set"):
        C.select_cases(rows="nope")


def test_bench_rows_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--rows {protocol,users,all}" in out and "flashinfer" in out and "cudnn" in out
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--rows", "nope"])
    assert e.value.code == 2


def test_summary_against_the_best_peer():
    def row(seqlens, times):
        return {"heads": "2/8", "seqlens": seqlens,
                "times": {name: {"graph": {"median_ms": t}} for name, t in times.items()}}
    names = ("flashqla_tune", "fla", "flashqla", "flashinfer")
    results = {"impls": {name: {"available": True} for name in names},
               "rows": [row("1x32768", {"flashqla_tune": 0.3, "fla": 1.0, "flashqla": 0.4, "flashinfer": 0.25}),
                        row("1x8192", {"flashqla_tune": 0.1, "fla": 0.25, "flashqla": 0.2, "flashinfer": 0.3})]}
    lines = report.summary_table(results, "graph")
    best = next(l for l in lines if "| flashqla_tune | best peer |" in l)
    assert f"{(0.3 / 0.25 * 0.1 / 0.2) ** 0.5:.3f}" in best and "1 of 2" in best and "1.20 (2/8 1x32768)" in best
    assert any("| flashqla_tune | flashinfer |" in l for l in lines)
    table = report.mode_table(results, "graph")
    assert "flashqla_tune/flashinfer" in table[0]
