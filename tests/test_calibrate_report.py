"""The calibration report stays within its size bounds for models from 4 x 8 to 64 x 128
(layers x v-heads), and keeps every layer and head in its markdown."""
import io
import math
import struct

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from flashqla_tune.calibrate.report import figure_png, markdown
from flashqla_tune.calibration_artifact import EXACT, QUANTILE_LEVELS, WARMUP, Calibration, HeadStats, LayerStats
from flashqla_tune.calibration_settings import CalibrationSettings

MAX_FIGURE_PX = (2400, 1600)
MAX_LINE_CHARS = 200


def synthetic_calibration(num_layers: int, num_heads: int, seed: int = 0) -> Calibration:
    """A calibration with varied decays, a few exact (zero-decay) heads, and a gap in decoder layers."""
    settings = CalibrationSettings()
    rng = np.random.default_rng(seed)
    levels = np.array(QUANTILE_LEVELS)
    layers = []
    for li in range(num_layers):
        heads = []
        for h in range(num_heads):
            if (li * num_heads + h) % 23 == 7:
                heads.append(HeadStats(head=h, n_h=None, cls=EXACT, chunk_log_decay_quantiles=(0.0,) * len(levels),
                                       above_fraction=(1.0,) * settings.max_window, zero_decay_fraction=0.9))
                continue
            centre = 10 ** rng.uniform(0, 3)      # median decay per chunk, nats
            spread = rng.uniform(0.05, 0.6)
            q = -centre * np.exp(spread * (0.5 - levels) * 4)     # ascending: level 0 decays most
            n_h = max(1, min(settings.max_window, math.ceil(-math.log(settings.eps) / -q[-2])))
            heads.append(HeadStats(head=h, n_h=n_h, cls=WARMUP, chunk_log_decay_quantiles=tuple(float(v) for v in q),
                                   above_fraction=(0.0,) * settings.max_window, zero_decay_fraction=0.0))
        layers.append(LayerStats(layer=li, decoder_layer=li + li // 3, num_tokens=4096, num_chunks=64,
                                 heads=tuple(heads)))
    return Calibration(checkpoint_sha256="ab" * 32, checkpoint_path=f"/models/synthetic-{num_layers}x{num_heads}",
                       family="qwen3_5", model_type="qwen3_5_text", spec={}, settings=settings, layers=layers,
                       corpus={"name": "synthetic", "sha256": "cd" * 32, "num_sequences": 2, "seq_len": 2048,
                               "num_tokens": 4096},
                       run={"device": "cpu", "dtype": "torch.float32", "seconds": 1.0})


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("shape", [(4, 8), (36, 32), (64, 128)])
def test_figure_stays_within_its_size_bound(shape):
    data = figure_png(synthetic_calibration(*shape))
    width, height = png_size(data)
    assert 0 < width <= MAX_FIGURE_PX[0] and 0 < height <= MAX_FIGURE_PX[1], (width, height)
    pixels = plt.imread(io.BytesIO(data))[..., :3]
    assert pixels.shape[:2] == (height, width)
    rgb = (pixels * 255).astype(np.uint32)
    colours = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
    assert len(colours) > 100 and pixels.std() > 0.05, "a blank figure"


@pytest.mark.parametrize("shape", [(4, 8), (64, 128)])
def test_markdown_lines_stay_short_and_keep_every_layer_and_head(shape):
    cal = synthetic_calibration(*shape)
    text = markdown(cal)
    longest = max(text.splitlines(), key=len)
    assert len(longest) <= MAX_LINE_CHARS, longest
    for layer in cal.layers:
        assert f"\n| {layer.layer} | {layer.decoder_layer} | " in text, f"layer {layer.layer} missing from the table"
        assert f"<summary>GDN layer {layer.layer}, decoder layer {layer.decoder_layer}:" in text
    assert text.count("<details>") == text.count("</details>") == len(cal.layers)
    head_rows = [line for line in text.splitlines() if line.startswith("| ") and line.count("|") == 8
                 and line.split("|")[2].strip() in (WARMUP, EXACT)]
    assert len(head_rows) == shape[0] * shape[1]


def test_markdown_shows_each_heads_n_h():
    cal = synthetic_calibration(64, 128)
    text = markdown(cal)
    last = cal.layers[-1]
    section = text[text.index(f"<summary>GDN layer {last.layer},"):]
    listed = [tok for line in section.split("```")[1].splitlines() if line for tok in line.split()[1:]]
    assert listed == ["ex" if h.n_h is None else str(h.n_h) for h in last.heads]
    assert any(h.n_h is None for h in last.heads) and "exact" in text
