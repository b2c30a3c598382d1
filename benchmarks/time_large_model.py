"""Time the calibration pass on a 0.8B-class model: random weights in the Qwen3.5-0.8B shape
(tests/fixtures/configs/qwen3.5-0.8b), 64 x 4096 tokens, on the GPU; then the same with the
layer count doubled, to show peak memory stays bounded (one layer resident at a time). Writes the
pass's seconds and peak GPU memory per model to OUT.json (the published copy:
docs/results/calibration-timing-h200.json).

    python benchmarks/time_large_model.py OUT.json
    python benchmarks/time_large_model.py OUT.json --smoke   # tiny, on the CPU: checks the script
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from flashqla_tune.calibrate.byte_tokenizer import build_byte_tokenizer
from flashqla_tune.calibrate.corpus_sources import python_source_texts
from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/configs/qwen3.5-0.8b/config.json"


def make_checkpoint(path: Path, layer_repeat: int, device: str, hidden: int | None = None) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = json.loads(FIXTURE.read_text())["text_config"]
    types = text["layer_types"] * layer_repeat
    cfg = Qwen3_5TextConfig(
        vocab_size=text["vocab_size"], hidden_size=hidden or text["hidden_size"],
        intermediate_size=3584 if hidden is None else 2 * hidden,
        num_hidden_layers=len(types), layer_types=types, num_attention_heads=8, num_key_value_heads=2,
        head_dim=text["head_dim"], linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"], linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=8192, eos_token_id=256)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"layers": len(types), "gdn_layers": types.count("linear_attention"), "params": params}


def main(out: str, smoke: bool = False) -> int:
    # --smoke: 64-wide layers, 2 sequences of 256 tokens on the CPU, so the script itself can be
    # checked on a machine without a GPU before the device time is spent.
    device, hidden = ("cpu", 64) if smoke else ("cuda", None)
    seq_len, sequences = (256, 2) if smoke else (4096, 64)
    tmp = Path(tempfile.mkdtemp())
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(t for _, t in python_source_texts(600_000)))
    results = []
    for repeat in (1, 2):
        entry = {"layer_repeat": repeat}
        try:
            ckpt = tmp / f"q08_x{repeat}"
            entry.update(make_checkpoint(ckpt, repeat, device, hidden))
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            res = calibrate_checkpoint(ckpt, corpus, out_dir=tmp / f"out{repeat}", seq_len=seq_len, max_sequences=sequences,
                                       batch_size=8, progress=False)
            entry["wall_seconds_incl_hash_and_tokenize"] = round(time.perf_counter() - t0, 2)
            entry.update(res.calibration.run)
            entry["tokens"] = res.calibration.corpus["num_tokens"]
            if entry.get("peak_gpu_memory_bytes") is not None:
                entry["peak_gpu_memory_gib"] = round(entry["peak_gpu_memory_bytes"] / 2**30, 3)
            entry["summary"] = res.calibration.summary_lines()[:3]
        except Exception:  # keep going: the other size may still be measured
            entry["error"] = traceback.format_exc()
        print(json.dumps(entry, indent=1), flush=True)
        results.append(entry)
        Path(out).write_text(json.dumps(results, indent=1))
        for f in (tmp / f"q08_x{repeat}").glob("*.safetensors"):
            f.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], smoke="--smoke" in sys.argv[2:]))
