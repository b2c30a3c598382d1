"""The training and backward benchmark scripts on the CPU: benchmarks/train_compare.py's moving-average
bar, its route of the GDN layers through use_pack (the op replaced by a named test double that
runs transformers' own PyTorch function), and its reference run in a subprocess (three tiny steps,
exit 2 with the reason the op's run needs); benchmarks/backward_bench.py's arguments, its table
math, one row measured on the CPU with a named test double of an implementation (the PyTorch
chunked forward, differentiated by autograd) against the float64 oracle, and its exit 2 without
a GPU; benchmarks/backward_chunk_variants.py's arguments, its byte count and its exit 2 without a
GPU."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


train_compare = _load("train_compare")
backward_bench = _load("backward_bench")
chunk_variants = _load("backward_chunk_variants")


# --- train_compare ---------------------------------------------------------------------------
def test_moving_average_is_trailing_and_starts_at_the_first_full_window():
    ma = train_compare.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3)
    assert ma[:2] == [None, None]
    assert ma[2:] == pytest.approx([2.0, 3.0, 4.0])


def test_moving_average_gap_finds_the_worst_step():
    reference = [2.0] * 40
    ours = [2.0] * 19 + [2.5] + [2.0] * 20      # one outlier at step 20: in the windows ending at 20..39
    gap = train_compare.moving_average_gap(ours, reference, 20)
    assert gap["steps_compared"] == 21           # steps 20..40
    assert gap["max_gap"] == pytest.approx(0.025)
    assert gap["max_gap_step"] == 20
    by_step = dict((s, g) for s, g in gap["gaps"])
    assert by_step[39] == pytest.approx(0.025) and by_step[40] == pytest.approx(0.0)
    assert not gap["max_gap"] <= train_compare.MAX_GAP     # 0.025 breaks the 0.02 bar
    assert train_compare.moving_average_gap([2.01] * 40, reference, 20)["max_gap"] <= train_compare.MAX_GAP


def test_moving_average_gap_refuses_unequal_runs_and_flags_non_finite_losses():
    with pytest.raises(ValueError, match="same steps"):
        train_compare.moving_average_gap([1.0] * 3, [1.0] * 4, 2)
    gap = train_compare.moving_average_gap([1.0, float("nan"), 1.0], [1.0, 1.0, 1.0], 2)
    assert gap["max_gap"] == math.inf
    assert train_compare.moving_average_gap([1.0], [1.0], 20)["max_gap"] is None   # no full window


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    lrs = [train_compare.lr_at(s, 300, 3e-3) for s in range(300)]
    assert lrs[0] == pytest.approx(3e-3 / 30) and lrs[29] == pytest.approx(3e-3)
    assert all(a >= b for a, b in zip(lrs[29:], lrs[30:]))
    assert lrs[-1] == pytest.approx(3e-4, rel=1e-3)


def test_batches_are_drawn_once_from_the_seed():
    a = train_compare.batch_starts(1000, 4, 3, 64, seed=5)
    assert a.shape == (4, 3) and int(a.max()) < 1000 - 64
    assert torch.equal(a, train_compare.batch_starts(1000, 4, 3, 64, seed=5))
    assert not torch.equal(a, train_compare.batch_starts(1000, 4, 3, 64, seed=6))


def test_the_op_route_reaches_every_gdn_layer_once_per_forward():
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from flashqla_tune.calibrate.default_model import default_model_path
    from flashqla_tune.integrations.transformers import use_pack

    checkpoint = default_model_path()
    config = AutoConfig.from_pretrained(str(checkpoint))
    module, torch_path, double = _torch_path_double()
    op = double(checkpoint, config.layer_types)
    weights = train_compare.initial_weights(config, seed=0)
    model = train_compare.fresh_model(config, weights, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        with use_pack(model, op, checkpoint=op.manifest.checkpoint_path) as route:
            routed = model(input_ids=ids, use_cache=False).logits
            calls = dict(route.calls)
    assert route.layers == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4}
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1} and op.seen == [0, 1, 2, 3, 4]
    assert torch.equal(routed, plain)
    assert module.torch_chunk_gated_delta_rule is torch_path     # closed: transformers' function is back
    # the same weights whatever run builds them: both runs start from one initialisation
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}
    again = train_compare.initial_weights(config, seed=0)
    assert all(torch.equal(again[n], t) for n, t in weights.items())


def _torch_path_double():
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    torch_path = module.torch_chunk_gated_delta_rule

    class OpAsPackOnTorchPathDouble(train_compare.OpAsPack):
        """OpAsPack whose op is transformers' own PyTorch function (no GPU): the route is under test."""
        seen: list

        def chunk_gated_delta_rule(self, *, layer, **kw):
            self.seen = getattr(self, "seen", []) + [layer]
            if not self.dtypes:
                self.dtypes = {n: str(kw[n].dtype).replace("torch.", "") for n in ("q", "k", "v", "g", "beta")}
            return torch_path(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)

    return module, torch_path, OpAsPackOnTorchPathDouble


def test_the_whole_comparison_on_the_cpu_with_the_op_double(tmp_path, monkeypatch):
    """main() end to end with the op's run on the CPU (where_to_run and the op replaced): three runs
    from one initialisation, the gap, the route's call counts, the JSON and the PNG."""
    pytest.importorskip("transformers")
    _, _, double = _torch_path_double()
    monkeypatch.setattr(train_compare, "OpAsPack", double)
    monkeypatch.setattr(train_compare, "where_to_run", lambda: (torch.device("cpu"), None))
    monkeypatch.setattr(train_compare, "block_fla", lambda: None)   # this process may hold FLA's test stand-in
    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    out = tmp_path / "tc"
    code = train_compare.main(["--out", str(out), "--steps", "4", "--seq-len", "64", "--batch", "1", "--window", "2",
                               "--max-gap", "1.0"])
    result = json.loads((out / "train_compare.json").read_text())
    assert code == 0, result["status"]
    runs = result["runs"]
    assert set(runs) == {"reference", "ours", "bf16_torch"}
    assert runs["ours"]["calls_per_gdn_layer"] == {str(i): 4 for i in range(5)}
    assert runs["ours"]["op_input_dtypes"] == {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16", "g": "float32",
                                               "beta": "bfloat16"}
    assert runs["ours"]["precision"].startswith("bf16 autocast")
    assert runs["reference"]["precision"].startswith("float32")
    # same initialisation and data: the first step's losses agree to bf16's rounding
    assert runs["ours"]["losses"][0] == pytest.approx(runs["reference"]["losses"][0], abs=0.05)
    assert runs["ours"]["losses"] == runs["bf16_torch"]["losses"]   # the double is the same PyTorch path
    gap = result["comparison"]["ours_vs_reference"]
    assert gap["steps_compared"] == 3 and gap["max_gap"] < 1.0
    if importlib.util.find_spec("matplotlib"):
        assert (out / "train_compare.png").stat().st_size > 0
        assert train_compare.main(["--plot", str(out / "train_compare.json"), "--out", str(tmp_path / "png")]) == 0
        assert (tmp_path / "png" / "train_compare.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: with a GPU the op's run starts")
def test_train_compare_runs_the_reference_and_reports_why_the_op_did_not_run(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "tc"
    done = subprocess.run([sys.executable, "-P", str(BENCHMARKS / "train_compare.py"), "--out", str(out),
                           "--steps", "3", "--seq-len", "128", "--batch", "2", "--window", "2"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "train_compare.json").read_text())
    assert result["status"].startswith("not run: the op's run needs an sm_90 GPU")
    for field in ("date", "commit", "python", "versions", "checkpoint", "model", "data", "args", "bar"):
        assert field in result, field
    assert result["versions"]["fla"] == "kept out of the process"
    ref = result["runs"]["reference"]
    assert len(ref["losses"]) == 3 and all(math.isfinite(x) for x in ref["losses"])
    assert ref["losses"][0] == pytest.approx(math.log(257), abs=0.3)
    assert ref["tokens_per_s"] > 0 and ref["peak_gpu_memory_bytes"] is None
    assert ref["precision"] == "float32, no autocast"
    assert result["runs"]["ours"] == {"status": "not run"}
    assert result["data"]["tokens_per_step"] == 256
    assert "reference: step 3/3" in (out / "train_compare.log").read_text()


def test_train_compare_arguments():
    args = train_compare.parse_args(["--out", "x"])
    assert (args.steps, args.window, args.max_gap) == (300, 20, 0.02)
    with pytest.raises(SystemExit):
        train_compare.parse_args([])               # neither --out nor --plot
    with pytest.raises(SystemExit):
        train_compare.parse_args(["--out", "x", "--steps", "0"])


# --- backward_bench ---------------------------------------------------------------------------
def test_backward_bench_arguments():
    args = backward_bench.parse_args(["out"])
    assert args.heads == [(2, 8), (16, 16), (16, 32), (16, 64)]
    assert args.seqlens is None and args.impl == ["flashqla_tune", "flashqla", "fla"]
    assert args.fla_dispatch == "tilelang" and args.accuracy_max_tokens == 4096
    args = backward_bench.parse_args(["out", "--heads", "4/16", "--seqlens", "28672+4096", "--seqlens", "8192x4",
                                      "--impl", "fla", "--impl", "fla", "--fla-dispatch", "off"])
    assert args.heads == [(4, 16)] and args.seqlens == [(28672, 4096), (8192,) * 4] and args.impl == ["fla"]
    for bad in (["out", "--heads", "3/8"], ["out", "--seqlens", "1x"], ["out", "--impl", "torch"],
                ["out", "--budget-s", "0"]):
        with pytest.raises(SystemExit):
            backward_bench.parse_args(bad)


def test_fla_environment_per_dispatch_mode(monkeypatch):
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")      # as h200_steps.sh exports it
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    backward_bench.set_fla_environment("tilelang")
    import os
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "0" and os.environ["FLA_FLASH_QLA"] == "0"
    backward_bench.set_fla_environment("off")
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "1"


def _row(name, ours_ms, qla_ms, fla_ms, mem=(100, 120, 90)):
    impls = {}
    for impl, ms, peak in zip(("flashqla_tune", "flashqla", "fla"), (ours_ms, qla_ms, fla_ms), mem):
        impls[impl] = {"ms": ms, "step_peak_bytes": peak} if ms is not None else {"error": "RuntimeError: no"}
    return {"name": name, "impls": impls}


def test_speedups_geomean_and_memory_rows():
    assert backward_bench.speedup(2.0, 3.0) == pytest.approx(1.5)
    assert backward_bench.speedup(None, 3.0) is None and backward_bench.speedup(2.0, 0.0) is None
    assert backward_bench.geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert backward_bench.geomean([None]) is None
    rows = [_row("a", 1.0, 2.0, 4.0), _row("b", 2.0, 1.0, None, mem=(100, 120, None)), _row("c", None, 1.0, 1.0)]
    s = backward_bench.summarize(rows)
    assert s["flashqla"]["rows"] == 2 and s["flashqla"]["geomean_speedup"] == pytest.approx(1.0)
    assert s["flashqla"]["min_speedup"] == pytest.approx(0.5) and s["flashqla"]["rows_ours_slower"] == ["b"]
    assert s["fla"]["rows"] == 1 and s["fla"]["geomean_speedup"] == pytest.approx(4.0)
    assert s["memory_rows_above_lower_peer"] == ["a"]       # 100 > fla's 90; row b's only peer used 120
    result = {"date": "d", "commit": "c", "gpu": {"name": "GPU double"}, "versions": {}, "notes": {},
              "impls": ["flashqla_tune", "flashqla", "fla"], "rows": rows, "summary": s, "skipped": {},
              "layer": {"flashqla_tune": {"ms": 2.0, "tokens_per_s": 16384000.0}, "fla": {"error": "no"}}}
    table = backward_bench.markdown(result)
    assert "| a | 1.000 | 2.000 | 4.000 | 2.00x | 4.00x | 0 | 0 | 0 | - |" in table
    assert "flashqla/ours geomean 1.00x over 2 rows, lowest 0.50x; rows where ours is slower: b" in table
    assert "| flashqla_tune | 2.000 | 1.64e+07 |" in table and "c flashqla_tune: RuntimeError: no" in table


class CpuTimerDouble:
    """measure.timing.CudaTimer's eager() on the host clock, for a CPU row."""

    def eager(self, call, sets):
        import time

        from flashqla_tune.measure.timing import Timing

        samples = []
        for x in sets * 2:
            t0 = time.perf_counter()
            call(x)
            samples.append((time.perf_counter() - t0) * 1e3)
        return Timing(sorted(samples)[len(samples) // 2], samples)


def test_one_row_on_the_cpu_with_a_double_against_the_float64_oracle():
    from flashqla_tune.measure.cases import Case
    from flashqla_tune.measure.torch_chunked import chunk_gated_delta_rule_torch

    def broken(q, k, v, g, beta, **kw):
        raise RuntimeError("this double refuses")

    impls = [backward_bench.StepImpl("flashqla_tune", chunk_gated_delta_rule_torch, None, "PyTorch chunked double"),
             backward_bench.StepImpl("fla", broken, None, "a failing double", takes_cu_seqlens_cpu=False)]
    lines = []
    row = backward_bench.run_row(Case(1, 2, (70, 30)), impls, CpuTimerDouble(), seed=0, accuracy_max_tokens=4096,
                                 cuda=False, log=lines.append)
    ours = row["impls"]["flashqla_tune"]
    assert row["name"] == "1/2 70+30" and row["tokens"] == 100
    assert set(ours["grad_errors"]) == {"dq", "dk", "dv", "dg", "dbeta", "dh0"}
    errs = ours["grad_errors"]
    assert max(errs[n] for n in ("dq", "dk", "dv")) < 4e-3        # bf16 gradients: their rounding alone
    assert max(errs[n] for n in ("dg", "dbeta", "dh0")) < 1e-5     # fp32 gradients of an fp32 algorithm
    assert ours["grad_errors_within_ceilings"] is True
    assert ours["ms"] > 0 and ours["samples"] == 4 and ours["step_peak_bytes"] is None
    assert row["impls"]["fla"] == {"error": "RuntimeError: this double refuses"}
    assert len(lines) == 2
    # a row past the accuracy bound is timed only
    row = backward_bench.run_row(Case(1, 2, (64,)), impls[:1], CpuTimerDouble(), 0, 32, False, lines.append)
    assert "grad_errors" not in row["impls"]["flashqla_tune"] and row["impls"]["flashqla_tune"]["ms"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_backward_bench_without_a_gpu_exits_2(tmp_path):
    assert backward_bench.main([str(tmp_path)]) == 2
    result = json.loads((tmp_path / "backward_bench.json").read_text())
    assert result["status"].startswith("not run: our op's step needs an sm_90 GPU")
    for field in ("date", "commit", "versions", "gpu", "args"):
        assert field in result
    assert (tmp_path / "backward_bench.md").read_text().startswith("# Forward + backward, eager (no GPU)")


def test_join_makes_one_table_of_two_parts(tmp_path):
    def part(name, rows, layer=None):
        result = {"date": "d", "commit": "c", "gpu": {"name": "GPU double"}, "versions": {}, "status": "pass",
                  "notes": {"flashqla_tune": "x"}, "impls": ["flashqla_tune", "flashqla", "fla"], "rows": rows,
                  "skipped": {}, "failures": [], "layer": layer}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(result))
        return str(path)

    a = part("a", [_row("2/8 1x2048", 1.0, 2.0, 4.0)])
    b = part("b", [_row("16/32 1x32768", 2.0, 4.0, 4.0), _row("2/8 1x2048", 9.0, 1.0, 1.0)],
             layer={"flashqla_tune": {"ms": 2.0, "tokens_per_s": 16384000.0}})
    out = tmp_path / "joined"
    assert backward_bench.main([str(out), "--join", a, "--join", b]) == 0
    result = json.loads((out / "backward_bench.json").read_text())
    assert [r["name"] for r in result["rows"]] == ["2/8 1x2048", "16/32 1x32768"]   # a row once, first part's
    assert result["summary"]["flashqla"]["geomean_speedup"] == pytest.approx(2.0)
    assert result["layer"]["flashqla_tune"]["ms"] == 2.0 and len(result["parts"]) == 2
    assert "## One GDN layer, 16/32 heads, 1x32768" in (out / "backward_bench.md").read_text()


# --- backward_chunk_variants -----------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--heads", "3/4"], "multiple of the q/k heads"), (["--heads", "two/eight"], "is not h_qk/h_v"),
    (["--tokens", "100"], "multiple of 64"), (["--tokens", "0"], "multiple of 64")])
def test_chunk_variants_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        chunk_variants.parse_args(["out", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_chunk_variants_counts_what_each_tile_asks_for():
    """Each tile (chunk, v-head) reads its q/k head's q and k tiles (the v-heads of a group read them
    again) and its own tiles of every other input, and writes its outputs, dq and dk into its q/k
    head's (once per v-head of the group)."""
    NC, hqk, hv = 3, 2, 8
    q = k = torch.zeros(NC, hqk, 64, 128)
    per_head = [torch.zeros(NC, hv, 64, 128)] * 4 + [torch.zeros(NC, hv, 64)] * 2 + [torch.zeros(NC, hv, 64, 64)]
    per_head += [torch.zeros(NC, hv, 128, 128)] * 2 + [torch.zeros(NC, hv, 64, 128)] * 2 + [torch.zeros(NC, hv)] * 2
    outputs = [torch.zeros(NC, hqk, 64, 128)] * 2 + [torch.zeros(NC, hv, 64, 128)] + [torch.zeros(NC, hv, 64)] * 2
    ctas = NC * hv   # tiles
    want = ctas * 4 * (2 * 64 * 128 + 4 * 64 * 128 + 2 * 64 + 64 * 64 + 2 * 128 * 128 + 2 * 64 * 128 + 2
                       + 3 * 64 * 128 + 2 * 64)
    assert chunk_variants.launch_bytes((q, k, *per_head), outputs, hv) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_chunk_variants_exits_2_without_a_gpu(tmp_path, capsys):
    assert chunk_variants.main([str(tmp_path)]) == 2
    assert "sm_90" in capsys.readouterr().err
