"""Run a checkpoint layer by layer with bounded memory and collect gate statistics.

Only one decoder layer's weights are loaded at a time; the batch's hidden states are carried
from layer to layer (kept on the compute device, or offloaded to CPU between layers). Layers
after the last GDN layer are never run: no gate depends on them.
"""
from __future__ import annotations

import torch

from ..calibration_settings import CalibrationSettings
from .adapters.base import GDNAdapter
from .statistics import GateAccumulator, LayerStats


def run_layer_by_layer(adapter: GDNAdapter, input_ids: torch.Tensor, settings: CalibrationSettings,
                       batch_size: int = 8, offload: bool = False, progress=None) -> list[LayerStats]:
    model = adapter.model
    store = torch.device("cpu") if offload else adapter.device
    with torch.no_grad():
        hidden = [adapter.embed(b).to(store) for b in input_ids.split(batch_size)]
    last = max(model.gdn_layers)
    stats: list[LayerStats] = []
    for index in range(last + 1):
        layer = adapter.load_layer(index)
        acc = (GateAccumulator(model.spec.num_v_heads, settings, per_key=model.spec.gate_kind == "per_key")
               if index in model.gdn_layers else None)
        for j, h in enumerate(hidden):
            out, g = layer(h.to(adapter.device))
            if acc is not None:
                acc.add(g)
            hidden[j] = out.to(store) if index < last else None
            if progress is not None:
                progress.update(1)
        del layer
        if acc is not None:
            stats.append(acc.finish(layer=len(stats), decoder_layer=index))
    return stats


def steps(model, input_ids: torch.Tensor, batch_size: int) -> int:
    """How many (layer, batch) steps run_layer_by_layer takes: the progress bar's total."""
    return (max(model.gdn_layers) + 1) * len(input_ids.split(batch_size))
