"""The chunk-parallel GDN backward in PyTorch (fp32 math by default), on any device.

This is the op's backward (flashqla_tune.ops registers it on the custom op) and the specification
of the Hopper backward kernels. On a CUDA device (fp32 compute) its two sequential steps, 1 and 2
below, run as the chain kernels of chain_kernels.py (csrc/gdn_bwd_chain.cuh), one launch each, and
step 3 as the per-chunk gradient kernel of chunk_kernels.py (csrc/gdn_bwd_chunk.cuh), one launch;
everything else is batched torch work, so no Python loop runs per chunk; elsewhere (the CPU, a float64
check) they are the torch loops over chunk positions and per_chunk_gradients below, which stay the
reference the kernels are tested against (`sequential="torch"`). Per chunk of C = 64 tokens and
v-head, with the forward of DESIGN.md "The math" written as

    u  = T V,   w = T D K,   T = (Gamma * A0) diag(b)       (the WY factors)
    Vn = u - w S                                             (the chunk's new values)
    O  = scale (D Q S + P Vn),   P = Gamma * Q K^T
    S' = e^{gamma_C} S + Kd^T Vn,   Kd = diag(e^{gamma_C - gamma}) K

the backward

  1. recomputes every chunk's incoming state S_c (one forward chain over the chunks; nothing
     but the inputs is saved by the forward), then everything else that does not depend on the
     state, batched over all chunks of all sequences and heads;
  2. runs the state gradient backward over the chunks, dS_c = e^{gamma_C} dS_{c+1}
     + (D Q)^T dO - w^T dVn with dVn = P^T dO + Kd dS_{c+1}: the transposed chunk transition
     M_c^T applied to dS_{c+1}, plus the terms from the chunk's own outputs. It starts from the
     final state's gradient (dht) and ends at the initial state's gradient (dh0);
  3. with S_c and dS_{c+1} known for every chunk, computes dq, dk, dv, the gradients of the WY
     factors (T, and through A0 = (I + L)^{-1}, L = strictly_lower(diag(b) K K^T), the gradient
     -A0^T dA0 A0^T of I + L), dbeta, and the gate's gradient on the in-chunk cumulative gate,
     whose reverse cumulative sum is dg -- batched over all chunks again.

GVA: dq and dk are summed over each q/k head's v-heads; with use_qk_l2norm_in_kernel the
gradients go back through x / sqrt(|x|^2 + eps). Without the chain kernels it loops only over chunk
positions, like the PyTorch forward (measure/torch_chunked): all sequences that still have a chunk
there in lockstep.
"""
from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..oracle.chunked import CHUNK, decay_mask, gate_free_inverse
from ..oracle.common import l2_normalize


@dataclass(frozen=True)
class ChunkGrid:
    """Where each token of the sequences sits in the padded [num_chunks, CHUNK] layout, and which
    chunks run at each chunk position. Tokens from cu_seqlens[-1] to T belong to no sequence."""
    num_seqs: int
    num_chunks: int
    num_tokens: int           # cu_seqlens[-1]: the tokens that belong to a sequence (all rows: dump_slot)
    token_slot: torch.Tensor  # [num_tokens] slot (chunk * CHUNK + offset) of each token
    slot_token: torch.Tensor  # [num_chunks * CHUNK] token of each slot, or num_tokens for a pad slot
    steps: tuple | None       # per chunk position: (sequence indices, or None when all run; chunk indices);
                              # None for a grid built on the device (no host loop can use it)
    chunk_offsets: torch.Tensor  # [num_seqs + 1] int64: each sequence's first chunk, then num_chunks
    chunk_sequence: torch.Tensor  # [num_chunks] int64: the sequence each chunk belongs to
    # A grid built on the device: token_slot covers every row, a row of no sequence naming the slot
    # num_chunks * CHUNK past the chunks (a zero row from_chunks appends)
    dump_slot: bool = False
    # Every sequence is a whole number of chunks, back to back from row 0, so slot i is token i for
    # every slot: the chunk layout keeps the token rows' order, one copy of them and no gather
    identity: bool = False


# Recent grids by (offsets, device), least recently used first: a training loop repeats few
# offsets at a time but may see new ones every step, so the cache is bounded.
_GRIDS: OrderedDict = OrderedDict()
GRID_CACHE_SIZE = 32


def chunk_grid(bounds: tuple[int, ...], device) -> ChunkGrid:
    """The grid of host offsets `bounds` (0 first, non-decreasing), cached per (offsets, device)."""
    key = (bounds, str(device))
    grid = _GRIDS.get(key)
    if grid is not None:
        _GRIDS.move_to_end(key)
        return grid
    if not bounds or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {list(bounds)}")
    lens = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {list(bounds)}")
    nchunks = [(n + CHUNK - 1) // CHUNK for n in lens]
    first = [sum(nchunks[:i]) for i in range(len(lens))]
    total, tokens = sum(nchunks), bounds[-1]
    token_slot = torch.empty(tokens, dtype=torch.int64)
    slot_token = torch.full((total * CHUNK,), tokens, dtype=torch.int64)
    for s, (start, n) in enumerate(zip(bounds[:-1], lens)):
        slots = torch.arange(n) + first[s] * CHUNK
        token_slot[start:start + n] = slots
        slot_token[slots] = torch.arange(start, start + n)
    steps = []
    for j in range(max(nchunks, default=0)):
        seqs = [s for s in range(len(lens)) if nchunks[s] > j]
        chunks = torch.tensor([first[s] + j for s in seqs], dtype=torch.int64, device=device)
        everyone = len(seqs) == len(lens)
        steps.append((None if everyone else torch.tensor(seqs, dtype=torch.int64, device=device), chunks))
    offsets = torch.tensor(first + [total], dtype=torch.int64, device=device)
    sequence = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(nchunks, dtype=torch.int64))
    grid = ChunkGrid(len(lens), total, tokens, token_slot.to(device), slot_token.to(device), tuple(steps), offsets,
                     sequence.to(device), identity=all(n % CHUNK == 0 for n in lens))
    _GRIDS[key] = grid
    while len(_GRIDS) > GRID_CACHE_SIZE:
        _GRIDS.popitem(last=False)
    return grid


def uniform_chunk_grid(num_seqs: int, sequence_tokens: int, device) -> ChunkGrid:
    """The grid of num_seqs sequences of sequence_tokens tokens each (a positive multiple of CHUNK),
    back to back: an identity grid, known on the host without reading any offsets (its steps are
    None, as a device grid's). Built on the device each call, never cached, as device_chunk_grid's
    is: a backward captured in a CUDA graph keeps its own tensors for as long as the graph lives."""
    if num_seqs < 1 or sequence_tokens < CHUNK or sequence_tokens % CHUNK:
        raise ValueError(f"uniform_chunk_grid needs at least one sequence of a positive multiple of {CHUNK} tokens, "
                         f"got {num_seqs} sequences of {sequence_tokens}")
    per_seq = sequence_tokens // CHUNK
    total = num_seqs * per_seq
    slots = torch.arange(total * CHUNK, dtype=torch.int64, device=device)
    return ChunkGrid(num_seqs, total, total * CHUNK, slots, slots, None,
                     torch.arange(0, total + 1, per_seq, dtype=torch.int64, device=device),
                     torch.arange(total, dtype=torch.int64, device=device) // per_seq, identity=True)


def device_chunk_grid(cu_seqlens: torch.Tensor, total_rows: int) -> ChunkGrid:
    """The grid of device offsets `cu_seqlens` ([N + 1], N >= 1) over `total_rows` token rows, built
    with device ops only (no host sync, so a backward through it can be captured in a CUDA graph).
    The host does not know how many chunks the sequences take, so the grid has the most they can:
    ceil(total_rows / 64) + N (each sequence's tail wastes less than one chunk); chunks past the
    sequences' own belong to none (their inputs are zero, no kernel walks them, their outputs are
    dropped). Offsets are clamped into [0, total_rows] and made non-decreasing first, so whatever
    they hold, nothing is indexed out of bounds; steps is None (the torch loops need a host grid)."""
    dev = cu_seqlens.device
    N = cu_seqlens.numel() - 1
    if N < 1:
        raise ValueError("device_chunk_grid needs at least one sequence (cu_seqlens of two or more entries)")
    cu = torch.cummax(cu_seqlens.to(torch.int64).clamp(0, total_rows), 0).values
    nchunks = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    first = torch.cumsum(nchunks, 0) - nchunks
    offsets = torch.cat([first, nchunks.sum().view(1)])
    num_chunks = -(-total_rows // CHUNK) + N
    sequence = torch.searchsorted(offsets[1:], torch.arange(num_chunks, device=dev), right=True).clamp(max=N - 1)
    rows = torch.arange(total_rows, device=dev)
    seq = torch.searchsorted(cu[1:], rows, right=True)              # N past the last sequence
    in_seq = (seq < N) & (rows >= cu[0])
    seq = seq.clamp(max=N - 1)
    dump = num_chunks * CHUNK
    token_slot = torch.where(in_seq, first[seq] * CHUNK + rows - cu[seq], torch.full_like(rows, dump))
    slot_token = torch.full((dump + 1,), total_rows, dtype=torch.int64, device=dev)
    slot_token.scatter_(0, token_slot, rows)                      # rows of no sequence land on the dump slot
    return ChunkGrid(N, num_chunks, total_rows, token_slot, slot_token[:dump], None, offsets, sequence,
                     dump_slot=True)


def padded_rows(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N, ...] -> [N + 1, ...] in `dtype` (default x's), the extra last row zero: the source
    gather_chunks reads pad slots from. One copy of x (which a dtype conversion makes anyway)."""
    out = x.new_empty((x.shape[0] + 1, *x.shape[1:]), dtype=dtype or x.dtype)
    out[:-1].copy_(x)
    out[-1].zero_()
    return out


def gather_chunks(padded: torch.Tensor, grid: ChunkGrid) -> torch.Tensor:
    """padded_rows of the grid's num_tokens token rows -> [num_chunks, H, CHUNK, D...], a view of one
    gather (token-major: each chunk's rows are CHUNK apart); pad slots read the zero row."""
    if padded.shape[0] != grid.num_tokens + 1:
        raise ValueError(f"gather_chunks needs {grid.num_tokens} token rows and the zero row, got {padded.shape[0]} rows")
    return padded[grid.slot_token].view(grid.num_chunks, CHUNK, *padded.shape[1:]).transpose(1, 2)


def chunk_rows(rows: torch.Tensor, grid: ChunkGrid, dtype: torch.dtype | None = None,
               copy: bool = True) -> torch.Tensor:
    """The grid's num_tokens token rows [num_tokens, H, D...] -> [num_chunks, H, CHUNK, D...] in
    `dtype` (default the rows'), a view of a fresh buffer (token-major: each chunk's rows are
    CHUNK apart); pad slots are zero. An identity grid takes one copy (the conversion), any other
    a copy and a gather. copy=False: an identity grid with no conversion gives a view of `rows`
    itself, for readers that never write to it."""
    if rows.shape[0] != grid.num_tokens:
        raise ValueError(f"chunk_rows needs the grid's {grid.num_tokens} token rows, got {rows.shape[0]}")
    if not grid.identity:
        return gather_chunks(padded_rows(rows, dtype), grid)
    if not copy and dtype in (None, rows.dtype):
        return rows.view(grid.num_chunks, CHUNK, *rows.shape[1:]).transpose(1, 2)
    out = torch.empty(rows.shape, dtype=dtype or rows.dtype, device=rows.device)
    out.copy_(rows)
    return out.view(grid.num_chunks, CHUNK, *rows.shape[1:]).transpose(1, 2)


def to_chunks(x: torch.Tensor, grid: ChunkGrid) -> torch.Tensor:
    """[T, H, D...] token rows -> [num_chunks, H, CHUNK, D...]; pad slots are zero (a zero k, v,
    beta and g leave the state as it is, so tails need no masking)."""
    return chunk_rows(x[:grid.num_tokens], grid)


def token_major_chunks(num_chunks: int, heads: int, dims: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fp32 buffer [num_chunks + 1, CHUNK, heads, *dims] whose last chunk is zero, and the view
    [num_chunks, heads, CHUNK, *dims] of its first num_chunks that a kernel writes per-chunk results
    into: in memory each chunk's rows are token rows, so from_token_major_chunks takes them back to
    token rows in one row gather."""
    buf = torch.empty((num_chunks + 1, CHUNK, heads, *dims), dtype=torch.float32, device=device)
    buf[-1].zero_()
    return buf, buf[:num_chunks].transpose(1, 2)


def from_token_major_chunks(buf: torch.Tensor, grid: ChunkGrid, total_tokens: int,
                            dtype: torch.dtype | None = None) -> torch.Tensor:
    """token_major_chunks' buffer [num_chunks + 1, CHUNK, H, D...] -> [T, H, D...] token rows in
    `dtype` (default the buffer's; pad slots dropped, rows of no sequence zero), rounded to `dtype`
    before the gather, which then moves the narrower rows."""
    rows = buf.view(buf.shape[0] * CHUNK, *buf.shape[2:])
    if grid.identity:   # the chunks' rows are the tokens' (and the spare chunk past them is dropped)
        rows = rows[:grid.num_tokens]
    if dtype is not None:
        rows = rows.to(dtype)
    if grid.dump_slot:   # a row of no sequence names row 0 of the zero chunk
        return rows.index_select(0, grid.token_slot)
    if grid.identity and total_tokens == grid.num_tokens:
        return rows
    out = rows.new_zeros((total_tokens, *rows.shape[1:]))
    out[:grid.num_tokens] = rows if grid.identity else rows.index_select(0, grid.token_slot)
    return out


def from_chunks(xc: torch.Tensor, grid: ChunkGrid, total_tokens: int) -> torch.Tensor:
    """[num_chunks, H, CHUNK, D...] -> [T, H, D...] token rows (pad slots dropped; rows that belong
    to no sequence are zero)."""
    H, rest = xc.shape[1], xc.shape[3:]
    flat = xc[:grid.num_chunks].transpose(1, 2).reshape(grid.num_chunks * CHUNK, H, *rest)
    if grid.identity:   # the slots are the tokens: one copy, never a view of the chunks
        out = xc.new_empty((total_tokens, H, *rest))
        out[:grid.num_tokens].copy_(flat)
        out[grid.num_tokens:].zero_()
        return out
    if grid.dump_slot:  # every row names a slot; a row of no sequence the zero row past the chunks
        return torch.cat([flat, flat.new_zeros((1, H, *rest))])[grid.token_slot]
    out = xc.new_zeros((total_tokens, H, *rest))
    out[:grid.num_tokens] = flat[grid.token_slot]
    return out


def l2_normalize_backward(x: torch.Tensor, grad: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The gradient w.r.t. x of l2_normalize(x) = x r, r = (|x|^2 + eps)^{-1/2}, given the
    gradient w.r.t. its output: r (grad - x_n <x_n, grad>)."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    xn = x * r
    return r * (grad - xn * (xn * grad).sum(-1, keepdim=True))


@dataclass
class GDNGradients:
    """The backward's results: dq, dk [B,T,Hqk,K] and dv [B,T,Hv,V] in the inputs' dtype, dbeta in
    beta's, dg in fp32 (the compute dtype if wider), dh0 in the initial state's dtype and layout
    (None without an initial state)."""
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None


def _host_bounds(B, T, cu_seqlens, cu_seqlens_cpu) -> tuple[int, ...]:
    if cu_seqlens is None:
        return tuple(range(0, B * T + 1, T)) if T else (0,) * (B + 1)
    if B != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got {B}")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()  # a sync without the host copy
    bounds = tuple(int(x) for x in (host.tolist() if isinstance(host, torch.Tensor) else host))
    if bounds[-1] > T:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the inputs hold only T={T} tokens")
    return bounds


SEQUENTIAL = ("auto", "kernels", "torch")


def uses_chain_kernels(sequential: str, device, compute_dtype, head_k_dim: int, head_v_dim: int) -> bool:
    """Whether steps 1 and 2 run as the chain kernels: "kernels" always (an error off CUDA), "torch"
    never, "auto" on an sm_90 CUDA device with fp32 compute and head dims the chain library is
    built for (chain_kernels.BACKWARD_DIMS). Under "auto" a library that cannot be built or opened
    there (no nvcc, no pack that carries one) falls back to the loops with a warning
    (chunk_gated_delta_rule_bwd_torch); under "kernels" it is that library's BackwardKernelError."""
    if sequential not in SEQUENTIAL:
        raise ValueError(f"sequential={sequential!r} must be one of {SEQUENTIAL}")
    if sequential == "torch":
        return False
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if sequential == "kernels":
        if not on_cuda or compute_dtype != torch.float32:
            raise ValueError(f"sequential='kernels' needs CUDA tensors and compute_dtype float32, got device "
                             f"{device} and {compute_dtype}")
        return True
    from .chain_kernels import BACKWARD_DIMS

    if not (on_cuda and compute_dtype == torch.float32 and (head_k_dim, head_v_dim) in BACKWARD_DIMS):
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def _library_or_none(module, sequential: str, K: int, V: int, fallback: str):
    """`module`'s library (chain_kernels, prep_kernels or chunk_kernels) for these dims, or None
    where "auto" cannot build or open it: said once in a warning ending with `fallback` (what the
    backward does instead), and remembered, so later backwards fall back without trying again;
    "kernels" raises the library's BackwardKernelError."""
    from .kernel_library import BackwardKernelError

    spec = module.spec_for(K, V)
    failed, held = _LIBRARY_FAILURES.get(spec, (None, False))
    if failed is not None and not held and module.LIBRARIES.holds(spec):
        failed = None   # a library offered (a pack loaded) or registered since the failure: try it
    if failed is None:
        held = module.LIBRARIES.holds(spec)
        try:
            return module.LIBRARIES.get(spec)
        except BackwardKernelError as exc:
            failed = exc
            _LIBRARY_FAILURES[spec] = (exc, held)
            if sequential != "kernels":
                warnings.warn(f"{exc}; {fallback} (the same gradients, slower)", RuntimeWarning, stacklevel=3)
    if sequential == "kernels":
        raise failed
    return None


# The backward libraries that could not be had in this process, by spec (each kind has its own
# spec type): (why, whether a library was offered or registered for it when it failed).
_LIBRARY_FAILURES: dict = {}


def _chain_library_or_none(sequential: str, K: int, V: int):
    """The chain library, or None (_library_or_none): the two chains then run as torch loops."""
    from . import chain_kernels

    return _library_or_none(chain_kernels, sequential, K, V,
                            "the backward runs its two chains as torch loops over chunk positions")


def _chunk_library_or_none(sequential: str, K: int, V: int):
    """The per-chunk gradient library (step 3), or None (_library_or_none): step 3 then runs in torch."""
    from . import chunk_kernels

    return _library_or_none(chunk_kernels, sequential, K, V, "the backward computes its per-chunk gradients in torch")


def _torch_pieces(q_chunks, k_chunks, vc, bc, gc, dOs, group: int) -> dict:
    """The state-independent forward pieces in torch, batched over every chunk (the prep kernel's
    outputs where it runs): gamma, A0, u, PtdO = scale P^T dO, and the chains' w, Kd and D Q."""
    qc, kc = q_chunks.repeat_interleave(group, dim=1), k_chunks.repeat_interleave(group, dim=1)  # [NC, Hv, C, K]
    gamma = gc.cumsum(-1)
    gamma_last = gamma[..., -1]
    Gamma = decay_mask(gamma)                                  # [NC, Hv, C, C]
    A0 = gate_free_inverse(kc, bc)
    Tm = Gamma * A0 * bc[..., None, :]
    d = gamma.exp()[..., None]                                 # D as a column [NC, Hv, C, 1]
    f = (gamma_last[..., None] - gamma).exp()[..., None]       # e^{gamma_C - gamma}
    P = Gamma * (qc @ kc.transpose(-1, -2))
    return dict(gamma=gamma, A0=A0, u=Tm @ vc, w=Tm @ (d * kc), Kd=f * kc, Qd=d * qc,
                PtdO=P.transpose(-1, -2) @ dOs)


def _prep_library_or_none(sequential: str, K: int, V: int):
    """The prep library, or None (_library_or_none): the state-independent pieces then run in torch."""
    from . import prep_kernels

    return _library_or_none(prep_kernels, sequential, K, V,
                            "the backward computes its state-independent pieces in torch")


def _prep_pieces(q_chunks, k_chunks, vc, do_chunks, scale: float, gc, bc, qd_scale: float):
    """The state-independent pieces from the prep kernel (prep_kernels.backward_prep: the chains'
    inputs, gamma and A0), its library had (_prep_library_or_none). q_chunks, k_chunks [NC, Hqk,
    C, K] (normalised where the op normalises), vc and do_chunks views of the chunk layout (dO
    without the scale, which the kernel folds into P^T dO, and qd_scale, its mantissa, into D Q:
    split_scale) in the call's dtype or fp32, gc and bc
    [NC, Hv, C] fp32. Its u and scale P^T dO come in the chain kernels' tiles
    (chain_kernels.add_tiles)."""
    from . import prep_kernels

    K, V = q_chunks.shape[-1], vc.shape[-1]
    spec = prep_kernels.spec_for(K, V)
    op = spec.torch_dtype
    # one copy into the prep's contiguous operand tiles, whatever the views' dtype (a view already
    # in the operand dtype too: .to would hand it back as it is)
    q16, k16 = (torch.empty(x.shape, dtype=op, device=x.device).copy_(x) for x in (q_chunks, k_chunks))
    return prep_kernels.backward_prep(q16, k16, vc, do_chunks, gc.contiguous(), bc.contiguous(), dout_scale=scale,
                                      gated_inverse=False, qd_scale=qd_scale)


def chunk_gated_delta_rule_bwd_torch(
    q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, compute_dtype=torch.float32,
    sequential="auto", cp=None, sequence_tokens=0,
) -> GDNGradients:
    """Gradients of <o, do> + <final_state, dht> for the op's forward (same arguments, the
    forward's o and final state never needed): q, k [B,T,Hqk,K], v and do [B,T,Hv,V], g and beta
    [B,T,Hv], dht and initial_state [N,Hv,K,V] ([N,Hv,V,K] with state_v_first) or None. Computes
    in compute_dtype (fp32; float64 makes it an exact check of the algorithm). sequential picks
    how steps 1 and 2 run (uses_chain_kernels): the chain kernels, whose chunk grid is built on the
    device (device_chunk_grid: no host sync), or the torch loops, which read cu_seqlens on the host
    (one device sync without cu_seqlens_cpu). cp: the forward call's warm-up tables
    (warmup_tables.WarmupTables) or None; with them the chain kernels split long sequences as the
    forward's CP does (chain_segments), guarded, else every sequence is one chain (as the torch loops
    always are). sequence_tokens: 0, or what the host knows of the offsets without reading them
    (the forward's call: batch rows, or a cu_seqlens_cpu): every sequence has exactly that many
    tokens, a multiple of 64, so the chain kernels' grid is an identity (uniform_chunk_grid) and no
    row is gathered; device offsets that disagree make every gradient NaN, never a wrong number."""
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, T) or Hv % Hqk:
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} do not fit")
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv) or do.shape != v.shape:
        raise ValueError(f"g {tuple(g.shape)}, beta {tuple(beta.shape)} must be {(B, T, Hv)} and do "
                         f"{tuple(do.shape)} must be v's {tuple(v.shape)}")
    kernels = uses_chain_kernels(sequential, v.device, compute_dtype, K, V) and (
        _chain_library_or_none(sequential, K, V) is not None)
    offsets_agree = None   # a device bool where the grid is the host's guess of the offsets
    if kernels and B * T > 0 and (cu_seqlens is None or cu_seqlens.numel() > 1):
        # the chains walk the device offsets: the whole backward runs without a host sync
        if cu_seqlens_cpu is not None:
            _host_bounds(B, T, cu_seqlens, cu_seqlens_cpu)   # checked where the host has them
        offsets = (cu_seqlens if cu_seqlens is not None
                   else torch.arange(0, (B + 1) * T, T, dtype=torch.int64, device=v.device))
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got {B}")
        offsets = offsets.to(v.device)
        if sequence_tokens:
            if sequence_tokens % CHUNK or sequence_tokens * (offsets.numel() - 1) != B * T:
                raise ValueError(f"sequence_tokens={sequence_tokens} must be a multiple of {CHUNK} that the "
                                 f"{offsets.numel() - 1} sequences fill the {B * T} token rows with")
            grid = uniform_chunk_grid(offsets.numel() - 1, sequence_tokens, v.device)
            # checked on the device, no host sync: offsets that disagree poison the chains' units
            offsets_agree = (offsets == grid.chunk_offsets * CHUNK).all()
        else:
            grid = device_chunk_grid(offsets, B * T)
    else:
        grid = chunk_grid(_host_bounds(B, T, cu_seqlens, cu_seqlens_cpu), v.device)
    N, NC = grid.num_seqs, grid.num_chunks
    state_shape = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    for name, state in (("initial_state", initial_state), ("dht", dht)):
        if state is not None and tuple(state.shape) != state_shape:
            raise ValueError(f"{name} shape {tuple(state.shape)}, expected {state_shape}")
    scale = K ** -0.5 if scale is None else float(scale)
    scale_mantissa, scale_power = split_scale(scale)   # a scale out of fp32's range is refused here
    dt = compute_dtype
    group = Hv // Hqk

    def flat(x):  # [B, T, ...] -> [B*T, ...] in the compute dtype
        return x.reshape(B * T, *x.shape[2:]).to(dt)

    # With the chain kernels the state-independent pieces come from one prep kernel launch
    # (prep_kernels) and step 3 is one kernel launch (chunk_kernels); each falls back to torch, with
    # one warning, where its library cannot be had. With both, q, k, v and dO are read as the call
    # holds them (fp32, fp16 or bf16; q with k's dtype, v with dO's, as the op's calls have them):
    # in place where the grid is an identity, else gathered in their own dtype.
    from .kernel_library import INPUT_DTYPES, whole_pieces

    prep_kernel = kernels and _prep_library_or_none(sequential, K, V) is not None
    step3_kernel = kernels and _chunk_library_or_none(sequential, K, V) is not None
    in_place = (prep_kernel and step3_kernel and q.dtype == k.dtype and v.dtype == do.dtype
                and {q.dtype, v.dtype} <= set(INPUT_DTYPES))

    def chunks(x, as_is=False):
        # [B, T, ...] -> the chunk layout (a host grid takes the offsets' tokens): in the compute
        # dtype, one conversion copy and a gather unless the grid is an identity; as_is, where the
        # kernels read x as it is, in x's dtype: a view where the grid is an identity and the rows
        # are whole 16-byte pieces (kernel_library.whole_pieces), else a gather
        rows = x.reshape(B * T, *x.shape[2:])[:grid.num_tokens]
        if not (as_is and in_place):
            return chunk_rows(rows, grid, dt)
        return chunk_rows(rows, grid, copy=not whole_pieces(rows))

    def kv_state(x):  # a state in the call's layout -> [N, Hv, K, V] in the compute dtype
        x = x.to(dt)
        return (x.transpose(-1, -2) if state_v_first else x).contiguous()

    if use_qk_l2norm_in_kernel:
        q_raw, k_raw = flat(q), flat(k)
        q_chunks, k_chunks = to_chunks(l2_normalize(q_raw), grid), to_chunks(l2_normalize(k_raw), grid)
    else:
        q_chunks, k_chunks = chunks(q, as_is=True), chunks(k, as_is=True)  # [NC, Hqk, C, K]
    vc = chunks(v, as_is=True)                                 # [NC, Hv, C, V]
    bc = chunks(beta)                                          # [NC, Hv, C]
    gc = chunks(g)                                             # [NC, Hv, C]
    do_chunks = chunks(do, as_is=True)                         # [NC, Hv, C, V], the scale not applied
    h0 = None if initial_state is None else kv_state(initial_state)
    dS_end = None if dht is None else kv_state(dht)
    pieces = _prep_pieces(q_chunks, k_chunks, vc, do_chunks, scale, gc, bc, scale_mantissa) if prep_kernel else None
    # the torch code takes dO with the scale folded in; the kernels fold it in as they read dO
    dOs = None if pieces is not None and step3_kernel else scale * do_chunks
    torch_pieces = None if pieces is not None else _torch_pieces(q_chunks, k_chunks, vc, bc, gc, dOs, group)
    if pieces is not None:
        gamma, A0, u, PtdO = pieces.gamma, pieces.a0, pieces.u, pieces.ptdo
    else:
        gamma, A0, u, PtdO = (torch_pieces[n] for n in ("gamma", "A0", "u", "PtdO"))
    gamma_last = gamma[..., -1]
    if kernels:
        # 1 and 2 as one chain kernel launch each (chain_kernels): 16-bit operands, fp32 chains.
        # Each chain is linear in its inputs per (sequence, v-head): in (u, h0) and in (dO, dht). It
        # runs on them brought near unit magnitude by a power of two per (sequence, v-head) (exact,
        # and independent of what else is in the batch), so that a training step's tiny output
        # gradients neither underflow nor lose their mantissa in the 16-bit operands and a large
        # state does not overflow them; step 3 takes the results so scaled, or they are scaled back.
        # The chains take u and scale P^T dO as the prep wrote them and apply the units as they read.
        from . import chain_kernels

        op = chain_kernels.spec_for(K, V).torch_dtype
        # the chains take the op's scale m 2^e split (split_scale): m in D Q (the prep kernel writes
        # m D Q), 2^e with dO's unit, so that dO is only moved by a power of two before it rounds
        if pieces is not None:
            w_op, Kd_op, Qd_op, chunk_decay = pieces.w, pieces.kd, pieces.qd, pieces.decay
        else:
            w_op, Kd_op = (torch_pieces[n].to(op).contiguous() for n in ("w", "Kd"))
            Qd_op = (scale_mantissa * torch_pieces["Qd"]).to(op).contiguous()
            chunk_decay = gamma_last.exp().contiguous()
        segments, guard = _chain_segments(grid, cp, B * T, gamma_last, bc, k_chunks, group)
        # the chains' units from each tile's largest magnitude: one reduction, or the prep kernel's
        # (for dO read as it stages dO, for u as it stores u)
        dout_amax = pieces.dout_amax if pieces is not None else tile_amax(do_chunks)
        unit_u, unit_u_c = _chain_units(grid, pieces.u_amax if pieces is not None else tile_amax(u), h0, offsets_agree)
        h, Vn, _ = chain_kernels.chain_states(w_op, Kd_op, u, chunk_decay, segments,
                                              None if h0 is None else (h0 * unit_u).contiguous(),
                                              window_log_decay=guard, u_scale=unit_u_c.view(NC, Hv))
        unit_d, unit_d_c = _chain_units(grid, dout_amax, dS_end, offsets_agree, per_chunk_scale=scale)
        dout_op = chain_operand(do_chunks, unit_d_c * scale_power, op)
        dh_out, dVn, dS = chain_kernels.chain_gradients(
            w_op, Kd_op, Qd_op, dout_op, PtdO, chunk_decay, segments,
            None if dS_end is None else (dS_end * unit_d).contiguous(), window_log_decay=guard,
            ptdo_scale=unit_d_c.view(NC, Hv))
        dS = dS / unit_d
        # what only the chains read goes back to the allocator before step 3 allocates its outputs
        pieces = torch_pieces = u = PtdO = w_op = Kd_op = Qd_op = dout_op = None
        if step3_kernel:
            # 3 as one kernel launch on the chains' results as they come, still scaled by the units
            # (16-bit operands, fp32 accumulation; the gradients come back unscaled); q and k per q/k
            # head, and they, v, dO, beta and gamma read in place from their chunk views
            from . import chunk_kernels

            # into token-major chunks with a spare zero chunk, so that each goes back to token rows
            # in one row gather (from_token_major_chunks)
            # (dq and dk per q/k head: the kernel sums them over its v-heads)
            token_major = tuple(token_major_chunks(NC, heads, dims, v.device)
                                for heads, dims in ((Hqk, (K,)), (Hqk, (K,)), (Hv, (V,)), (Hv, ()), (Hv, ())))
            chunk_kernels.chunk_gradients(
                q_chunks, k_chunks, vc, do_chunks, bc, gamma, A0.contiguous(), h, dh_out, Vn, dVn,
                unit_u_c.view(NC, Hv), unit_d_c.view(NC, Hv), dout_scale=scale,
                out=tuple(view for _, view in token_major))
            per_chunk = token_major_out = tuple(buf for buf, _ in token_major)
            # and its inputs before the gradients go back to token rows (the launch holds its own
            # stream order: the allocator hands their memory only to later work on this stream)
            q_chunks = k_chunks = vc = do_chunks = h = dh_out = Vn = dVn = A0 = None
        else:
            h, Vn, dh_out, dVn = h / unit_u_c, Vn / unit_u_c, dh_out / unit_d_c, dVn / unit_d_c
            per_chunk = None
    else:
        tp = torch_pieces
        h, Vn, dh_out, dVn, dS = chains_torch(grid, u, tp["w"], tp["Kd"], gamma_last.exp()[..., None, None], tp["Qd"],
                                              dOs, PtdO, h0, dS_end)
        per_chunk = None
    if per_chunk is None:
        token_major_out = None
        qc, kc = q_chunks.repeat_interleave(group, dim=1), k_chunks.repeat_interleave(group, dim=1)
        Gamma = decay_mask(gamma)                              # [NC, Hv, C, C]
        A = Gamma * A0
        Kdd = gamma.exp()[..., None] * kc
        per_chunk = per_chunk_gradients(qc, kc, vc, bc, dOs, gamma, Gamma, A0, A, A * bc[..., None, :], Kdd,
                                        qc @ kc.transpose(-1, -2), h, dh_out, Vn, dVn)
    dqc, dkc, dvc, dbc, dgc = per_chunk

    def tokens(xc, dtype, heads_summed=False):
        if token_major_out is not None:   # the kernel's token-major chunks, dq and dk summed already
            return from_token_major_chunks(xc, grid, B * T, dtype)
        if heads_summed:  # v-heads -> their q/k head
            xc = xc.view(xc.shape[0], Hqk, group, *xc.shape[2:]).sum(2)
        return from_chunks(xc, grid, B * T).to(dtype)

    # with the l2norm, dq and dk go on through its backward in the compute dtype
    qk_dtypes = (dt, dt) if use_qk_l2norm_in_kernel else (q.dtype, k.dtype)
    dqf, dkf = tokens(dqc, qk_dtypes[0], True), tokens(dkc, qk_dtypes[1], True)
    if use_qk_l2norm_in_kernel:
        dqf, dkf = l2_normalize_backward(q_raw, dqf), l2_normalize_backward(k_raw, dkf)
    dh0 = None
    if initial_state is not None:
        dh0 = (dS.transpose(-1, -2) if state_v_first else dS).contiguous().to(initial_state.dtype)
    return GDNGradients(
        dq=dqf.view(B, T, Hqk, K).to(q.dtype), dk=dkf.view(B, T, Hqk, K).to(k.dtype),
        dv=tokens(dvc, v.dtype).view(B, T, Hv, V),
        dg=tokens(dgc, torch.promote_types(dt, torch.float32)).view(B, T, Hv),
        dbeta=tokens(dbc, beta.dtype).view(B, T, Hv), dh0=dh0)


def per_chunk_gradients(qc, kc, vc, bc, dOs, gamma, Gamma, A0, A, Tm, Kdd, QK, h, dh_out, Vn, dVn):
    """3. Per-chunk gradients, batched over every chunk (the torch path, and the reference the
    per-chunk gradient kernel is tested against): from the chunk-layout inputs [NC, Hv, C, .] (q and k
    repeated over the v-heads, the scaled dO), the in-chunk cumulative gate gamma, the forward pieces
    Gamma, A0, A = Gamma * A0, Tm = A diag(b), Kdd = D K and QK = Q K^T, and the chains' S_c (h),
    dS_{c+1} (dh_out), Vn and dVn -> (dq, dk, dv [NC, Hv, C, .], dbeta, dg [NC, Hv, C]) per v-head,
    dg the reverse cumulative sum of the gate's gradient."""
    d = gamma.exp()[..., None]                                 # D as a column [NC, Hv, C, 1]
    f = (gamma[..., -1:] - gamma).exp()[..., None]             # e^{gamma_C - gamma}
    decay = gamma[..., -1].exp()[..., None, None]              # e^{gamma_C}
    hT = h.transpose(-1, -2)
    dQd = dOs @ hT                                             # [NC, Hv, C, K]
    dP = dOs @ Vn.transpose(-1, -2)                            # [NC, Hv, C, C]
    dKd = Vn @ dh_out.transpose(-1, -2)                        # [NC, Hv, C, K]
    dw = -(dVn @ hT)
    ddecay = (dh_out * h).sum((-2, -1))                        # [NC, Hv]
    dTm = dVn @ vc.transpose(-1, -2) + dw @ Kdd.transpose(-1, -2)
    dvc = Tm.transpose(-1, -2) @ dVn
    dKdd = Tm.transpose(-1, -2) @ dw
    dA = dTm * bc[..., None, :]
    dbc = (dTm * A).sum(-2)
    A0t = A0.transpose(-1, -2)
    dL = torch.tril(-(A0t @ (dA * Gamma) @ A0t), diagonal=-1)  # through the inverse, strictly lower part
    KK = kc @ kc.transpose(-1, -2)
    dbc = dbc + (dL * KK).sum(-1)
    dQK = dP * Gamma
    dqc = dQK @ kc + d * dQd
    dkc = (bc[..., None] * (dL @ kc) + dL.transpose(-1, -2) @ (bc[..., None] * kc)
           + dQK.transpose(-1, -2) @ qc + d * dKdd + f * dKd)
    # the gate, first w.r.t. the in-chunk cumulative gate gamma
    E = (dA * A0 + dP * QK) * Gamma                            # through Gamma_ij = e^{gamma_i - gamma_j}
    df = f[..., 0] * (dKd * kc).sum(-1)
    dgamma = (d[..., 0] * ((dQd * qc).sum(-1) + (dKdd * kc).sum(-1)) + E.sum(-1) - E.sum(-2) - df)
    dgamma[..., -1] += df.sum(-1) + decay[..., 0, 0] * ddecay  # gamma_C: the chunk's last slot (pads carry g = 0)
    dgc = dgamma.flip(-1).cumsum(-1).flip(-1)                  # the reverse cumulative sum: d/dg
    return dqc, dkc, dvc, dbc, dgc


def _chain_segments(grid: ChunkGrid, cp, total_rows: int, gamma_last, bc, k_chunks, group: int):
    """What the chain kernels walk: each sequence whole, or, with the forward call's warm-up tables
    (cp) where a sequence of this call can be long enough to split, the forward's segments with the
    guard's per-chunk input (chain_segments.window_log_decay, from |k|^2 of the keys the kernels see).
    Returns (ChainSegments, window_log_decay or None)."""
    from . import chain_segments

    if cp is not None and cp.splits:
        most = cp.bound(total_rows, grid.num_seqs)
        if most > grid.num_seqs:
            # |k|^2 in one fp32 reduction over k as it is held, no fp32 copy of k   [NC, Hv, C]
            key_norms = torch.linalg.vector_norm(k_chunks, dim=-1, dtype=torch.float32).square()
            key_norms = key_norms.repeat_interleave(group, dim=1)
            return (chain_segments.split_sequences(grid.chunk_offsets, cp.segment_chunks, most, cp.warmup, cp.log_eps),
                    chain_segments.window_log_decay(gamma_last, bc, key_norms))
    return chain_segments.whole_sequences(grid.chunk_offsets), None


FP32_MAX = torch.finfo(torch.float32).max


def split_scale(scale: float) -> tuple[float, float]:
    """The op's scale as m 2^e: (m, 2^e), 1/2 <= |m| < 1 (math.frexp; (0, 0) for a zero scale, whose
    dO term is then zero, not 0 times an overflow). The chains take m in D Q and 2^e with dO's unit, so
    dO is moved by a power of two only and its largest magnitude lands near 1 whatever the scale."""
    if not abs(scale) <= FP32_MAX:
        raise ValueError(f"scale={scale} must be finite and within fp32's range (|scale| <= {FP32_MAX:.4g})")
    mantissa, exponent = math.frexp(scale)
    return mantissa, (math.ldexp(1.0, exponent) if scale != 0.0 else 0.0)


def chain_operand(per_chunk: torch.Tensor, unit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """unit * per_chunk as a contiguous `dtype` tensor, per_chunk [NC, Hv, C, D] (any strides) and unit
    [NC, Hv, 1, 1] fp32 powers of two, rounded once: the product is exact in bf16 (a power of two only
    moves the exponent, and bf16 has fp32's exponent range) and in fp32 (fp16 and fp32 inputs), and
    is rounded to `dtype` as it is copied into the contiguous result."""
    factor = unit.to(torch.bfloat16) if per_chunk.dtype == torch.bfloat16 else unit.float()
    return torch.empty(per_chunk.shape, dtype=dtype, device=per_chunk.device).copy_(per_chunk * factor)


def tile_amax(per_chunk: torch.Tensor) -> torch.Tensor:
    """The largest |x| of each (chunk, v-head) tile of per_chunk [NC, Hv, ...], fp32 [NC, Hv] (exact:
    the largest of a 16-bit tile's values is one of them), NaN where the tile holds a NaN: one
    reduction, no |x| tensor. The prep kernel gives dO's and u's itself (PrepPieces; there a NaN is
    not seen, but it flows on in the values, so a sequence with one still has non-finite results)."""
    return torch.linalg.vector_norm(per_chunk, float("inf"), dim=tuple(range(2, per_chunk.dim()))).float()


def _chain_units(grid: ChunkGrid, chunk_amax: torch.Tensor, per_sequence: torch.Tensor | None,
                 valid: torch.Tensor | None = None, per_chunk_scale: float = 1.0):
    """Powers of two, one per (sequence, v-head), that take the largest magnitude of a chain's inputs
    (per_chunk_scale times the chunks' tiles, whose largest magnitudes chunk_amax [NC, Hv] gives:
    tile_amax, or the prep kernel's; per_sequence [N, Hv, ...] or None) near 1
    (into [1, 2), or just below 1 where fp32's log2 rounds up to a power of two); 1 where they are
    all zero. Returns them as [N, Hv, 1, 1] and per chunk [NC, Hv, 1, 1].
    Computed on the device, no host sync. A non-finite input is not scaled away: its sequence's
    results come out non-finite too; so are all results where `valid` (a device bool) is False."""
    N, Hv = grid.num_seqs, chunk_amax.shape[1]
    if per_chunk_scale != 1.0:
        chunk_amax = chunk_amax * abs(per_chunk_scale)
    owner = grid.chunk_sequence[:, None].expand_as(chunk_amax)
    amax = chunk_amax.new_zeros(N, Hv).scatter_reduce_(0, owner, chunk_amax, "amax")
    if per_sequence is not None:
        amax = torch.maximum(amax, torch.linalg.vector_norm(per_sequence, float("inf"), dim=(-2, -1)))
    # the exponent is clamped so that the unit stays a finite fp32 (amax down to 2^-126)
    exponent = torch.floor(torch.log2(amax)).clamp(min=-126.0)
    unit = torch.where(amax > 0, torch.exp2(-exponent), torch.ones_like(amax))
    unit = torch.where(torch.isnan(amax), amax, unit)
    if valid is not None:
        unit = torch.where(valid, unit, torch.full_like(unit, float("nan")))
    unit = unit[..., None, None]
    return unit, unit[grid.chunk_sequence]


def chains_torch(grid: ChunkGrid, u, w, Kd, decay, Qd, dOs, PtdO, h0, dS_end):
    """Steps 1 and 2 as torch loops over chunk positions, all sequences that have a chunk there in
    lockstep (the CPU path, and the reference the chain kernels are tested against). Per chunk
    [NC, Hv, ...] inputs as the backward builds them, decay e^{gamma_C} as [NC, Hv, 1, 1], h0 and
    dS_end (dht) [N, Hv, K, V] or None -> (S_c, Vn, dS_{c+1}, dVn per chunk, dh0 per sequence)."""
    NC, Hv, _, K = w.shape
    V = u.shape[-1]
    N, dt, dev = grid.num_seqs, u.dtype, u.device
    # 1. Recompute each chunk's incoming state (forward chain over chunk positions).
    S = torch.zeros(N, Hv, K, V, dtype=dt, device=dev) if h0 is None else h0
    h = torch.empty(NC, Hv, K, V, dtype=dt, device=dev)
    for seqs, chunks in grid.steps:
        S_in = S if seqs is None else S.index_select(0, seqs)
        h.index_copy_(0, chunks, S_in)
        V_new = u.index_select(0, chunks) - w.index_select(0, chunks) @ S_in
        S_out = decay.index_select(0, chunks) * S_in + Kd.index_select(0, chunks).transpose(-1, -2) @ V_new
        if seqs is None:
            S = S_out
        else:
            S = S.index_copy(0, seqs, S_out)
    Vn = u - w @ h

    # 2. The state gradient backward over chunk positions: dS_c = M_c^T dS_{c+1} + own-output terms.
    QdtdO = Qd.transpose(-1, -2) @ dOs
    dS = torch.zeros(N, Hv, K, V, dtype=dt, device=dev) if dS_end is None else dS_end.clone()  # never dht itself
    dh_out = torch.empty(NC, Hv, K, V, dtype=dt, device=dev)  # gradient of the state leaving each chunk
    for seqs, chunks in reversed(grid.steps):
        dS_out = dS if seqs is None else dS.index_select(0, seqs)
        dh_out.index_copy_(0, chunks, dS_out)
        dV_new = PtdO.index_select(0, chunks) + Kd.index_select(0, chunks) @ dS_out
        dS_in = (QdtdO.index_select(0, chunks) - w.index_select(0, chunks).transpose(-1, -2) @ dV_new
                 + decay.index_select(0, chunks) * dS_out)
        if seqs is None:
            dS = dS_in
        else:
            dS = dS.index_copy(0, seqs, dS_in)
    dVn = PtdO + Kd @ dh_out
    return h, Vn, dh_out, dVn, dS
