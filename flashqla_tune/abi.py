"""ctypes mirror of csrc/gdn_abi.h, the extern "C" ABI of every built kernel library.

Field names, order and C types match FqtGdnFwdArgs exactly (tests/test_abi.py parses the
header and checks offsets with the host compiler). Every pointer is a c_void_p: the same size
and alignment as a typed pointer, and it takes tensor.data_ptr() integers directly.
"""
from __future__ import annotations

import ctypes

ABI_VERSION = 4


class FqtGdnFwdArgs(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("beta", ctypes.c_void_p),
        ("cu_seqlens", ctypes.c_void_p),
        ("initial_state", ctypes.c_void_p),
        ("final_state", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("total_tokens", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("use_qk_l2norm", ctypes.c_int32),
        ("prep_schedule", ctypes.c_int32),
        ("warmup", ctypes.c_void_p),
        ("segment_chunks", ctypes.c_void_p),
        ("max_segments", ctypes.c_int64),
        ("log_eps", ctypes.c_float),
        ("exact_heads", ctypes.c_int32),
        ("a_log", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
    ]


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give a loaded library's ABI functions their C signatures (ctypes defaults to int)."""
    lib.fqt_abi_version.argtypes = []
    lib.fqt_abi_version.restype = ctypes.c_int32
    lib.fqt_plan_json.argtypes = []
    lib.fqt_plan_json.restype = ctypes.c_char_p
    lib.fqt_gdn_fwd_workspace_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.fqt_gdn_fwd_workspace_bytes.restype = ctypes.c_int64
    lib.fqt_gdn_fwd.argtypes = [ctypes.POINTER(FqtGdnFwdArgs), ctypes.c_void_p]
    lib.fqt_gdn_fwd.restype = ctypes.c_int32
    lib.fqt_error_string.argtypes = [ctypes.c_int32]
    lib.fqt_error_string.restype = ctypes.c_char_p
    return lib


SYMBOLS = ("fqt_abi_version", "fqt_plan_json", "fqt_gdn_fwd_workspace_bytes", "fqt_gdn_fwd", "fqt_error_string")

__all__ = ["ABI_VERSION", "FqtGdnFwdArgs", "SYMBOLS", "declare"]
