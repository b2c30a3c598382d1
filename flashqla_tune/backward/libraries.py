"""The backward's kernel libraries by the kind a kernel pack records them under: "chain"
(chain_kernels), "prep" (prep_kernels) and "chunk" (chunk_kernels).

Each of these modules exports KIND (its kernel_library.LibraryKind), LIBRARIES (this process's
kernel_library.LibraryTable of that kind: get, offer, register, open, cache_entry), ABI_VERSION and
spec_for(K, V) (ValueError for head dims it does not serve). A module is imported when first asked
for.
"""
from __future__ import annotations

import importlib
from types import ModuleType

MODULE_NAMES = {"chain": "chain_kernels", "prep": "prep_kernels", "chunk": "chunk_kernels"}
KINDS = tuple(MODULE_NAMES)   # the order packs list and builds them in


def module(kind: str) -> ModuleType:
    """The module of one kind of backward library; KeyError naming the kind for any other name."""
    if kind not in MODULE_NAMES:
        raise KeyError(f"no backward library of kind {kind!r}; the kinds are {', '.join(KINDS)}")
    return importlib.import_module(f"{__package__}.{MODULE_NAMES[kind]}")


def modules() -> dict[str, ModuleType]:
    """Every kind's module, in KINDS order."""
    return {kind: module(kind) for kind in KINDS}


def spec_for(kind: str, head_k_dim: int, head_v_dim: int):
    """The spec of `kind`'s library the backward uses for these head dims, or None where that kind
    has none for them (its module's spec_for raised ValueError)."""
    try:
        return module(kind).spec_for(head_k_dim, head_v_dim)
    except ValueError:
        return None


__all__ = ["KINDS", "MODULE_NAMES", "module", "modules", "spec_for"]
