"""The floor: what the hardware allows for a case. Ceilings are measured in the same run
(device-to-device copy bandwidth, bf16 matmul rate); per case, floor = max(bytes that must move /
bandwidth, tensor-core FLOPs / matmul rate)."""
from __future__ import annotations

import torch

from .cases import Case
from .torch_chunked import CHUNK


def measure_ceilings(device="cuda", copy_bytes: int = 2 << 30, matmul_n: int = 8192, iters: int = 10) -> dict:
    """Copy bandwidth counts bytes read + written; both are means over `iters` after warm-up."""
    dev = torch.device(device)
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    copy_ms = _mean_ms(lambda: dst.copy_(src), iters)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    mm_ms = _mean_ms(lambda: torch.mm(a, b), iters)
    return {
        "copy_bytes_per_s": 2 * copy_bytes / (copy_ms * 1e-3),
        "matmul_flops_per_s": 2 * matmul_n ** 3 / (mm_ms * 1e-3),
        "copy_bytes": copy_bytes, "matmul_n": matmul_n, "iters": iters,
    }


def _mean_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def case_bytes(case: Case) -> int:
    """q, k, v read and o written (bf16); g, beta read (fp32); h0 read and final state written (fp32)."""
    T, Hqk, Hv, K, V, N = (case.total_tokens, case.num_qk_heads, case.num_v_heads,
                           case.head_k_dim, case.head_v_dim, len(case.seqlens))
    return 2 * (2 * T * Hqk * K + 2 * T * Hv * V) + 4 * 2 * T * Hv + 4 * 2 * N * Hv * K * V


def flops_per_chunk_head(C: int = CHUNK, K: int = 128, V: int = 128) -> float:
    """Tensor-core FLOPs of one chunk and v-head in the chunked algorithm (DESIGN.md, "The math"),
    counting only the triangles that are non-zero, so the floor stays a lower bound:
    strictly-lower K K^T and lower Q K^T (C(C-1)/2 K and C(C+1)/2 K MACs), the triangular solve
    for A0 (~C^3/6 MACs), (Gamma . A0) diag(b) W and (Gamma . Q K^T) V_new (C(C+1)/2 V MACs each),
    and the three state products K S, Q S and K^T V_new (C K V MACs each). x2 for FLOPs."""
    tri = C * (C + 1) / 2
    macs = (C * (C - 1) / 2) * K + tri * K + C ** 3 / 6 + 2 * tri * V + 3 * C * K * V
    return 2 * macs


def case_flops(case: Case) -> float:
    """Per v-head and chunk (tails count as whole chunks: the tensor cores run full tiles)."""
    chunks = sum((n + CHUNK - 1) // CHUNK for n in case.seqlens)
    return chunks * case.num_v_heads * flops_per_chunk_head(CHUNK, case.head_k_dim, case.head_v_dim)


def case_floor(case: Case, ceilings: dict) -> dict:
    nbytes, flops = case_bytes(case), case_flops(case)
    bytes_ms = nbytes / ceilings["copy_bytes_per_s"] * 1e3
    flops_ms = flops / ceilings["matmul_flops_per_s"] * 1e3
    return {"bytes": nbytes, "flops": flops, "bytes_ms": bytes_ms, "flops_ms": flops_ms,
            "floor_ms": max(bytes_ms, flops_ms), "bound": "memory" if bytes_ms >= flops_ms else "compute"}
