"""The protocol's inputs (DESIGN.md, "Benchmark protocol"), as FlashQLA's own benchmark makes
them: q, k L2-normalised bf16; v bf16; g = logsigmoid(randn)/16 fp32 with 25% of v-heads forced
to 0; beta = sigmoid(randn) fp32; h0 fp32; always varlen (B = 1 with cu_seqlens)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cases import Case

ZERO_GATE_SHARE = 0.25  # share of v-heads with g = 0 (non-decaying heads that force CP fallback)
HEAD_SEED = 42  # which heads are zero-gate is fixed by this seed, independent of the data seed


def zero_gate_heads(num_v_heads: int, seed: int = HEAD_SEED) -> torch.Tensor:
    """Sorted indices of the v-heads whose gate is forced to 0: round(25%) of them, drawn with a
    fixed seed so every library and every run sees the same heads."""
    if num_v_heads <= 0:
        raise ValueError(f"num_v_heads must be positive, got {num_v_heads}")
    count = round(num_v_heads * ZERO_GATE_SHARE)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_v_heads, generator=gen)[:count].sort().values


@functools.lru_cache(maxsize=None)
def protocol_warmup_table(num_v_heads: int, tokens: int = 65536, seed: int = HEAD_SEED + 1) -> tuple[int, ...]:
    """What a calibration answers for the protocol's gate distribution: per v-head warm-up chunks,
    -1 for the zero-gate heads. Drawn on the host with its own seed (a sample of the distribution,
    not the timed inputs), for our op's calibrated-warm-up column."""
    from ..calibrate.statistics import calibrate_gates  # the calibration pass's own statistics

    gen = torch.Generator().manual_seed(seed)
    g = F.logsigmoid(torch.randn(tokens, num_v_heads, generator=gen, dtype=torch.float64)) / 16
    g[:, zero_gate_heads(num_v_heads)] = 0.0
    return tuple(calibrate_gates(g).warmup_table)


@dataclass
class CaseInputs:
    """One input set. cu_seqlens objects are shared by every input set of a case (see
    make_rotation): FlashQLA and FLA key their metadata caches on the tensor's identity."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor
    cu_seqlens: torch.Tensor  # int32, on the device
    cu_seqlens_long: torch.Tensor  # int64, on the device
    cu_seqlens_cpu: torch.Tensor  # int64, on the host
    scale: float
    extra: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.k, self.v, self.g, self.beta, self.initial_state))


def make_cu_seqlens(seqlens, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 device, int64 device, int64 host) offsets [0, l0, l0+l1, ...]."""
    lens = [int(n) for n in seqlens]
    if not lens or any(n <= 0 for n in lens):
        raise ValueError(f"sequence lengths must be positive, got {list(seqlens)}")
    cpu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cpu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return cpu.to(device, torch.int32), cpu.to(device), cpu


def make_inputs(case: Case, device="cpu", seed: int = 0, dtype=torch.bfloat16, cu=None) -> CaseInputs:
    """One protocol input set for a case. cu: offsets from make_cu_seqlens to share between sets."""
    Hqk, Hv, K, V, T = case.num_qk_heads, case.num_v_heads, case.head_k_dim, case.head_v_dim, case.total_tokens
    if Hv % Hqk:
        raise ValueError(f"h_v={Hv} is not a multiple of h_qk={Hqk}")
    device = torch.device(device)
    # Drawn where they are used (the largest case is ~1.6 GB of fp32 draws: too slow on the host);
    # the seeded generator makes a case's data repeatable on a given device type.
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=gen, device=device, dtype=torch.float32)
    q = F.normalize(torch.randn(1, T, Hqk, K, **kw), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, Hqk, K, **kw), dim=-1).to(dtype)
    v = torch.randn(1, T, Hv, V, **kw).to(dtype)
    g = F.logsigmoid(torch.randn(1, T, Hv, **kw)) / 16
    g[:, :, zero_gate_heads(Hv).to(device)] = 0.0
    beta = torch.sigmoid(torch.randn(1, T, Hv, **kw))
    h0 = torch.randn(len(case.seqlens), Hv, K, V, **kw)
    cu = cu if cu is not None else make_cu_seqlens(case.seqlens, device)
    return CaseInputs(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
        cu_seqlens=cu[0], cu_seqlens_long=cu[1], cu_seqlens_cpu=cu[2], scale=K ** -0.5,
    )


def make_rotation(case: Case, count: int, device, seed: int = 0, dtype=torch.bfloat16,
                  cu=None) -> list[CaseInputs]:
    """count distinct input sets (seeds seed..seed+count-1) that share one set of cu_seqlens
    tensors (cu, or new ones), so identity-keyed caches hit while the data rotates past L2."""
    if count < 1:
        raise ValueError(f"rotation count must be >= 1, got {count}")
    cu = cu if cu is not None else make_cu_seqlens(case.seqlens, device)
    return [make_inputs(case, device, seed + i, dtype, cu=cu) for i in range(count)]
