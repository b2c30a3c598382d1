"""Adapter registry: one module per GDN family, keyed by ModelGDNConfig.family (the name of the
family's record in model_config's registry).

Porting a new GDN variant means registering its family in model_config, writing one adapter module
and adding a line here (docs/porting.md).
Modules are imported on first use so that reading the registry costs no model code.
"""
from __future__ import annotations

import importlib

from ...calibration_settings import CalibrationError

ADAPTERS = {
    "qwen3_next": "qwen3_next:Qwen3NextAdapter",
    "qwen3_5": "qwen3_5:Qwen35Adapter",
    "fla_gated_deltanet": "fla_gdn:FLAGatedDeltaNetAdapter",
    "olmo_hybrid": "olmo_hybrid:OlmoHybridAdapter",
    "kimi_linear": "kimi_linear:KimiLinearAdapter",
}


def register(family: str, target: str) -> None:
    """target: 'module:Class' inside this package, or a fully qualified 'pkg.module:Class'."""
    ADAPTERS[family] = target


def adapter_class(family: str):
    if family not in ADAPTERS:
        raise CalibrationError(f"no calibration adapter for GDN family {family!r} (known: {', '.join(sorted(ADAPTERS))})")
    module_name, cls_name = ADAPTERS[family].split(":")
    module = importlib.import_module(module_name if "." in module_name else f"{__name__}.{module_name}")
    return getattr(module, cls_name)
