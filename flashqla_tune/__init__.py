"""flashqla-tune: calibrate-then-compile Gated DeltaNet kernels for Hopper."""
from .spec import GDNSpec, SpecError

__version__ = "0.1.0"
__all__ = ["GDNSpec", "SpecError", "__version__"]
