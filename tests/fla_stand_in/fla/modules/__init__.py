"""Stand-in for fla.modules.FusedRMSNormGated: a module whose forward fails as Triton does on a CPU."""
import torch

from _no_gpu_driver import no_driver


class FusedRMSNormGated(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, activation="swish", device=None, dtype=None, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self._kernel = no_driver("FusedRMSNormGated")

    def forward(self, x, g, *args, **kwargs):
        return self._kernel(x, g)
