"""Float64 references for KDA, the per-key-channel gate (docs/kda.md):

    S_t = (I - b_t k_t k_t^T) Diag(e^{g_t}) S_{t-1} + b_t k_t v_t^T,   o_t = scale * S_t^T q_t

with g [B, T, Hv, K]. The token recurrence is oracle.recurrent's (it takes a 4-d gate); here are
the gate as the layers compute it, the chunked form the kernels are to implement, the segmented
(warm-up CP) form with its guard, and the window statistic the guard and the calibration use.
Conventions are the scalar-gate oracles': state [N, Hv, K, V] (or [N, Hv, V, K] with
state_v_first), v-head h reads q/k head h // (Hv / Hqk), varlen through cu_seqlens with batch 1,
q/k l2-normalised in the kernel when asked, scale K^-1/2 by default.

Chunked form, per chunk of L tokens and v-head, with gamma_i = sum_{j<=i} g_j (a K-vector per
token) and E_ij = e^{gamma_i - gamma_j} (per channel, i >= j):
    A_ij  = sum_c k_ic k_jc E_ijc  (j < i),      P_ij = sum_c q_ic k_jc E_ijc  (j <= i)
    U     = (I + diag(b) A)^{-1} diag(b) (V - (K * e^gamma) S)      (the rows' new-value terms)
    O     = scale ((Q * e^gamma) S + P U)
    S'    = Diag(e^{gamma_L}) S + (K * e^{gamma_L - gamma})^T U
Unlike the scalar gate, the triangular solve's matrix carries the gate, so no gate-free inverse
factors out. The transition M_c (S' = M_c S + S'(S=0)) is
    M_c = Diag(e^{gamma_L}) - (K * e^{gamma_L - gamma})^T (I + diag(b) A)^{-1} diag(b) (K * e^gamma).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .chunked import CHUNK, head_major
from .common import check_shapes, prepare_inputs, sequence_bounds, state_from_kv, state_to_kv
from .recurrent import recurrent_gated_delta_rule
from .segmented import EXACT, segment_table, segment_transition

# Kimi-Linear's lower bound on the gate where a model sets one (g in (lower_bound, 0)).
KIMI_LOWER_BOUND = -5.0


def kda_gate(a, A_log, dt_bias=None, lower_bound=None):
    """The per-channel log-decay in float64 from the layer's raw gate input a [..., Hv, K],
    A_log [Hv] and dt_bias [Hv * K] (or [Hv, K]):
        without a lower bound: g = -exp(A_log) * softplus(a + dt_bias)        (g <= 0)
        with lower_bound < 0:  g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))  (lower_bound < g < 0)"""
    a = a.to(torch.float64)
    Hv, K = a.shape[-2:]
    x = a if dt_bias is None else a + dt_bias.to(torch.float64).reshape(Hv, K)
    rate = A_log.to(torch.float64).reshape(Hv, 1).exp()
    if lower_bound is None:
        return -rate * torch.nn.functional.softplus(x)
    if not lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound!r} must be negative")
    return lower_bound * torch.sigmoid(rate * x)


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None):
    """The token recurrence (ground truth); g must be per key channel, [B, T, Hv, K]."""
    if g.dim() != 4:
        raise ValueError(f"KDA's gate is per key channel, [B, T, Hv, K]; got shape {tuple(g.shape)}")
    return recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, state_v_first, cu_seqlens)


# ------------------------------------------------------------------------- the chunked form

def _pair_decay(gamma: torch.Tensor) -> torch.Tensor:
    """E_ijc = e^{gamma_ic - gamma_jc} for i >= j, else 0: gamma [Hv, L, K] -> [Hv, L, L, K].
    Formed from differences, so nothing overflows however strong the decay."""
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]
    L = gamma.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=gamma.device).tril()[None, :, :, None]
    return torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()


def _solve_matrix(k_c, b_c, E):
    """I + diag(b) strictly_lower(A): the chunk's unit lower-triangular system, [Hv, L, L]."""
    A = torch.einsum("hic,hjc,hijc->hij", k_c, k_c, E).tril(diagonal=-1)
    L = k_c.shape[1]
    return torch.eye(L, dtype=k_c.dtype, device=k_c.device) + b_c[:, :, None] * A


def kda_chunk_step(S, q_c, k_c, v_c, g_c, b_c, scale):
    """One chunk, head-major q_c, k_c, g_c [Hv, L, K], v_c [Hv, L, V], b_c [Hv, L], state S
    [Hv, K, V]: returns (O [Hv, L, V], S' [Hv, K, V])."""
    gamma = torch.cumsum(g_c, dim=1)
    E = _pair_decay(gamma)
    rhs = b_c[:, :, None] * (v_c - (k_c * gamma.exp()) @ S)
    U = torch.linalg.solve_triangular(_solve_matrix(k_c, b_c, E), rhs, upper=False, unitriangular=True)
    P = torch.einsum("hic,hjc,hijc->hij", q_c, k_c, E)
    O = scale * ((q_c * gamma.exp()) @ S + P @ U)
    last = gamma[:, -1:, :]
    S_next = last.transpose(1, 2).exp() * S + (k_c * (last - gamma).exp()).transpose(1, 2) @ U
    return O, S_next


def kda_chunk_transition(k_c, g_c, b_c):
    """M_c [Hv, K, K], the chunk's action on its incoming state: S' = M_c S + S'(S = 0)."""
    gamma = torch.cumsum(g_c, dim=1)
    last = gamma[:, -1:, :]
    right = b_c[:, :, None] * (k_c * gamma.exp())
    X = torch.linalg.solve_triangular(_solve_matrix(k_c, b_c, _pair_decay(gamma)), right, upper=False,
                                      unitriangular=True)
    return torch.diag_embed(last[:, 0].exp()) - (k_c * (last - gamma).exp()).transpose(1, 2) @ X


def kda_run_chunks(S, q_s, k_s, v_s, g_s, b_s, scale, chunk_size=CHUNK):
    """Run a head-major token range chunk by chunk from S; returns (O [Hv, L, V], S_end)."""
    outs = []
    for c0 in range(0, v_s.shape[1], chunk_size):
        sl = slice(c0, c0 + chunk_size)
        O, S = kda_chunk_step(S, q_s[:, sl], k_s[:, sl], v_s[:, sl], g_s[:, sl], b_s[:, sl], scale)
        outs.append(O)
    return (torch.cat(outs, dim=1) if outs else v_s.new_zeros(v_s.shape)), S


def _initial(initial_state, n, Hv, K, V, state_v_first, device):
    if initial_state is None:
        return torch.zeros(Hv, K, V, dtype=torch.float64, device=device)
    return state_to_kv(initial_state[n].to(torch.float64), state_v_first)


def chunk_kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, chunk_size=CHUNK):
    """The chunked float64 forward; equals recurrent_kda to rounding."""
    if g.dim() != 4:
        raise ValueError(f"KDA's gate is per key channel, [B, T, Hv, K]; got shape {tuple(g.shape)}")
    n_seq, Hv, K, V = check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, True)
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(sequence_bounds(v.shape[0], v.shape[1], cu_seqlens)):
        S = _initial(initial_state, n, Hv, K, V, state_v_first, v.device)
        O, S = kda_run_chunks(S, *head_major(q, k, v, g, beta, b, start, end), scale, chunk_size)
        o[b, start:end] = O.transpose(0, 1)
        finals.append(S)
    final = state_from_kv(torch.stack(finals), state_v_first) if output_final_state else None
    return o, final


# ------------------------------------------------------------------ the warm-up bound and guard

def least_decay_per_token(g: torch.Tensor) -> torch.Tensor:
    """max_k g_{t,k}: each token's least-negative channel gate, [..., K] -> [...]. The decay
    Diag(e^{g_t}) has spectral norm e^{max_k g_{t,k}}; this is the only per-token quantity that
    bounds it."""
    return g.max(dim=-1).values


def kda_window_statistic(g_w: torch.Tensor) -> float:
    """sum_t max_k g_{t,k} over one head's window (g_w [L, K]): the log of the bound on the norm
    of the window's transition product."""
    return float(least_decay_per_token(g_w.to(torch.float64)).sum())


def kda_window_is_safe(k_w, g_w, b_w, guard_eps: float) -> bool:
    """The guard for one head's window (k_w, g_w [L, K], b_w [L]): the window statistic reaches
    log(guard_eps) and every (I - b k k^T) has spectral norm <= 1 (0 <= b ||k||^2 <= 2). Then
    ||prod_t (I - b_t k_t k_t^T) Diag(e^{g_t})|| <= e^{statistic} <= guard_eps."""
    if kda_window_statistic(g_w) > math.log(guard_eps):
        return False
    bk2 = b_w.to(torch.float64) * (k_w.to(torch.float64) ** 2).sum(-1)
    return bool(((bk2 >= 0) & (bk2 <= 2)).all())


# --------------------------------------------------------------------------- the segmented form

@dataclass
class KDASegmentedResult:
    o: torch.Tensor                 # [B, T, Hv, V] float64
    final_state: torch.Tensor       # [N, Hv, K, V] (or V, K) float64
    segment_initial_states: list    # per sequence: [num_segments, Hv, K, V] float64 (kv layout), as used
    exact_initial_states: list      # per sequence: the same, chained exactly through the whole sequence
    window_start_states: list       # per sequence: [num_segments, Hv, K, V]: the exact state where each
    #                                 window starts (S_w), zero where no window was used
    window_statistics: list         # per sequence: float64 [num_segments, Hv]: the window statistic, nan
    #                                 where no window was asked for or it reached the sequence start
    used_warmup: list               # per sequence: bool [num_segments, Hv], True where a window was used


def segmented_kda(q, k, v, g, beta, boundaries, warmup, scale=None, initial_state=None,
                  use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, chunk_size=CHUNK,
                  guard_eps: float | None = None) -> KDASegmentedResult:
    """The warm-up CP forward for KDA, as oracle.segmented's for the scalar gate: boundaries per
    sequence (chunk-aligned token offsets inside (0, length)); warmup per sequence an int tensor
    [num_segments, Hv] (row 0 ignored): n >= 1 starts the segment from a zero state run over the
    n chunks before its boundary (from the sequence's initial state where the window reaches the
    sequence start: then nothing is approximated), -1 chains exactly through the previous
    segment's transition. With guard_eps a window is used only where kda_window_is_safe holds."""
    if g.dim() != 4:
        raise ValueError(f"KDA's gate is per key channel, [B, T, Hv, K]; got shape {tuple(g.shape)}")
    if guard_eps is not None and not 0.0 < guard_eps < 1.0:
        raise ValueError(f"guard_eps={guard_eps!r} must be in (0, 1)")
    n_seq, Hv, K, V = check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, True)
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    seqs = sequence_bounds(v.shape[0], v.shape[1], cu_seqlens)
    if len(boundaries) != len(seqs) or len(warmup) != len(seqs):
        raise ValueError(f"need boundaries and warmup for each of the {len(seqs)} sequences")
    o = torch.zeros_like(v)
    finals, inits, exact_inits, starts, stats, used = [], [], [], [], [], []
    for n, (b, start, end) in enumerate(seqs):
        length = end - start
        cuts, table = segment_table(n, length, boundaries[n], warmup[n], Hv, chunk_size)
        h0 = _initial(initial_state, n, Hv, K, V, state_v_first, v.device)
        seq = head_major(q, k, v, g, beta, b, start, end)
        edges = [0] + cuts + [length]
        num_segments = len(edges) - 1
        # the exact state at every chunk start, for the windows' S_w and the exact reference
        exact_at, S = {0: h0}, h0
        for c0 in range(0, length, chunk_size):
            _, S = kda_run_chunks(S, *[x[:, c0:c0 + chunk_size] for x in seq], scale, chunk_size)
            exact_at[min(c0 + chunk_size, length)] = S
        S_init = [h0]
        warmed = torch.zeros(num_segments, Hv, dtype=torch.bool)
        window_stat = torch.full((num_segments, Hv), float("nan"), dtype=torch.float64)
        window_start = torch.zeros(num_segments, Hv, K, V, dtype=torch.float64, device=v.device)
        for s in range(1, num_segments):
            lo, hi = edges[s - 1], edges[s]
            prev = [x[:, lo:hi] for x in seq]
            _, H_prev = kda_run_chunks(torch.zeros_like(h0), *prev, scale, chunk_size)
            M_prev = segment_transition(prev[1], prev[3], prev[4], chunk_size, transition=kda_chunk_transition)
            chosen = M_prev @ S_init[-1] + H_prev
            for h in range(Hv):
                n_warm = int(table[s, h])
                if n_warm == EXACT:
                    continue
                w = hi - n_warm * chunk_size
                if w <= 0:
                    window = [x[h:h + 1, 0:hi] for x in seq]
                    chosen[h] = kda_run_chunks(h0[h:h + 1], *window, scale, chunk_size)[1][0]
                    continue
                window = [x[h:h + 1, w:hi] for x in seq]
                window_stat[s, h] = kda_window_statistic(window[3][0])
                if guard_eps is not None and not kda_window_is_safe(window[1][0], window[3][0], window[4][0],
                                                                    guard_eps):
                    continue  # the guard refuses this window: keep the exact state
                chosen[h] = kda_run_chunks(torch.zeros_like(h0[h:h + 1]), *window, scale, chunk_size)[1][0]
                window_start[s, h] = exact_at[w][h]
                warmed[s, h] = True
            S_init.append(chosen)
        S = h0
        for s in range(num_segments):
            lo, hi = edges[s], edges[s + 1]
            O, S = kda_run_chunks(S_init[s], *[x[:, lo:hi] for x in seq], scale, chunk_size)
            o[b, start + lo:start + hi] = O.transpose(0, 1)
        finals.append(S)
        inits.append(torch.stack(S_init))
        exact_inits.append(torch.stack([exact_at[edges[s]] for s in range(num_segments)]))
        starts.append(window_start)
        stats.append(window_stat)
        used.append(warmed)
    return KDASegmentedResult(o=o, final_state=state_from_kv(torch.stack(finals), state_v_first),
                              segment_initial_states=inits, exact_initial_states=exact_inits,
                              window_start_states=starts, window_statistics=stats, used_warmup=used)


__all__ = ["KDASegmentedResult", "KIMI_LOWER_BOUND", "chunk_kda_chunked", "kda_chunk_step", "kda_chunk_transition",
           "kda_gate", "kda_run_chunks", "kda_window_is_safe", "kda_window_statistic", "least_decay_per_token",
           "recurrent_kda", "segmented_kda"]
