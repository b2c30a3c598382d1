"""Keep a transformers GDN layer on transformers' own PyTorch code, whatever kernels are installed.

transformers routes a GDN layer's recurrence, short convolution and gated norm to optional
kernel packages (FLA, causal-conv1d) when they import. Calibration must run layer math it
controls: those kernels need a GPU driver (Triton fails with "0 active drivers" on a CPU) and
their numerics are not ours to vouch for. transformers 5.x makes that choice at two kinds of
dispatch point in a family's modeling module, both pinned here:

- hub-dispatch wrappers: module-level functions (torch_chunk_gated_delta_rule, causal_conv1d_fn,
  ...) built by a decorator that resolved the kernel package once, at import, and keep the choice
  in their closure beside the PyTorch function they wrap (functools.wraps' __wrapped__). Pinned:
  the module name points at a caller of that PyTorch function.
  With the `kernels` library installed the decorator makes that wrapper an nn.Module instance
  (a class of `kernels`; from transformers 5.25, which requires `kernels`, a class that takes the
  modeling module's name) whose forward calls it, and `kernels.kernelize` on any model swaps that
  shared instance's forward for a Hugging Face hub kernel; pinned the same way, by finding the
  PyTorch function of the same name behind it (hub_dispatch).
- optional imports: module globals a layer reads in __init__ (chunk_gated_delta_rule,
  FusedRMSNormGated, ...), each None when its package is absent and the layer then picks its
  PyTorch fallback. Pinned: the global reads None, as if the package were not installed.

Pinning is a context manager: the module's names are swapped on entry and put back on exit, so
nothing outlives the calibration's own layer construction and forward calls (another thread
running the same family inside that window also gets the PyTorch path, never a kernel). Layers
are built and run inside it, and `check_torch_only` walks what a built layer can reach (its
submodules' classes, the functions its methods name, their closures) and refuses, naming the
transformers version, anything from outside torch, transformers and the standard library.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types

import torch

from ...calibration_settings import CalibrationError
from ...hub_dispatch import cell_filled, linked, torch_function_behind

# Module globals a modeling module sets to None when the optional kernel package is missing.
OPTIONAL_KERNEL_GLOBALS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "FusedRMSNormGated",
                           "causal_conv1d_fn", "causal_conv1d_update")
# Keyword arguments only a kernel package can honour (packed sequences); calibration never passes them.
PACKED_SEQUENCE_KWARGS = ("cu_seqlens", "seq_idx")
# Where a pinned layer's code may come from (and this module, whose callers stand in for the wrappers).
ALLOWED_ROOTS = frozenset({"torch", "transformers", "builtins", *sys.stdlib_module_names})

_lock = threading.RLock()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _origin(obj) -> str | None:
    """Module an object's code comes from (a callable instance's: its class's); None for data."""
    if isinstance(obj, functools.partial):
        return _origin(obj.func)
    if inspect.ismodule(obj):
        return obj.__name__
    if isinstance(obj, type) or inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        return getattr(obj, "__module__", None) or "builtins"
    if callable(obj):
        return type(obj).__module__
    return None


def _root(obj) -> str | None:
    origin = _origin(obj)
    return None if origin is None else origin.split(".")[0]


def _foreign(obj) -> bool:
    origin = _origin(obj)
    return origin is not None and origin.split(".")[0] not in ALLOWED_ROOTS and origin != __name__


def _code_names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _unwrap_chain(fn):
    """fn and every function it wraps (functools.wraps' __wrapped__)."""
    seen = []
    while fn is not None and not any(fn is s for s in seen):
        seen.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return seen


def _foreign_reach(fn, home: str, path: str, visited: set) -> list[str]:
    """Foreign objects reachable from function fn: through its closures, the globals its code
    names, and functions of the modeling module `home` it calls. Each as 'path -> name (package)'."""
    found = []
    here = path or fn.__qualname__
    chain = _unwrap_chain(fn)
    for f in chain:
        if not inspect.isfunction(f) or id(f) in visited:
            continue
        visited.add(id(f))
        reached = [(cell.cell_contents, f"its closure's {var}") for var, cell in
                   zip(f.__code__.co_freevars, f.__closure__ or ()) if cell_filled(cell)]
        reached += [(f.__globals__[n], n) for n in sorted(set(_code_names(f.__code__))) if n in f.__globals__]
        for value, name in reached:
            if any(value is c for c in chain):
                continue
            if _foreign(value):
                found.append(f"{here} -> {name} ({_root(value)}: {getattr(value, '__qualname__', value)!r})")
            elif inspect.isfunction(value) and value.__module__ == home:
                found += _foreign_reach(value, home, f"{here} -> {name}", visited)
            elif _origin(value) == home and not isinstance(value, type):
                found += _object_reach(value, home, f"{here} -> {name}", visited)
    return found


def _object_reach(obj, home: str, path: str, visited: set) -> list[str]:
    """Foreign objects reachable from a callable object of the modeling module `home` (transformers
    5.25 gives the `kernels` library's hub module around a PyTorch function that module's name):
    through the functions it hands calls to (its class's forward, whatever package that comes
    from), as _foreign_reach walks a function."""
    if id(obj) in visited:
        return []
    visited.add(id(obj))
    return [f for fn in linked(obj) if inspect.isfunction(fn)
            for f in _foreign_reach(fn, home, path or type(obj).__qualname__, visited)]


def _dispatch_target(name: str, value, home: str):
    """For a module global of `home` that dispatches to a kernel package (a wrapper whose closure
    chose one, or a callable object from one, as the `kernels` library makes of a decorated
    function): the PyTorch function it falls back to. None for anything else, and where no such
    function is found (check_torch_only then refuses the layer if it reaches the global)."""
    if isinstance(value, type) or inspect.ismodule(value) or not callable(value):
        return None
    if inspect.isfunction(value):
        if value.__module__ != home or not hasattr(value, "__wrapped__") or not _foreign_reach(value, home, "",
                                                                                                set()):
            return None
    elif not _foreign(value) and not _object_reach(value, home, "", set()):
        return None
    target = torch_function_behind(name, value, home)
    if target is None or _foreign_reach(target, home, "", set()):
        return None
    return target


def _torch_caller(target):
    """Call target as the hub-dispatch wrapper calls its PyTorch fallback: keywords it does not take
    are dropped, and packed sequences (which only a kernel package separates) are refused."""
    params = inspect.signature(target).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def call(*args, **kwargs):
        for name in PACKED_SEQUENCE_KWARGS:
            if kwargs.get(name) is not None:
                raise CalibrationError(f"{target.__name__}: calibration runs unpacked sequences, got {name}")
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return target(*args, **kwargs)

    call.__name__ = target.__name__
    call.__qualname__ = f"torch path of {target.__qualname__}"
    return call


def dispatch_pins(modeling: types.ModuleType) -> dict:
    """name -> what pinned_torch_path sets it to, for each kernel dispatch point of `modeling` that
    reaches a kernel package now; empty when none is installed (nothing then changes)."""
    home = modeling.__name__
    pins = {}
    for name, value in vars(modeling).items():
        target = _dispatch_target(name, value, home)
        if target is not None:
            pins[name] = _torch_caller(target)
        elif name in OPTIONAL_KERNEL_GLOBALS and value is not None and _foreign(value):
            pins[name] = None
    return pins


@contextlib.contextmanager
def pinned_torch_path(modeling: types.ModuleType):
    """Within the block, `modeling`'s kernel dispatch points resolve to transformers' PyTorch code;
    on exit every swapped name is put back as it was."""
    with _lock:
        pins = dispatch_pins(modeling)
        saved = {name: vars(modeling)[name] for name in pins}
        try:
            for name, value in pins.items():
                setattr(modeling, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(modeling, name, value)


def check_torch_only(layer: torch.nn.Module, modeling: types.ModuleType, what: str) -> None:
    """Raise CalibrationError naming the transformers version if `layer` (built and about to run
    inside pinned_torch_path) can reach code from outside torch, transformers and the stdlib."""
    home = modeling.__name__
    found, visited = [], set()
    for name, module in layer.named_modules():
        cls = type(module)
        label = f"{what}.{name}" if name else what
        if _foreign(cls):
            found.append(f"{label} is a {cls.__module__}.{cls.__qualname__}")
            continue
        attrs = set()
        for klass in cls.__mro__:
            if _root(klass) != "transformers":
                continue
            for attr, fn in vars(klass).items():
                fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
                if inspect.isfunction(fn):
                    attrs.update(_code_names(inspect.unwrap(fn).__code__))
                    found += _foreign_reach(fn, home, f"{label}.{attr}", visited)
        for attr, value in vars(module).items():
            if attr not in attrs:
                continue
            if _foreign(value):
                found.append(f"{label}.{attr} is {_root(value)}: {getattr(value, '__qualname__', value)!r}")
            elif inspect.isfunction(value):
                found += _foreign_reach(value, home, f"{label}.{attr}", visited)
    if found:
        listed = "; ".join(found[:4]) + (" ..." if len(found) > 4 else "")
        raise CalibrationError(
            f"transformers {_transformers_version()}: {what} would run code outside torch and transformers "
            f"({listed}); calibration runs only transformers' PyTorch layer math and does not know how to pin "
            f"this version's dispatch")
