"""Cold start: the wall time of a fresh interpreter that produces the first output of a GDN call.

    python -P benchmarks/cold_start.py OUT [--pack PACK] [--impl ours|flashqla|fla|flashinfer ...] [--runs 2]

Each run spawns `python -c` that imports torch, creates the CUDA context, imports the
implementation (ours: `flashqla_tune.load(PACK)`), makes bf16 inputs of a 2/8-head 1x8192 call
and synchronises on its first output. The parent clocks spawn to first output and spawn to exit;
the child reports its phases. Runs repeat per implementation (the page cache is warm from the
second; FLA's and FlashQLA's JIT caches are warm too, as a serving restart would find them).

Ours runs with an empty, private FLASHQLA_TUNE_CACHE and must leave it empty: a pack's first call
compiles nothing. Without --pack, an untuned pack of the shipped model is built first (its time
is not part of the cold start). Writes OUT/cold_start.json after each implementation and prints one line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The child: phases on the wall clock (time.time, comparable with the parent's spawn time).
CHILD = r"""
import json, sys, time
marks = {"start": time.time()}
import torch
marks["import_torch"] = time.time()
torch.empty(1, device="cuda"); torch.cuda.synchronize()
marks["cuda_context"] = time.time()
impl, pack = sys.argv[1], sys.argv[2]
if impl == "ours":
    import flashqla_tune
    call = flashqla_tune.load(pack).chunk_gated_delta_rule
    kw = {"layer": 0}
elif impl == "flashqla":
    import flash_qla
    call, kw = flash_qla.chunk_gated_delta_rule, {}
elif impl == "flashinfer":  # as vLLM calls it: packed [T, H, D], decay exp(g), int32 offsets
    from flashinfer.gdn_prefill import chunk_gated_delta_rule as flashinfer_gdn

    def call(q, k, v, g, beta, **options):
        cu = torch.tensor([0, q.shape[1]], dtype=torch.int32, device=q.device)
        o, state = flashinfer_gdn(q[0], k[0], v[0], g[0].exp(), beta[0], cu_seqlens=cu, backend="auto",
                                  use_cp="auto", **options)
        return o.unsqueeze(0), state
    kw = {}
else:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as call
    kw = {}
marks["import_impl"] = time.time()
gen = torch.Generator(device="cuda").manual_seed(0)
T, Hqk, Hv, D = 8192, 2, 8, 128
q, k, v = (torch.randn(1, T, h, D, device="cuda", generator=gen).bfloat16() for h in (Hqk, Hqk, Hv))
g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, device="cuda", generator=gen) + 4.0)
beta = torch.rand(1, T, Hv, device="cuda", generator=gen)
marks["inputs"] = time.time()
o, state = call(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True, **kw)
torch.cuda.synchronize()
marks["first_output"] = time.time()
if not bool(torch.isfinite(o.float()).all()):
    raise SystemExit("the first output is not finite")
print("COLD_START " + json.dumps(marks))
"""


def one_run(impl: str, pack: str, env: dict) -> dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, impl, pack], env=env, capture_output=True, text=True,
                          timeout=900)
    t_exit = time.time()
    line = next((l for l in proc.stdout.splitlines() if l.startswith("COLD_START ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{impl}: the child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    marks = json.loads(line[len("COLD_START "):])
    phases, last = {}, t0
    for name in ("start", "import_torch", "cuda_context", "import_impl", "inputs", "first_output"):
        phases[name if name != "start" else "interpreter"] = round(marks[name] - last, 3)
        last = marks[name]
    return {"to_first_output_s": round(marks["first_output"] - t0, 3), "to_exit_s": round(t_exit - t0, 3),
            "phases_s": phases}


def build_default_pack(folder: Path) -> Path:
    from flashqla_tune.calibrate.default_model import default_model_path
    from flashqla_tune.pack_build import build_pack

    out = folder / "default_pack"
    build_pack(default_model_path(), out, tune=False, progress=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--pack", type=Path, help="the pack to load (default: build an untuned one of the shipped model)")
    ap.add_argument("--impl", action="append", choices=("ours", "flashqla", "fla", "flashinfer"),
                    help="implementations to time, in this order (default: ours, flashqla, fla)")
    ap.add_argument("--runs", type=int, default=2, help="runs per implementation (report the last)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    impls = args.impl or ["ours", "flashqla", "fla"]
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    pack = args.pack
    if "ours" in impls and pack is None:
        t = time.time()
        pack = build_default_pack(work)
        print(f"built {pack} in {time.time() - t:.1f} s (not part of the cold start)", flush=True)
    report = {"pack": str(pack) if pack else None, "call": "Hqk=2 Hv=8 K=V=128 bf16, 1 x 8192 tokens",
              "python": sys.version.split()[0], "runs": {}}
    for impl in impls:
        env = dict(os.environ)
        cache = None
        if impl == "ours":
            cache = work / "empty-cache"
            cache.mkdir(exist_ok=True)
            env["FLASHQLA_TUNE_CACHE"] = str(cache)
        if impl == "fla":
            env["FLA_DISABLE_BACKEND_DISPATCH"] = "1"  # else FLA's first call would be FlashQLA's
        runs = []
        for i in range(args.runs):
            r = one_run(impl, str(pack), env)
            if cache is not None:
                r["cache_files_written"] = sum(1 for p in cache.rglob("*") if p.is_file())
            runs.append(r)
            print(f"{impl} run {i + 1}: first output {r['to_first_output_s']:.2f} s, exit {r['to_exit_s']:.2f} s, "
                  f"phases {r['phases_s']}" + (f", cache files {r['cache_files_written']}" if cache else ""),
                  flush=True)
        report["runs"][impl] = runs
        (args.out / "cold_start.json").write_text(json.dumps(report, indent=2) + "\n")  # kept if a later one hangs
    last = {impl: runs[-1]["to_first_output_s"] for impl, runs in report["runs"].items()}
    print("cold start, run %d, spawn to first output: " % args.runs +
          ", ".join(f"{impl} {s:.2f} s" for impl, s in last.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
