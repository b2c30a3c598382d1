"""The shipped model's prefill by transformers' own code with its GDN layers on a kernel pack
(flashqla_tune.integrations.transformers.use_pack), FLA absent, against the same model's float32
PyTorch path.

FLA is kept out of this process (`import fla` fails here whatever is installed), so the reference
runs transformers' PyTorch GDN path and the route is the only way onto the kernels. Bars: logits
relative L2 below 1e-2, and top-1 agreement at least 99% over the positions where the reference's
top-1 logit leads its second by more than 0.1 (the fraction of positions counted is reported). The
model's bf16 PyTorch path is measured the same way beside it, as the floor bf16 weights set.

    python3 benchmarks/transformers_route.py --out DIR [--pack PACK] [--checkpoint CKPT]
                                             [--batch 2] [--seq-len 4096]

Without --pack, the pack is built here first (`flashqla-tune build --no-tune` into a temporary
folder; nvcc, no tuning). Writes DIR/transformers_route.json and DIR/transformers_route.log; exit 0
when the bars hold, 1 when they do not, 2 when the run could not reach the comparison (no sm_90
GPU: everything before the first CUDA step still runs, which is how it is smoke-tested on a CPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_REL_L2 = 1e-2
MIN_TOP1 = 0.99
MIN_MARGIN = 0.1
RESULT = "transformers_route.json"
LOG = "transformers_route.log"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for transformers_route.json and .log")
    p.add_argument("--pack", help="a pack of the checkpoint (default: build one with --no-tune in a temp folder)")
    p.add_argument("--checkpoint", help="checkpoint folder (default: the shipped model)")
    p.add_argument("--batch", type=int, default=2, help="sequences per prefill (default 2)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.seq_len < 1:
        p.error("--batch and --seq-len must be positive")
    return args


class Log:
    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def block_fla() -> None:
    """`import fla` fails in this process from here on (transformers then takes its PyTorch path)."""
    for name in list(sys.modules):
        if name == "fla" or name.startswith("fla."):
            raise SystemExit("fla was imported before this script could keep it out")
    sys.modules["fla"] = None


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def prompt_ids(checkpoint: Path, batch: int, seq_len: int):
    """batch x seq_len tokens of the shipped corpus, by the checkpoint's own tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from flashqla_tune.calibrate.corpus import default_corpus_path

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    need = batch * seq_len
    text = default_corpus_path().read_text()
    ids = tokenizer(text[: 8 * need])["input_ids"][:need]
    if len(ids) < need:
        raise SystemExit(f"the shipped corpus gives {len(ids)} tokens, fewer than {batch} x {seq_len}")
    return torch.tensor(ids).view(batch, seq_len)


def build_pack(checkpoint: Path, folder: Path, log) -> Path:
    out = folder / "pack"
    cli = shutil.which("flashqla-tune")
    cmd = ([cli] if cli else [sys.executable, "-c", "import sys; from flashqla_tune.cli import main; "
                                                    "sys.exit(main(sys.argv[1:]))"])
    cmd += ["build", str(checkpoint), "--out", str(out), "--no-tune", "--no-progress"]
    log(f"building the pack: {' '.join(cmd)}")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in (done.stdout + done.stderr).splitlines():
        log(f"  build: {line}")
    if done.returncode:
        raise SystemExit(f"flashqla-tune build failed (exit {done.returncode})")
    log(f"pack built in {time.perf_counter() - t0:.1f} s")
    return out


def agreement(logits, reference) -> dict:
    """Relative L2, and top-1 agreement over the positions whose reference margin exceeds MIN_MARGIN."""
    diff = (logits.double() - reference.double()).norm() / reference.double().norm()
    top2 = reference.topk(2, dim=-1).values
    counted = (top2[..., 0] - top2[..., 1]) > MIN_MARGIN
    same = logits.argmax(-1) == reference.argmax(-1)
    return {"rel_l2": diff.item(), "top1_agreement": same[counted].float().mean().item() if counted.any() else None,
            "counted_fraction": counted.float().mean().item(), "counted_positions": int(counted.sum()),
            "top1_agreement_all_positions": same.float().mean().item(), "positions": same.numel()}


def timed_forward(model, ids, repeats: int = 3):
    """(logits fp32, median seconds of `repeats` forwards after one warm-up)."""
    import torch

    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return logits, sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / LOG)
    result = {"script": "benchmarks/transformers_route.py", "args": vars(args), "commit": commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
              "bars": {"max_rel_l2": MAX_REL_L2, "min_top1": MIN_TOP1, "min_margin": MIN_MARGIN}}

    def finish(status: str, code: int) -> int:
        result["status"] = status
        (out / RESULT).write_text(json.dumps(result, indent=1) + "\n")
        log(f"{status} -> {out / RESULT}")
        return code

    block_fla()
    import torch
    import transformers

    import flashqla_tune
    from flashqla_tune.calibrate.default_model import default_model_path
    from flashqla_tune.content_hash import checkpoint_hash
    from flashqla_tune.integrations.transformers import use_pack
    from flashqla_tune.pack import read_manifest

    checkpoint = Path(args.checkpoint) if args.checkpoint else default_model_path()
    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                          "flashqla_tune": flashqla_tune.__version__, "fla": "kept out of the process"}
    result["checkpoint"] = str(checkpoint)
    log(f"checkpoint {checkpoint}; torch {torch.__version__}, transformers {transformers.__version__}; fla blocked")
    ids = prompt_ids(checkpoint, args.batch, args.seq_len)
    log(f"prompt: {args.batch} x {args.seq_len} tokens of the shipped corpus")
    if args.pack:
        manifest = read_manifest(args.pack)
        result["pack"] = {"path": args.pack, "target": manifest.target, "checkpoint_sha256": manifest.checkpoint_sha256}
        if checkpoint_hash(checkpoint) != manifest.checkpoint_sha256:
            return finish(f"not run: pack {args.pack} was built for checkpoint {manifest.checkpoint_path}, "
                          f"not {checkpoint}", 2)
        log(f"pack {args.pack} ({manifest.target}), built for this checkpoint")

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
        return finish(f"not run: the pack's kernels need an sm_90 GPU ({where})", 2)
    result["gpu"] = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    try:
        result["gpu"]["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                 capture_output=True, text=True).stdout.strip()
    except OSError:
        pass

    with tempfile.TemporaryDirectory(prefix="fqt-route-") as tmp:
        pack = Path(args.pack) if args.pack else build_pack(checkpoint, Path(tmp), log)
        ops = flashqla_tune.load(pack)
        result.setdefault("pack", {"path": "built here (--no-tune)", "target": ops.manifest.target,
                                   "checkpoint_sha256": ops.manifest.checkpoint_sha256})
        ids = ids.cuda()
        from transformers import AutoModelForCausalLM

        reference_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).cuda().eval()
        reference, seconds = timed_forward(reference_model, ids)
        result["seconds"] = {"float32_torch_path": seconds}
        log(f"float32 PyTorch path: {seconds * 1e3:.1f} ms per prefill")
        del reference_model
        torch.cuda.empty_cache()

        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).cuda().eval()
        bf16_torch, seconds = timed_forward(model, ids)
        result["seconds"]["bf16_torch_path"] = seconds
        result["bf16_torch_path"] = agreement(bf16_torch, reference)
        log(f"bf16 PyTorch path: {seconds * 1e3:.1f} ms; against float32: {result['bf16_torch_path']}")

        with use_pack(model, ops, checkpoint=checkpoint) as route:
            routed, seconds = timed_forward(model, ids)
            calls = dict(route.calls)
            layers = dict(route.layers)
        result["seconds"]["bf16_pack_route"] = seconds
        result["pack_route"] = agreement(routed, reference)
        result["route"] = {"decoder_to_gdn_layer": {str(d): g for d, g in layers.items()},
                           "calls_per_gdn_layer": {str(g): n for g, n in calls.items()}, "forwards": 4}
        log(f"bf16 pack route: {seconds * 1e3:.1f} ms; against float32: {result['pack_route']}")
        log(f"route: decoder -> GDN layer {layers}; calls per GDN layer {calls} (4 forwards)")

    fla_loaded = any(name == "fla" or name.startswith("fla.") for name, m in sys.modules.items() if m is not None)
    r = result["pack_route"]
    failures = []
    if not r["rel_l2"] < MAX_REL_L2:
        failures.append(f"rel L2 {r['rel_l2']:.3e} >= {MAX_REL_L2}")
    if r["top1_agreement"] is None or not r["top1_agreement"] >= MIN_TOP1:
        failures.append(f"top-1 agreement {r['top1_agreement']} < {MIN_TOP1}")
    if set(calls.values()) != {4}:
        failures.append(f"not every GDN layer reached the pack once per forward: {calls}")
    if fla_loaded:
        failures.append("fla was imported")
    result["failures"] = failures
    return finish("pass" if not failures else "fail: " + "; ".join(failures), 0 if not failures else 1)


if __name__ == "__main__":
    sys.exit(main())
