"""The backward's per-chunk gradient kernel as each library variant builds it (ChunkSpec.warp_groups:
one warp group per CTA, or two splitting every GEMM's output columns; ChunkSpec.walk: CTAs that walk
the tiles), timed on the same inputs.

    python3 -P benchmarks/backward_chunk_variants.py OUT_DIR [--heads 16/32 --heads 2/8] [--tokens 32768]
                                                     (repository root; h200_steps.sh backward-variants)

Per head configuration: the kernel's inputs for one sequence of --tokens tokens in its chunk layout
([chunks, H, 64, D], what chunked_torch hands it for a call in --input-dtype: q, k, v and dO as views
of token rows in that dtype, q and k per q/k head, unit rows; v and dO normal; beta in [0, 1); the
in-chunk cumulative gate of g in [-0.05, 0); A0 unit lower triangular;
the chains' states, state gradients, Vn and dVn normal, units 1). The kernel has no data-dependent
branch, so its time does not depend on the values. Per variant: the median CUDA-graph replay and
the median eager call (measure.timing.CudaTimer), the bytes a launch asks for (every input tile
each CTA reads, every output it writes) and the rate that is over the replay time. The variants
round the same operands to fp16 and differ only in the order of some fp32 sums, so their outputs
agree to fp32 rounding: the largest relative L2 between them is reported, and above 1e-4 the run
fails (their accuracy against float64 is tests/test_gpu_backward_chunk.py's).

Writes OUT_DIR/backward_chunk_variants.json and prints one line per (heads, variant). Exit 0 when
every variant ran and agreed, 1 when not, 2 without an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

AGREE = 1e-4
DEFAULT_HEADS = ("16/32", "2/8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="folder for backward_chunk_variants.json")
    p.add_argument("--heads", action="append", help=f"h_qk/h_v (repeatable; default {' '.join(DEFAULT_HEADS)})")
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the one sequence (a multiple of 64)")
    p.add_argument("--budget-s", type=float, default=1.0, help="timing budget per variant and measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="the call's dtype: q, k, v and dO read in place in it (default bfloat16)")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.tokens % 64:
        p.error(f"--tokens {args.tokens} must be a positive multiple of 64")
    heads = []
    for text in args.heads or DEFAULT_HEADS:
        try:
            hqk, hv = (int(x) for x in text.split("/"))
        except ValueError:
            p.error(f"--heads {text!r} is not h_qk/h_v")
        if hqk <= 0 or hv <= 0 or hv % hqk:
            p.error(f"--heads {text}: the v-heads must be a positive multiple of the q/k heads")
        heads.append((hqk, hv))
    args.heads = heads
    return args


def kernel_inputs(hqk: int, hv: int, tokens: int, seed: int, K: int = 128, V: int = 128,
                  dtype: torch.dtype = torch.bfloat16):
    """The kernel's 13 inputs (chunk_kernels.chunk_gradients' order) on the GPU: q, k, v and dO in
    `dtype` as the chunk views of token rows ([chunks, 64, H, D] in memory), the rest contiguous."""
    from flashqla_tune.backward import chunk_kernels

    gen = torch.Generator(device="cuda").manual_seed(seed)
    NC, C = tokens // 64, 64

    def normal(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=gen, device="cuda")

    def token_rows(x):   # [NC, H, C, D] -> the same values as a view of token rows in `dtype`
        return x.transpose(1, 2).contiguous().to(dtype).transpose(1, 2)

    q = token_rows(F.normalize(normal(NC, hqk, C, K), dim=-1))
    k = token_rows(F.normalize(normal(NC, hqk, C, K), dim=-1))
    beta = torch.rand(NC, hv, C, generator=gen, device="cuda")
    gamma = (-0.05 * torch.rand(NC, hv, C, generator=gen, device="cuda")).cumsum(-1)
    a0 = torch.eye(C, device="cuda") + normal(NC, hv, C, C, scale=0.1).tril(-1)
    units = torch.ones(NC, hv, device="cuda")
    op = chunk_kernels.spec_for(K, V).torch_dtype   # the chains' results, as they store them
    return (q, k, token_rows(normal(NC, hv, C, V)), token_rows(normal(NC, hv, C, V, scale=K ** -0.5)), beta, gamma, a0,
            *(normal(*shape).to(op) for shape in ((NC, hv, K, V), (NC, hv, K, V), (NC, hv, C, V), (NC, hv, C, V))),
            units, units)


def launch_bytes(inputs, outputs, hv: int) -> int:
    """What one launch asks memory for: each tile (chunk, v-head) reads its q/k head's q and k tiles
    and every per-v-head input once and writes its outputs, dq and dk into its q/k head's (so they
    are written once per v-head; the re-reads of their running sums are not counted)."""
    q, k, *per_head = inputs
    group = hv // q.shape[1]
    dq, dk, *rest = outputs
    return (group * (q.nbytes + k.nbytes) + sum(t.nbytes for t in per_head)
            + group * (dq.nbytes + dk.nbytes) + sum(t.nbytes for t in rest))


def run(args) -> tuple[dict, bool]:
    from flashqla_tune.backward import chunk_kernels
    from flashqla_tune.measure.environment import describe
    from flashqla_tune.measure.timing import CudaTimer

    variants = chunk_kernels.variants_for(128, 128)
    default = next(name for name, spec in variants.items() if spec == chunk_kernels.spec_for(128, 128))
    timer = CudaTimer(budget_s=args.budget_s, min_samples=10, max_samples=100)
    rows, ok = [], True
    for hqk, hv in args.heads:
        inputs = kernel_inputs(hqk, hv, args.tokens, args.seed, dtype=getattr(torch, args.input_dtype))
        outs, row = {}, {"heads": f"{hqk}/{hv}", "tokens": args.tokens, "input_dtype": args.input_dtype,
                         "ctas": inputs[0].shape[0] * hqk,
                         "variants": {}}
        for name, spec in variants.items():
            lib = chunk_kernels.LIBRARIES.get(spec)
            NC = inputs[0].shape[0]
            out = tuple(torch.full(shape, float("nan"), device="cuda")   # NaN: an element left unwritten shows
                        for shape in [(NC, hqk, 64, 128)] * 2 + [(NC, hv, 64, 128)] + [(NC, hv, 64)] * 2)

            def call(x, spec=spec, out=out):
                return chunk_kernels.chunk_gradients(*x, out=out, spec=spec)

            timer.warmup(call, [inputs], rounds=1)
            outs[name] = [t.clone() for t in out]
            graph, eager = timer.graph(call, [inputs]), timer.eager(call, [inputs])
            nbytes = launch_bytes(inputs, out, hv)
            entry = {"graph": graph.to_dict(), "eager": eager.to_dict(), "launch_bytes": nbytes,
                     "library": lib.path.name}
            if graph.median_ms:
                entry["tb_per_s"] = nbytes / graph.median_ms / 1e9
                entry["us_per_cta_per_sm"] = graph.median_ms * 1e3 / (row["ctas"] / torch.cuda.get_device_properties(
                    0).multi_processor_count)
            ok &= graph.median_ms is not None and eager.median_ms is not None
            row["variants"][name] = entry
            print(f"{hqk}/{hv} {args.tokens} tokens {name}: graph {graph.median_ms} ms, eager {eager.median_ms} ms, "
                  f"{nbytes / 2**30:.2f} GiB a launch, {entry.get('tb_per_s', float('nan')):.2f} TB/s", flush=True)
        names = ("dq", "dk", "dv", "dbeta", "dg")
        first, *others = outs
        agreement = {}
        for other in others:
            for what, a, b in zip(names, outs[first], outs[other]):
                finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
                err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)) if finite else None
                agreement[f"{first}-{other} {what}"] = err
                ok &= err is not None and err <= AGREE
        row["agreement_rel_l2"] = agreement
        worst = max((e for e in agreement.values() if e is not None), default=None)
        print(f"{hqk}/{hv}: variants agree within {worst} (relative L2; bar {AGREE})", flush=True)
        base = row["variants"][default]["graph"]["median_ms"]
        for name, entry in row["variants"].items():
            t = entry["graph"]["median_ms"]
            entry["speedup_vs_default"] = base / t if base and t else None
        rows.append(row)
        del inputs, outs
        torch.cuda.empty_cache()
    return {"what": __doc__.split("\n\n")[0], "default_variant": default, "agree_bar": AGREE,
            "environment": describe(), "rows": rows}, ok


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    result, ok = run(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backward_chunk_variants.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
