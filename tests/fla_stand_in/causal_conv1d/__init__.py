"""Test stand-in for an installed causal-conv1d on a machine with no GPU: the two functions
transformers resolves, failing when called (see tests/fla_stand_in/fla/__init__.py)."""
from _no_gpu_driver import no_driver

_fn = no_driver("causal_conv1d_fn")
_update = no_driver("causal_conv1d_update")


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    return _fn(x, weight)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    return _update(x, conv_state, weight)

__version__ = "1.5.0"
