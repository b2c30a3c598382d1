"""What a GDN family adapter provides to the layer-by-layer runner.

An adapter knows how to read one family's checkpoint: check that every GDN layer's gate
tensors exist with the config's head count, embed tokens, and run decoder layer i on a batch
of hidden states while returning that layer's gate g [B, T, Hv] (None for non-GDN layers).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from ...model_config import ModelGDNConfig
from ..weights import WeightIndex

# A loaded decoder layer: hidden [B, T, D] -> (hidden [B, T, D], gate [B, T, Hv] or None).
LayerFn = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


class GDNAdapter(ABC):
    family: str = ""

    def __init__(self, checkpoint, model: ModelGDNConfig, weights: WeightIndex,
                 device: torch.device, dtype: torch.dtype):
        self.checkpoint = checkpoint
        self.model = model
        self.weights = weights
        self.device = device
        self.dtype = dtype

    @abstractmethod
    def check(self) -> None:
        """Raise CalibrationError naming any missing or mis-shaped tensor before anything runs."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, D] hidden states on self.device."""

    @abstractmethod
    def load_layer(self, index: int) -> LayerFn:
        """Decoder layer `index` with its weights on self.device; dropped by the caller after use."""

    @staticmethod
    def gate(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """GDN's gate in log space, in fp32 as the model code computes it:
        g = -exp(A_log) * softplus(a + dt_bias)."""
        return -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
