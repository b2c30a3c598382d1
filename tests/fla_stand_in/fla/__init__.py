"""Test stand-in for an installed FLA (flash-linear-attention) on a machine with no GPU driver.

Put this folder (tests/fla_stand_in) first on sys.path, before transformers imports a GDN
modeling module, and transformers finds `fla` with the op names and import paths it resolves:
its dispatch then routes the layer here, and every op fails as FLA's Triton kernels do on a
CPU. It is not FLA and computes nothing; the calibration tests use it to show that calibration
never takes that route. (tests/fla_doubles.py is a different double: FLA's backend registry.)
"""
from .modules import FusedRMSNormGated
from .ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__version__ = "0.4.0"
__all__ = ["FusedRMSNormGated", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
