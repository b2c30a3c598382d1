"""Train the embedded default GDN model: a small Qwen3.5-layout LM (K = V = 128, 5 GDN layers of
8 v-heads and one gated-attention layer; ~3.2M parameters, ~6.3 MB in bf16) over a byte-level
tokenizer, on the Python standard library's own sources (no downloads).

Runs through transformers' PyTorch path (its torch chunked GDN fallback when FLA is absent),
on a GPU when there is one. Logs training and held-out loss (nats/byte) against the unigram
baseline, i.e. the entropy of the training bytes, which a model that ignores context reaches.
Writes the checkpoint, its tokenizer and the training log to DIR; the shipped model is
calibrate/data/default_model, its training log is in docs/results/.

    python tools/train_default_model.py --out DIR [--seconds 210] [--steps N]    (repository root)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from flashqla_tune.calibrate.byte_tokenizer import build_byte_tokenizer
from flashqla_tune.calibrate.corpus_sources import python_docs_text, python_source_texts

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2


def model_config(vocab_size: int, eos: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=320, num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=True,
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None, rms_norm_eps=1e-6,
    )


def token_stream(texts, tok) -> torch.Tensor:
    ids: list[int] = []
    for _, text in texts:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def unigram_entropy(stream: torch.Tensor, vocab: int) -> float:
    p = torch.bincount(stream, minlength=vocab).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


@torch.no_grad()
def evaluate(model, stream, seq_len, device, batches=8, batch_size=16) -> float:
    model.eval()
    n = (len(stream) - 1) // seq_len
    starts = torch.linspace(0, (n - 1) * seq_len, min(n, batches * batch_size)).long()
    losses = []
    for chunk in starts.split(batch_size):
        x = torch.stack([stream[s:s + seq_len] for s in chunk]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(float(model(input_ids=x, labels=x).loss))
    model.train()
    return sum(losses) / len(losses)


def save(model, tok, out: Path, log: dict) -> None:
    """bf16 weights (A_log and dt_bias kept in fp32), config, tokenizer, training log."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue   # tied to the embedding
        keep32 = name.endswith(("A_log", "dt_bias"))
        sd[name] = t.detach().to(torch.float32 if keep32 else torch.bfloat16).contiguous().cpu()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    tok.save_pretrained(out)
    (out / "training_log.json").write_text(json.dumps(log, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seconds", type=float, default=210.0, help="wall-clock training budget")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (CPU smoke test)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train-bytes", type=int, default=None, help="cap on training text (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = build_byte_tokenizer()
    train = token_stream(python_source_texts(args.train_bytes), tok)
    held_out = token_stream([("docs", python_docs_text())], tok)
    baseline = unigram_entropy(train, len(tok))
    model = Qwen3_5ForCausalLM(model_config(len(tok), tok.eos_token_id)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    no_decay = [p for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias")) or p.dim() < 2]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(("A_log", "dt_bias")) or p.dim() < 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    log = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "params": n_params, "train_tokens": int(len(train)), "held_out_tokens": int(len(held_out)),
           "unigram_baseline_nats": baseline, "seq_len": args.seq_len, "batch_size": args.batch_size,
           "lr": args.lr, "steps": []}
    print(f"params {n_params}, train tokens {len(train)}, unigram baseline {baseline:.4f} nats/byte", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    step, warmup = 0, 50
    while True:
        elapsed = time.perf_counter() - start
        frac = elapsed / args.seconds
        if frac >= 1.0 or (args.steps is not None and step >= args.steps):
            break
        # warm-up, then cosine decay over the time budget (the step count is not known ahead)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
        x = torch.stack([train[s:s + args.seq_len] for s in starts]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1 or (args.steps is not None and step == args.steps):
            entry = {"step": step, "seconds": round(time.perf_counter() - start, 1), "lr": lr, "loss": float(loss)}
            if step % 200 == 0 or step == 1:
                entry["held_out_loss"] = evaluate(model, held_out, args.seq_len, device)
            log["steps"].append(entry)
            print(json.dumps(entry), flush=True)
    log["final_train_loss"] = evaluate(model, train, args.seq_len, device)
    log["final_held_out_loss"] = evaluate(model, held_out, args.seq_len, device)
    log["total_steps"] = step
    log["train_seconds"] = round(time.perf_counter() - start, 1)
    log["tokens_seen"] = step * args.batch_size * args.seq_len
    print(f"done: {step} steps, train {log['final_train_loss']:.4f}, held-out {log['final_held_out_loss']:.4f} "
          f"nats/byte vs unigram {baseline:.4f}", flush=True)
    save(model, tok, args.out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
