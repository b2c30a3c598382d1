"""CPU tests of the scoreboard: protocol inputs and cases, the plain-PyTorch baseline against the
float64 oracle, the report writer on synthetic numbers, the CLI's help. Timing itself needs the
H200 and is exercised there (benchmarks/h200_scoreboard.sh)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flashqla_tune.bench import report, runner
from flashqla_tune.measure import cases as C
from flashqla_tune.measure import floor
from flashqla_tune.measure.impls import load_impls
from flashqla_tune.measure.inputs import make_inputs, make_rotation, zero_gate_heads
from flashqla_tune.measure.timing import Timing, rotation_count
from flashqla_tune.measure.torch_chunked import chunk_gated_delta_rule_torch
from flashqla_tune.cli import main as cli_main
from flashqla_tune.oracle import chunk_gated_delta_rule_chunked, recurrent_gated_delta_rule

from gdn_inputs import make_inputs as oracle_inputs, rel_l2



def test_cases_are_exactly_the_protocol():
    heads = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16)]
    lens = ["1x32768", "1x8192", "1x2048", "28672+4096", "16384+16384", "4096+28672",
            "12288+4096", "1024+7168", "8192x4", "1024x8"]
    got = C.all_cases()
    assert len(got) == 80
    assert [(c.num_qk_heads, c.num_v_heads) for c in got[::10]] == heads
    assert [c.seqlens_label for c in got[:10]] == lens
    assert all(c.head_k_dim == c.head_v_dim == 128 for c in got)
    assert [C.parse_seqlens(s) for s in lens] == list(C.SEQLENS)


def test_case_filters_and_bad_values():
    quick = C.select_cases(quick=True)
    assert {c.heads for c in quick} == {"2/8", "16/64"} and len(quick) == 6
    picked = C.select_cases(heads=["16/32"], seqlens=["8192x4", "1024+7168"])
    assert [c.name for c in picked] == ["16/32 8192x4", "16/32 1024+7168"]
    with pytest.raises(ValueError, match="16/33"):
        C.parse_heads("16/33")
    with pytest.raises(ValueError, match="1xabc"):
        C.parse_seqlens("1xabc")


def test_inputs_follow_the_protocol():
    case = C.Case(2, 8, (100, 37))
    x = make_inputs(case, "cpu", seed=3)
    T = 137
    assert x.q.shape == x.k.shape == (1, T, 2, 128) and x.v.shape == (1, T, 8, 128)
    assert x.q.dtype == x.k.dtype == x.v.dtype == torch.bfloat16
    assert x.g.shape == x.beta.shape == (1, T, 8) and x.g.dtype == x.beta.dtype == torch.float32
    assert x.initial_state.shape == (2, 8, 128, 128) and x.initial_state.dtype == torch.float32
    assert torch.allclose(x.q.float().norm(dim=-1), torch.ones(1, T, 2), atol=1e-2)
    assert torch.allclose(x.k.float().norm(dim=-1), torch.ones(1, T, 2), atol=1e-2)
    assert x.cu_seqlens.dtype == torch.int32 and x.cu_seqlens_long.dtype == torch.int64
    assert x.cu_seqlens_cpu.tolist() == [0, 100, 137] == x.cu_seqlens.tolist()
    assert x.scale == 128 ** -0.5
    assert ((x.beta > 0) & (x.beta < 1)).all()
    zero = zero_gate_heads(8)
    assert len(zero) == 2  # 25% of 8
    assert (x.g[..., zero] == 0).all()
    others = [h for h in range(8) if h not in zero.tolist()]
    assert (x.g[..., others] < 0).all() and (x.g[..., others] > -1).all()
    # the zero-gate heads are fixed by a seed, not by the data seed
    assert torch.equal(zero, zero_gate_heads(8)) and len(zero_gate_heads(64)) == 16
    y = make_inputs(case, "cpu", seed=4)
    assert (y.g[..., zero] == 0).all() and not torch.equal(x.v, y.v)
    assert torch.equal(make_inputs(case, "cpu", seed=3).v, x.v)


def test_rotation_shares_cu_seqlens_objects():
    sets = make_rotation(C.Case(2, 8, (64, 64)), 3, "cpu")
    assert len(sets) == 3 and not torch.equal(sets[0].v, sets[1].v)
    assert all(s.cu_seqlens is sets[0].cu_seqlens and s.cu_seqlens_long is sets[0].cu_seqlens_long for s in sets)
    assert rotation_count(10 << 20, 60 << 20, 4 << 30) == 12
    assert rotation_count(1 << 30, 60 << 20, 4 << 30) == 1
    assert rotation_count(1 << 20, 60 << 20, 4 << 20) == 4  # capped by memory


@pytest.mark.parametrize("cu,svf,hqk,hv", [([0, 37, 101, 231], False, 2, 4), (None, True, 1, 3),
                                           ([0, 5, 69, 200], True, 2, 2)])
def test_torch_baseline_matches_oracle(cu, svf, hqk, hv):
    d = oracle_inputs(B=2 if cu is None else 1, T=150, Hqk=hqk, Hv=hv, K=16, V=8, cu_seqlens=cu,
                      initial_state=True, state_v_first=svf, gate="mixed")
    ref_o, ref_s = recurrent_gated_delta_rule(**d, output_final_state=True)
    ch_o, ch_s = chunk_gated_delta_rule_chunked(**d, output_final_state=True)
    f32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in d.items()}
    o, s = chunk_gated_delta_rule_torch(**f32, output_final_state=True, cu_seqlens_cpu=d["cu_seqlens"])
    assert o.dtype == s.dtype == torch.float32
    assert rel_l2(o, ref_o) < 1e-5 and rel_l2(s, ref_s) < 1e-5
    assert rel_l2(o, ch_o) < 1e-5 and rel_l2(s, ch_s) < 1e-5
    o64, s64 = chunk_gated_delta_rule_torch(**d, output_final_state=True, compute_dtype=torch.float64)
    assert rel_l2(o64, ref_o) < 1e-12 and rel_l2(s64, ref_s) < 1e-12


def test_torch_baseline_l2norm_and_no_state():
    d = oracle_inputs(T=70, Hqk=1, Hv=2, K=8, V=8, gate="strong")
    d["q"], d["k"] = d["q"] * 3, d["k"] * 0.5
    ref_o, _ = recurrent_gated_delta_rule(**d, use_qk_l2norm_in_kernel=True)
    o, s = chunk_gated_delta_rule_torch(**d, use_qk_l2norm_in_kernel=True, compute_dtype=torch.float64)
    assert s is None and rel_l2(o, ref_o) < 1e-12


def test_floor_numbers():
    per_token = floor.flops_per_chunk_head() / floor.CHUNK
    assert 120e3 < per_token < 150e3  # the design card's "about 140 kFLOP per token per v-head"
    case = C.Case(2, 8, (32768,))
    # q, k: 2 MiB-ish each per 4096 tokens...: check by hand for this case
    want = 2 * (2 * 32768 * 2 * 128 + 2 * 32768 * 8 * 128) + 8 * 32768 * 8 + 8 * 8 * 128 * 128
    assert floor.case_bytes(case) == want
    f = floor.case_floor(case, {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": 1e15})
    assert f["floor_ms"] == max(f["bytes_ms"], f["flops_ms"]) and f["bound"] == "memory"


class FakeTimerForTests:
    """Test double: returns synthetic times per implementation without measuring anything."""

    MS = {"fla": 2.0, "flashqla": 1.0, "torch": 40.0}

    def warmup(self, call, sets):
        call(sets[0])  # still runs the implementation once, so a broken call shows

    def graph(self, call, sets):
        return Timing(self.MS[call.__defaults__[0].name], [1.0])

    def eager(self, call, sets):
        return Timing(error="eager call failed: synthetic")


def test_report_on_synthetic_numbers(tmp_path):
    impls, skipped = load_impls(["torch"])
    assert [i.name for i in impls] == ["torch"]
    fake_fla = impls[0].__class__("fla", impls[0].fn, torch.int64, "0.0", "test double")
    fake_fqla = impls[0].__class__("flashqla", impls[0].fn, torch.int64, "0.0", "test double")
    cases = [C.Case(1, 4, (70, 50), 16, 16), C.Case(2, 4, (64,), 16, 16)]
    results = runner.run(cases, [fake_fla, fake_fqla, impls[0]], {"flashqla_tune": "ImportError: not yet"},
                         FakeTimerForTests(), device="cpu", ceilings={
                             "copy_bytes_per_s": 4e12, "matmul_flops_per_s": 7e14, "matmul_n": 8192},
                         out_dir=tmp_path, log=lambda m: None)
    md = (tmp_path / "scoreboard.md").read_text()
    js = json.loads((tmp_path / "scoreboard.json").read_text())
    assert js["rows"][0]["times"]["torch"]["graph"]["median_ms"] == 40.0
    assert js["impls"]["flashqla_tune"] == {"available": False, "reason": "ImportError: not yet"}
    assert "| heads (h_qk/h_v) | seqlens | floor | fla | flashqla | torch |" in md
    # FLA/FlashQLA = 2.00, torch/FLA = 20.00, torch/FlashQLA = 40.00
    line = next(l for l in md.splitlines() if "70+50" in l)
    assert "| 2.000 | 1.000 | 40.000 | 2.00 |" in line and "| 20.00 | 40.00 |" in line
    assert "eager call failed: synthetic" in md and "flashqla_tune skipped" in md
    acc = js["rows"][0]["accuracy"]["torch"]
    # fp32 baseline vs float64 reference: o is rounded to bf16 (v's dtype), the state is fp32
    assert acc["o"] < 4e-3 and acc["state"] < 1e-5
    assert "8.79 TB/s" not in md and "4.00 TB/s" in md


def test_budget_marks_rows_not_run(tmp_path):
    impls, _ = load_impls(["torch"])
    res = runner.run([C.Case(1, 1, (8,), 8, 8)] * 2, impls, {}, FakeTimerForTests(), device="cpu",
                     budget_s=-1.0, log=lambda m: None)
    assert all("not run" in r["error"] for r in res["rows"])
    assert "not run" in report.render_markdown(res)


def test_table_written_mid_run_names_the_rows_not_reached(tmp_path):
    """A run killed during its second row (a device call's time limit) leaves a table that lists
    that row as not reached instead of dropping it."""
    impls, _ = load_impls(["torch"])
    torch_impl = impls[0]

    def killed_on_two_heads(*args, **kwargs):  # stands in for the outside kill
        if any(isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[2] == 2 for a in args):
            raise KeyboardInterrupt
        return torch_impl.fn(*args, **kwargs)
    dying = torch_impl.__class__("torch", killed_on_two_heads, torch_impl.cu_dtype, "0", "test double")
    with pytest.raises(KeyboardInterrupt):
        runner.run([C.Case(1, 1, (8,), 8, 8), C.Case(2, 2, (8,), 8, 8)], [dying], {}, FakeTimerForTests(),
                   device="cpu", out_dir=tmp_path, log=lambda m: None)
    md = (tmp_path / "scoreboard.md").read_text()
    assert "ended before this row" in md
    rows = json.loads((tmp_path / "scoreboard.json").read_text())["rows"]
    assert "error" not in rows[0] and rows[0]["times"]["torch"]["graph"]["median_ms"] == 40.0
    assert rows[1]["heads"] == "2/2" and rows[1]["error"] == runner.NOT_REACHED


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--impl", "--heads", "--seqlens", "--quick", "--out", "--no-graph", "--no-eager"):
        assert flag in out
    from flashqla_tune.measure.impls import LOADERS
    for name in LOADERS:  # the help names every implementation
        assert name in " ".join(out.split())


def test_unknown_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="nope"):
        load_impls(["nope"])


def test_impl_row_limit(tmp_path):
    impls, _ = load_impls(["torch"])
    res = runner.run([C.Case(1, 1, (8,), 8, 8), C.Case(1, 1, (100,), 8, 8)], impls, {}, FakeTimerForTests(),
                     device="cpu", impl_max_tokens={"torch": 50}, log=lambda m: None)
    assert res["rows"][0]["times"]["torch"]["graph"]["median_ms"] == 40.0
    assert "over 50 tokens" in res["rows"][1]["times"]["torch"]["graph"]["error"]


def test_impl_failing_everywhere_gets_no_columns(tmp_path):
    impls, _ = load_impls(["torch"])

    def broken(*a, **k):
        raise RuntimeError("toolchain missing")
    bad = impls[0].__class__("flashqla_tune", broken, torch.int32, "0.1", "test double")
    res = runner.run([C.Case(1, 1, (8,), 8, 8)], [impls[0], bad], {}, FakeTimerForTests(), device="cpu",
                     log=lambda m: None)
    res["meta"]["notes"] = ["a note"]
    md = report.render_markdown(res)
    assert "flashqla_tune (0.1) failed on every row: warm-up failed: RuntimeError: toolchain missing" in md
    assert "| flashqla_tune |" not in md and "| torch |" in md and "- note: a note" in md


def test_calibrated_warmup_column_uses_the_protocols_calibration():
    """The headline column's table comes from calibrating the protocol's gates: the zero-gate heads
    chain exactly, the others warm up over a few chunks."""
    from flashqla_tune.measure.inputs import protocol_warmup_table, zero_gate_heads

    for hv in (8, 64):
        table = protocol_warmup_table(hv)
        zero = set(zero_gate_heads(hv).tolist())
        assert len(table) == hv
        assert all((n == -1) == (h in zero) for h, n in enumerate(table))
        assert all(1 <= n <= 16 for n in table if n != -1)
    names = ["flashqla_tune", "flashqla_tune_single_chain", "flashqla_tune_warmup", "flashqla_tune_exact_cp"]
    impls, skipped = load_impls(names)
    assert [i.name for i in impls] == names and not skipped


def test_prewarm_builds_our_plans_for_every_head_configuration(monkeypatch):
    """--prewarm builds the default plan of each head configuration in one call (one parallel
    ninja run) beside the anchors' compile processes; a failure is reported, not raised."""
    from flashqla_tune import cache
    from flashqla_tune.cli.bench import _start_plan_build

    asked = []
    monkeypatch.setattr(cache, "get_kernels", lambda plans: asked.append([p.spec.name for p in plans]))
    thread = _start_plan_build([(2, 8), (16, 64)])
    thread.join()
    assert len(asked) == 1 and [n.split("_")[1:3] for n in asked[0]] == [["qk2", "v8"], ["qk16", "v64"]]
    assert thread.outcome.startswith("2 built or cached")

    def broken(plans):
        raise RuntimeError("nvcc missing")
    monkeypatch.setattr(cache, "get_kernels", broken)
    thread = _start_plan_build([(2, 8)])
    thread.join()
    assert thread.outcome == "build failed (RuntimeError: nvcc missing)"


def test_summary_reads_the_targets_off_the_table():
    """Geomean ratio, rows faster and the worst row of each of our columns against each anchor,
    over the rows both timed (a row our column missed is left out, not counted as a win)."""
    def row(heads, seqlens, times):
        return {"heads": heads, "seqlens": seqlens,
                "times": {name: {"graph": {"median_ms": t}} for name, t in times.items()}}
    results = {"impls": {name: {"available": True} for name in ("flashqla_tune", "fla", "flashqla")},
               "rows": [row("2/8", "1x32768", {"flashqla_tune": 0.5, "fla": 1.0, "flashqla": 0.4}),
                        row("2/8", "1x8192", {"flashqla_tune": 0.2, "fla": 0.25, "flashqla": 0.2}),
                        row("2/8", "1x2048", {"fla": 0.1, "flashqla": 0.08})]}
    lines = report.summary_table(results, "graph")
    fla = next(l for l in lines if "| flashqla_tune | fla |" in l)
    flashqla = next(l for l in lines if "| flashqla_tune | flashqla |" in l)
    assert "| 2 |" in fla and f"{math.sqrt(0.5 * 0.8):.3f}" in fla and "2 of 2" in fla and "0.80 (2/8 1x8192)" in fla
    assert "0 of 2" in flashqla and "1.25 (2/8 1x32768)" in flashqla
    assert report.summary_table(results, "eager") == []


def test_build_variants_builds_each_variant_with_its_own_flags(monkeypatch):
    from flashqla_tune.measure import variants
    from flashqla_tune.plan import default_plan
    from flashqla_tune.spec import GDNSpec

    built = []

    def recording_get_kernels(plans, config=None):  # test double: records instead of running nvcc
        built.append(config.extra_flags)
        return [f"entry {plan.name} {' '.join(config.extra_flags)}" for plan in plans]

    monkeypatch.setattr(variants.cache, "get_kernels", recording_get_kernels)
    plans = [default_plan(GDNSpec(2, 8)), default_plan(GDNSpec(16, 16))]
    entries = variants.build_variants(plans, {"a": ("-DX=0",), "b": ("-DX=1", "-DY=1")})
    assert sorted(built) == [("-DX=0",), ("-DX=1", "-DY=1")]
    assert entries["b"] == [f"entry {p.name} -DX=1 -DY=1" for p in plans]


def test_build_variants_takes_a_whole_build_config_for_an_older_tree(monkeypatch, tmp_path):
    """benchmarks/host_launch_ab.py's FQT_BASE_CSRC: a variant given as a BuildConfig (another
    csrc/) builds with that config as is, beside variants given as flags."""
    from flashqla_tune.measure import variants
    from flashqla_tune.build import BuildConfig
    from flashqla_tune.plan import default_plan
    from flashqla_tune.spec import GDNSpec

    configs = []

    def recording_get_kernels(plans, config=None):  # test double: records instead of running nvcc
        configs.append(config)
        return [config.csrc_dir for _ in plans]

    monkeypatch.setattr(variants.cache, "get_kernels", recording_get_kernels)
    older = BuildConfig(csrc=tmp_path, extra_flags=("-DNDEBUG",))
    entries = variants.build_variants([default_plan(GDNSpec(2, 8))], {"product": ("-DNDEBUG",), "base": older})
    assert older in configs and len(configs) == 2
    assert entries["base"] == [tmp_path.resolve()]
    assert entries["product"] != entries["base"]


def test_capture_launch_records_the_ops_launch_on_the_given_library(monkeypatch):
    """measure.variants.capture_launch: the library it is given becomes the plan's library through
    runtime.register_library, so the op's own launch reaches it and is recorded; a plan that has a
    library already is refused, and a call that launches nothing is an error."""
    from flashqla_tune import runtime
    from flashqla_tune.measure import variants
    from flashqla_tune.plan import default_plan
    from flashqla_tune.spec import GDNSpec

    monkeypatch.setattr(runtime, "_libraries", {})  # a fresh process's registry: no plan loaded
    monkeypatch.setattr(runtime, "_registered", {})

    class LibraryDouble:  # test double: launches nothing, counts the launches that reach it
        def __init__(self):
            self.launched = []

        def launch(self, args, stream):
            self.launched.append((args, stream))

        def workspace_bytes(self, T, N, segments):
            return 64 * T + N + segments

    plan, lib = default_plan(GDNSpec(2, 8)), LibraryDouble()
    args, stream = variants.capture_launch(plan, lib, lambda: runtime.library(plan).launch("the args", 7))
    assert (args, stream) == ("the args", 7) and lib.launched == [("the args", 7)]
    assert runtime.library(plan).workspace_bytes(2, 1, 0) == 129  # everything else is the wrapped library's
    with pytest.raises(RuntimeError, match="already has a library"):
        variants.capture_launch(plan, LibraryDouble(), lambda: None)
    other = default_plan(GDNSpec(16, 16))
    with pytest.raises(RuntimeError, match="launched nothing"):
        variants.capture_launch(other, LibraryDouble(), lambda: None)


def _scoreboard_for_join(rows, torch_version="2.11", gpu="NVIDIA H200"):
    """A minimal scoreboard JSON as runner.run writes it (a test double: synthetic times)."""
    return {"meta": {"environment": {"date": "2026-12-01 00:00 UTC", "versions": {"torch": torch_version},
                                     "gpu": {"name": gpu, "sm_count": 132}, "driver": "1"},
                     "modes": ["graph"], "protocol": "synthetic", "flops_per_token_head": 1.0},
            "impls": {name: {"available": True, "version": "0", "note": "test double"}
                      for name in ("flashqla_tune_warmup", "flashqla")},
            "rows": [{"heads": h, "seqlens": s, "tokens": 1,
                      "times": {"flashqla_tune_warmup": {"graph": {"median_ms": ours}},
                                "flashqla": {"graph": {"median_ms": anchor}}}} for h, s, ours, anchor in rows]}


def test_join_makes_one_summary_of_two_halves_and_refuses_what_does_not_belong(tmp_path):
    from flashqla_tune.cli.bench import main as bench_main
    first = _scoreboard_for_join([("16/16", "1x8192", 0.8, 1.0)])
    second = _scoreboard_for_join([("8/32", "1x8192", 1.25, 1.0), ("8/32", "1024x8", 0.5, 1.0)])
    joined = report.join([first, second], ["a.json", "b.json"])
    assert [r["heads"] for r in joined["rows"]] == ["16/16", "8/32", "8/32"]
    line = next(l for l in report.summary_table(joined, "graph") if "| flashqla |" in l)
    assert f"{(0.8 * 1.25 * 0.5) ** (1 / 3):.3f}" in line and "2 of 3" in line and "1.25 (8/32 1x8192)" in line
    assert "joined from a.json" in joined["meta"]["notes"][-1] and "notes" not in first["meta"]
    with pytest.raises(ValueError, match="row 16/16 1x8192 is in both a.json and c.json"):
        report.join([first, first], ["a.json", "c.json"])
    # a row one part did not reach is taken from the part that ran it, in either order
    cut = _scoreboard_for_join([("8/32", "1x8192", 1.0, 1.0)])
    cut["rows"][0].update(times={}, error=report.NOT_REACHED)
    for parts, names in (([cut, second], ["cut.json", "b.json"]), ([second, cut], ["b.json", "cut.json"])):
        rows = report.join(parts, names)["rows"]
        assert [(r["seqlens"], bool(r["times"])) for r in rows if r["heads"] == "8/32"].count(("1x8192", True)) == 1
        assert len(rows) == 2
    with pytest.raises(ValueError, match="b.json: versions .*2.10"):
        report.join([first, _scoreboard_for_join([], torch_version="2.10")], ["a.json", "b.json"])
    with pytest.raises(ValueError, match="b.json: GPU 'NVIDIA H100'"):
        report.join([first, _scoreboard_for_join([], gpu="NVIDIA H100")], ["a.json", "b.json"])
    # the command line: files in, one scoreboard out, no GPU touched
    paths = []
    for name, part in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(part))
        paths += ["--join", str(tmp_path / name)]
    assert bench_main([*paths, "--out", str(tmp_path / "out"), "--stem", "joined"]) == 0
    assert "2 of 3" in (tmp_path / "out" / "joined.md").read_text()
    with pytest.raises(ValueError, match="give --out"):
        bench_main(paths)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not a readable scoreboard JSON"):
        bench_main(["--join", str(tmp_path / "bad.json"), "--join", str(tmp_path / "a.json"), "--out", str(tmp_path)])


def test_the_tuner_and_the_measurement_library_never_import_the_scoreboard():
    """flashqla_tune.measure is what the tuner and the scoreboard share: it imports neither of them,
    and the tuner reaches the protocol's cases, inputs and timers through it, never through
    flashqla_tune.bench (checked in a fresh interpreter, whose sys.modules starts empty)."""
    import subprocess
    import sys

    check = (
        "import sys, pkgutil, importlib, flashqla_tune.measure as m\n"
        "for info in pkgutil.iter_modules(m.__path__): importlib.import_module(f'flashqla_tune.measure.{info.name}')\n"
        "assert not [n for n in sys.modules if n.startswith(('flashqla_tune.bench', 'flashqla_tune.tune'))], sys.modules\n"
        "import flashqla_tune.tune, flashqla_tune.tune.measure, flashqla_tune.tune.segments, flashqla_tune.tune.driver\n"
        "bench = [n for n in sys.modules if n.startswith('flashqla_tune.bench')]\n"
        "assert not bench, bench\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
