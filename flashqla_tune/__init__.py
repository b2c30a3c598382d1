"""flashqla-tune: calibrate-then-compile Gated DeltaNet kernels for Hopper."""
from .spec import GDNSpec, SpecError

__version__ = "0.1.0"


def load(pack, tp_rank: int = 0, tp_size: int = 1, **kwargs):
    """Open a kernel pack for one tensor-parallel rank (see flashqla_tune.packed_ops)."""
    from .packed_ops import load as _load

    return _load(pack, tp_rank, tp_size, **kwargs)


def register_fla_backend(pack, **kwargs):
    """Register a pack as a backend of FLA's chunk_gated_delta_rule (see flashqla_tune.fla_backend)."""
    from .fla_backend import register_fla_backend as _register

    return _register(pack, **kwargs)


__all__ = ["GDNSpec", "SpecError", "__version__", "load", "register_fla_backend"]
