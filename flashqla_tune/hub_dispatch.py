"""What a transformers kernel-dispatch object hands its calls to.

transformers 5.x builds some module-level functions of a modeling module (torch_chunk_gated_delta_rule,
causal_conv1d_fn, ...) with a decorator that wraps the module's PyTorch function (functools.wraps'
__wrapped__) and keeps its kernel choice in its closure; with the `kernels` library installed the
decorator makes that wrapper an nn.Module instance whose forward calls it (transformers 5.25 does
so for every such function). Both the calibration's pins (calibrate.adapters.torch_layer_math)
and the transformers pack route (integrations.transformers) need the PyTorch function behind such
an object: the pins to call it, the route to bind a call's arguments by its names.
"""
from __future__ import annotations

import inspect


def cell_filled(cell) -> bool:
    """Whether a closure cell holds a value yet."""
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def linked(obj):
    """What a dispatch object hands its call to: wrapped functions, closure contents, forwards."""
    if inspect.ismethod(obj):
        yield obj.__func__
    if inspect.isfunction(obj):
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            yield wrapped
        yield from (cell.cell_contents for cell in obj.__closure__ or () if cell_filled(cell))
    elif callable(obj) and not isinstance(obj, type):
        yield from (f for f in (vars(obj).get("forward") if hasattr(obj, "__dict__") else None,
                                getattr(type(obj), "forward", None), getattr(type(obj), "__call__", None))
                    if f is not None)


def torch_function_behind(name: str, value, home: str):
    """The function of module `home` named `name` that dispatch object `value` falls back to (the
    function its decorator wrapped, itself wrapping nothing), found through the links value hands
    calls on by; None where there is none."""
    seen, todo = set(), [value]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if (inspect.isfunction(obj) and obj.__module__ == home and obj.__name__ == name
                and not hasattr(obj, "__wrapped__") and obj is not value):
            return obj
        if inspect.isfunction(obj) or inspect.ismethod(obj) or (callable(obj) and not isinstance(obj, type)):
            todo.extend(linked(obj))
    return None
