"""Training through the op: the shipped model's architecture trained from one fixed-seed
initialisation on the shipped corpus, once with its GDN layers on flashqla_tune's op and once on
transformers' float32 PyTorch path, same data order; the loss curves must agree.

    python3 benchmarks/train_compare.py --out DIR [--steps 300] [--batch 32] [--seq-len 512]
                                        [--seed 0] [--lr 3e-3] [--no-control] [--checkpoint CKPT]
    python3 benchmarks/train_compare.py --plot DIR/train_compare.json [--out PNG_DIR]   (the PNG alone)

Runs, each from the same initial weights (the architecture of the checkpoint's config, initialised
by transformers under torch.manual_seed(--seed)) and the same batches (random windows of the
shipped corpus, drawn once from --seed):
- reference: float32 weights, no autocast, transformers' torch_chunk_gated_delta_rule;
- ours: float32 master weights under bf16 autocast, as a user trains with AMP (the shipped model
  was trained so): the GDN layer's q, k, v and beta reach the op in bf16, g in float32, which are
  the op's dtypes; each GDN layer's chunked call goes to flashqla_tune.ops.chunk_gated_delta_rule
  (default plan, its registered backward) through integrations.transformers.use_pack;
- bf16_torch (unless --no-control): the same bf16 autocast on transformers' PyTorch path, so the
  part of the gap that bf16 itself makes is measured beside ours (reported, not a bar).
FLA is kept out of the process, so transformers' own function is its PyTorch code.

Optimiser as tools/train_default_model.py: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices),
linear warm-up over the first tenth of the steps, then cosine to a tenth of --lr; gradients
clipped to norm 1. The loss of every step is logged. Bar: the 20-step trailing moving averages of
ours and the reference differ by at most 0.02 nats at every step with a full window. Reported per
run: tokens per second (steps after the first few, each step synchronised), peak GPU memory.

Writes DIR/train_compare.json, DIR/train_compare.log and DIR/train_compare.png (when matplotlib
imports; else --plot makes it later from the JSON). Exit 0 when the bar holds, 1 when it does not,
2 when the comparison could not be reached: without an sm_90 GPU the reference still trains (on
the CPU, which is how the script is smoke-tested) and the op's run is reported as not run.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformers_route import Log, block_fla, commit  # noqa: E402  (benchmarks/ is not a package)

RESULT = "train_compare.json"
LOG = "train_compare.log"
PLOT = "train_compare.png"
WINDOW = 20
MAX_GAP = 0.02
TIMING_SKIP = 5   # steps left out of tokens/s (the first builds kernels and fills caches)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for train_compare.json, .log and .png (with --plot: for the .png)")
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of an existing train_compare.json "
                                                  "(into --out, else beside the JSON)")
    p.add_argument("--checkpoint", help="checkpoint whose config gives the architecture (default: the shipped model)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps per run (default 300)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and of the data order")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--window", type=int, default=WINDOW, help=f"moving-average window in steps (default {WINDOW})")
    p.add_argument("--max-gap", type=float, default=MAX_GAP,
                   help=f"bar on the moving averages' gap (default {MAX_GAP})")
    p.add_argument("--no-control", action="store_true", help="skip the bf16 autocast run on the PyTorch path")
    args = p.parse_args(argv)
    if args.plot is None and args.out is None:
        p.error("--out is required (or --plot JSON)")
    if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.window < 1:
        p.error("--steps, --batch and --window must be positive and --seq-len at least 2")
    return args


# --- the comparison (pure functions, CPU-tested) ------------------------------------------------
def moving_average(losses, window: int) -> list:
    """Trailing mean of the last `window` losses at each step; None before the first full window."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        out.append(total / window if i >= window - 1 else None)
    return out


def moving_average_gap(ours, reference, window: int) -> dict:
    """|MA(ours) - MA(reference)| at every step with a full window (steps numbered from 1); the
    largest and where. Non-finite losses make the gap infinite there."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} losses against {len(reference)}: the runs must have the same steps")
    a, b = moving_average(ours, window), moving_average(reference, window)
    gaps = []
    for step, (x, y) in enumerate(zip(a, b), start=1):
        if x is None:
            continue
        gap = abs(x - y)
        gaps.append([step, gap if math.isfinite(gap) else math.inf])
    worst = max(gaps, key=lambda sg: sg[1]) if gaps else None
    return {"window": window, "steps_compared": len(gaps), "max_gap": worst[1] if worst else None,
            "max_gap_step": worst[0] if worst else None, "gaps": gaps}


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine from peak to peak/10."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batch_starts(tokens: int, steps: int, batch: int, seq_len: int, seed: int):
    """[steps, batch] window starts into a stream of `tokens` ids, drawn once: every run reads the same."""
    import torch

    if tokens < seq_len + 1:
        raise SystemExit(f"the corpus gives {tokens} tokens, fewer than one window of {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, tokens - seq_len, (steps, batch), generator=gen)


# --- the model, the data, the op's route ----------------------------------------------------------
def token_stream(checkpoint: Path):
    """The shipped corpus by the checkpoint's tokenizer, as one int64 stream."""
    import torch
    from transformers import AutoTokenizer

    from flashqla_tune.calibrate.corpus import default_corpus_path

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    ids = tokenizer(default_corpus_path().read_text(), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64), str(default_corpus_path())


def initial_weights(config, seed: int) -> dict:
    """The architecture's float32 weights as transformers initialises them under manual_seed(seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)   # not the checkpoint's bf16
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def fresh_model(config, weights: dict, device):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(weights)
    return model.to(device).train()


class OpAsPack:
    """flashqla_tune.ops.chunk_gated_delta_rule (default plan) behind what use_pack reads of a
    pack: a manifest naming the checkpoint, per-GDN-layer calibration entries (decoder index ->
    GDN index, from the config's layer types) and chunk_gated_delta_rule(..., layer=i). Every
    layer gets the op's own defaults; `dtypes` records what reached the op."""

    class _Manifest:
        def __init__(self, checkpoint: Path, sha: str):
            self.checkpoint_path, self.checkpoint_sha256, self.target = str(checkpoint), sha, "op (no pack)"

    class _Layer:
        def __init__(self, decoder_layer: int, layer: int):
            self.decoder_layer, self.layer = decoder_layer, layer

    class _Calibration:
        def __init__(self, layers):
            self.layers = layers

    def __init__(self, checkpoint: Path, layer_types):
        from flashqla_tune.content_hash import checkpoint_hash

        self.pack = "flashqla_tune.ops"
        self.manifest = self._Manifest(checkpoint, checkpoint_hash(checkpoint))
        gdn = [d for d, kind in enumerate(layer_types) if kind == "linear_attention"]
        self.calibration = self._Calibration([self._Layer(d, i) for i, d in enumerate(gdn)])
        self.dtypes: dict[str, str] = {}

    def chunk_gated_delta_rule(self, *, layer: int, **kwargs):
        from flashqla_tune.ops import chunk_gated_delta_rule

        if not self.dtypes:
            self.dtypes = {name: str(kwargs[name].dtype).replace("torch.", "") for name in ("q", "k", "v", "g", "beta")}
        return chunk_gated_delta_rule(**kwargs)

    def __repr__(self) -> str:
        return "OpAsPack(flashqla_tune.ops.chunk_gated_delta_rule)"


def where_to_run():
    """(the device every run trains on, why the op's run cannot start there or None)."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu"), "the op's run needs an sm_90 GPU (no CUDA GPU)"
    if torch.cuda.get_device_capability() != (9, 0):
        return torch.device("cuda"), f"the op's run needs an sm_90 GPU ({torch.cuda.get_device_name()})"
    return torch.device("cuda"), None


def train(name: str, config, weights, stream, starts, args, device, bf16_autocast: bool, log, route_op=None) -> dict:
    """One run; returns its losses, timing and memory (route_op: an OpAsPack to route the GDN layers)."""
    import contextlib

    import torch

    from flashqla_tune.integrations.transformers import use_pack

    model = fresh_model(config, weights, device)
    no_decay = [p for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias")) or p.dim() < 2]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(("A_log", "dt_bias")) or p.dim() < 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    route = (use_pack(model, route_op, checkpoint=route_op.manifest.checkpoint_path) if route_op
             else contextlib.nullcontext())
    losses, seconds = [], []
    L = args.seq_len
    with route:
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            x = torch.stack([stream[s:s + L] for s in starts[step].tolist()]).to(device)
            sync()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sync()
            seconds.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            log(f"{name}: step {step + 1}/{args.steps} loss {losses[-1]:.4f} ({seconds[-1] * 1e3:.0f} ms)")
        calls = dict(route.calls) if route_op else None
    skip = TIMING_SKIP if args.steps > TIMING_SKIP else 0
    timed = seconds[skip:]
    run = {"losses": losses, "step_seconds": seconds, "timed_steps": len(timed), "seconds": sum(seconds),
           "tokens_per_s": args.batch * L * len(timed) / sum(timed),
           "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "precision": "bf16 autocast, float32 master weights" if bf16_autocast else "float32, no autocast",
           "gdn": ("flashqla_tune.ops.chunk_gated_delta_rule" if route_op
                   else "transformers torch_chunk_gated_delta_rule")}
    if route_op:
        run["calls_per_gdn_layer"] = {str(k): v for k, v in calls.items()}
        run["op_input_dtypes"] = route_op.dtypes
    log(f"{name}: {run['tokens_per_s']:.0f} tokens/s over {len(timed)} steps"
        + (f", peak {run['peak_gpu_memory_bytes'] / 2**20:.1f} MiB" if cuda else ""))
    del model, opt
    return run


def plot(result: dict, path: Path) -> str | None:
    """Both loss curves and their moving averages; returns why not when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not importable ({exc}): run --plot {path.with_name(RESULT)} where it is"
    try:
        draw(result, path, plt)
    except Exception as exc:  # the numbers are in the JSON whatever the plot does
        return f"plot failed: {type(exc).__name__}: {exc}"
    return None


def draw(result: dict, path: Path, plt) -> None:
    window = result["comparison"]["window"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    colours = {"reference": "black", "ours": "tab:red", "bf16_torch": "tab:blue"}
    for name, run in result["runs"].items():
        if "losses" not in run:
            continue
        steps = range(1, len(run["losses"]) + 1)
        top.plot(steps, run["losses"], color=colours.get(name), alpha=0.25, linewidth=0.8)
        ma = moving_average(run["losses"], window)
        top.plot(steps, [m if m is not None else float("nan") for m in ma], color=colours.get(name),
                 label=f"{name}: {run['precision']}, {run['gdn']}")
    for key, colour in (("ours_vs_reference", "tab:red"), ("bf16_torch_vs_reference", "tab:blue")):
        gap = result["comparison"].get(key)
        if gap and gap["gaps"]:
            bottom.plot([s for s, _ in gap["gaps"]], [g for _, g in gap["gaps"]], color=colour, label=key)
    bottom.axhline(result["comparison"]["max_gap_bar"], color="grey", linestyle="--", label="bar")
    top.set_ylabel("loss (nats/token)")
    top.legend(fontsize=7)
    top.set_title(f"{result.get('gpu', {}).get('name', 'no GPU')}: {result['args']['batch']} x "
                  f"{result['args']['seq_len']} tokens per step, seed {result['args']['seed']}")
    bottom.set_ylabel(f"|gap| of {window}-step MA")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plot:
        source = Path(args.plot)
        target = Path(args.out) / PLOT if args.out else source.with_name(PLOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        why = plot(json.loads(source.read_text()), target)
        print(why or f"wrote {target}")
        return 1 if why else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / LOG)
    result = {"script": "benchmarks/train_compare.py", "args": vars(args), "commit": commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
              "bar": {"window": args.window, "max_gap": args.max_gap}, "runs": {},
              "comparison": {"window": args.window, "max_gap_bar": args.max_gap}}

    def finish(status: str, code: int) -> int:
        result["status"] = status
        (out / RESULT).write_text(json.dumps(result, indent=1) + "\n")
        if any("losses" in r for r in result["runs"].values()):
            why = plot(result, out / PLOT)
            result["plot"] = why or str(out / PLOT)
            (out / RESULT).write_text(json.dumps(result, indent=1) + "\n")
            log(why or f"plot -> {out / PLOT}")
        log(f"{status} -> {out / RESULT}")
        return code

    block_fla()
    import torch
    import transformers
    from transformers import AutoConfig

    import flashqla_tune
    from flashqla_tune.calibrate.default_model import default_model_path

    checkpoint = Path(args.checkpoint) if args.checkpoint else default_model_path()
    config = AutoConfig.from_pretrained(str(checkpoint))
    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                          "flashqla_tune": flashqla_tune.__version__, "fla": "kept out of the process"}
    result["checkpoint"] = str(checkpoint)
    result["model"] = {"model_type": config.model_type, "layer_types": list(config.layer_types),
                       "hidden_size": config.hidden_size, "linear_num_key_heads": config.linear_num_key_heads,
                       "linear_num_value_heads": config.linear_num_value_heads}
    stream, corpus = token_stream(checkpoint)
    starts = batch_starts(len(stream), args.steps, args.batch, args.seq_len, args.seed)
    weights = initial_weights(config, args.seed)
    result["model"]["parameters"] = sum(t.numel() for n, t in weights.items() if n != "lm_head.weight")
    result["data"] = {"corpus": corpus, "corpus_tokens": len(stream),
                      "tokens_per_step": args.batch * args.seq_len,
                      "order": f"windows drawn once from seed {args.seed}"}
    log(f"{checkpoint} ({config.model_type}, {result['model']['parameters']} parameters), torch {torch.__version__}, "
        f"transformers {transformers.__version__}; fla blocked; corpus {len(stream)} tokens")

    device, op_problem = where_to_run()
    if torch.cuda.is_available():
        result["gpu"] = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
        try:
            result["gpu"]["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                                      "--format=csv,noheader"], capture_output=True,
                                                     text=True).stdout.strip()
        except OSError:
            pass
    result["matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32

    result["runs"]["reference"] = train("reference", config, weights, stream, starts, args, device, False, log)
    if op_problem:
        result["runs"]["ours"] = {"status": "not run"}
        return finish(f"not run: {op_problem}; the reference ran on {device.type}", 2)

    try:
        result["runs"]["ours"] = train("ours", config, weights, stream, starts, args, device, True, log,
                                       route_op=OpAsPack(checkpoint, config.layer_types))
    except Exception as exc:  # the reference's numbers are kept, with what stopped our run
        import traceback

        log(traceback.format_exc())
        result["runs"]["ours"] = {"status": f"raised {type(exc).__name__}: {str(exc)[:500]}"}
        return finish(f"fail: the op's run raised {type(exc).__name__}: {str(exc)[:300]}", 1)
    if not args.no_control:
        result["runs"]["bf16_torch"] = train("bf16_torch", config, weights, stream, starts, args, device, True, log)

    ref = result["runs"]["reference"]["losses"]
    result["comparison"]["ours_vs_reference"] = moving_average_gap(result["runs"]["ours"]["losses"], ref, args.window)
    if "bf16_torch" in result["runs"]:
        result["comparison"]["bf16_torch_vs_reference"] = moving_average_gap(
            result["runs"]["bf16_torch"]["losses"], ref, args.window)
    # ours runs under bf16 autocast: against the float32 reference the ratio includes autocast's
    # gain; against the bf16 PyTorch control it is the op's alone
    result["comparison"]["tokens_per_s_ours_bf16_over_reference_fp32"] = (
        result["runs"]["ours"]["tokens_per_s"] / result["runs"]["reference"]["tokens_per_s"])
    if "bf16_torch" in result["runs"]:
        result["comparison"]["tokens_per_s_ours_over_bf16_torch"] = (
            result["runs"]["ours"]["tokens_per_s"] / result["runs"]["bf16_torch"]["tokens_per_s"])
    for key in ("ours_vs_reference", "bf16_torch_vs_reference"):
        if key in result["comparison"]:
            c = result["comparison"][key]
            log(f"{key}: max |MA gap| {c['max_gap']} at step {c['max_gap_step']} over {c['steps_compared']} steps")

    failures = []
    gap = result["comparison"]["ours_vs_reference"]
    if gap["max_gap"] is None:
        failures.append(f"no step has a full {args.window}-step window ({args.steps} steps)")
    elif not gap["max_gap"] <= args.max_gap:
        failures.append(f"moving-average gap {gap['max_gap']:.4f} > {args.max_gap} at step {gap['max_gap_step']}")
    calls = result["runs"]["ours"]["calls_per_gdn_layer"]
    if set(calls.values()) != {args.steps}:
        failures.append(f"not every GDN layer reached the op once per step: {calls}")
    if any(name == "fla" or name.startswith("fla.") for name, m in sys.modules.items() if m is not None):
        failures.append("fla was imported")
    result["failures"] = failures
    return finish("pass" if not failures else "fail: " + "; ".join(failures), 0 if not failures else 1)


if __name__ == "__main__":
    sys.exit(main())
