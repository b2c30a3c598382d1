"""The segmented (warm-up context-parallel) forward in float64.

Computes exactly what the CP kernels compute, so the approximation can be studied on the CPU.
A sequence is cut at chunk-aligned token offsets into segments. Segment 0 starts from the
sequence's initial state. For segment s > 0 and v-head h, warmup[s, h] says how its initial
state is found:
  n >= 1  warm-up: run the n chunks before the boundary from a zero state; where that window
          reaches back to the sequence start, run from the sequence's initial state instead
          (then nothing is approximated);
  -1      exact: chain through the previous segment, S_s = M_{s-1} S_{s-1} + H_{s-1}, with M the
          product of the previous segment's chunk transitions and H its zero-state end state.

With guard_eps set, a warm-up window is used only where the approximation is provably within
guard_eps * ||S_w|| on this very input (DESIGN.md, "The math"): the window's summed log-decay is
at most log(guard_eps) and every token in it has 0 <= b ||k||^2 <= 2. Any other window is
chained exactly, as the kernels' in-kernel guard must do.
"""
from __future__ import annotations

from dataclasses import dataclass

import math

import torch

from .chunked import CHUNK, chunk_step, chunk_transition, head_major, run_chunks
from .common import check_shapes, prepare_inputs, sequence_bounds, state_from_kv, state_to_kv

EXACT = -1


def segment_table(n: int, length: int, boundaries, warmup, Hv: int, chunk_size: int = CHUNK):
    """Sequence n's cut positions and its [segments, Hv] warm-up table, checked: cuts increasing,
    inside (0, length) and multiples of chunk_size; entries >= 1 or EXACT."""
    cuts = [int(x) for x in boundaries]
    if any(c <= 0 or c >= length or c % chunk_size for c in cuts) or cuts != sorted(set(cuts)):
        raise ValueError(f"sequence {n} (length {length}): boundaries {cuts} must be increasing, "
                         f"inside (0, {length}) and multiples of {chunk_size}")
    table = torch.as_tensor(warmup, dtype=torch.int64)
    if tuple(table.shape) != (len(cuts) + 1, Hv):
        raise ValueError(f"sequence {n}: warmup shape {tuple(table.shape)}, expected {(len(cuts) + 1, Hv)}")
    if ((table == 0) | (table < EXACT)).any():
        raise ValueError(f"sequence {n}: warmup entries must be >= 1 or {EXACT} (exact)")
    return cuts, table



@dataclass
class SegmentedResult:
    o: torch.Tensor                      # [B, T, Hv, V] float64
    final_state: torch.Tensor            # [N, Hv, K, V] (or V, K) float64
    segment_initial_states: list         # per sequence: [num_segments, Hv, K, V] float64 (kv layout)
    used_warmup: list                    # per sequence: bool [num_segments, Hv], True where a window was used


def uniform_boundaries(seq_len: int, segment_chunks: int, chunk_size: int = CHUNK) -> list[int]:
    """Boundaries every segment_chunks chunks; the last segment takes the remainder."""
    step = segment_chunks * chunk_size
    return list(range(step, seq_len, step))


def window_is_safe(k_w, g_w, b_w, guard_eps: float) -> bool:
    """The guard for one head's window (head-major slices [L, K], [L], [L]): decays to
    log(guard_eps) and every (I - b k k^T) has spectral norm <= 1."""
    if float(g_w.sum()) > math.log(guard_eps):
        return False
    bk2 = b_w * (k_w * k_w).sum(-1)
    return bool(((bk2 >= 0) & (bk2 <= 2)).all())


def segment_transition(k_s, g_s, b_s, chunk_size, transition=chunk_transition):
    """The product of a segment's chunk transitions, [Hv, K, K], by `transition` per chunk (the
    scalar gate's by default; KDA's takes the per-key gate)."""
    Hv, _, K = k_s.shape
    M = torch.eye(K, dtype=k_s.dtype, device=k_s.device).expand(Hv, K, K)
    for c0 in range(0, k_s.shape[1], chunk_size):
        sl = slice(c0, c0 + chunk_size)
        M = transition(k_s[:, sl], g_s[:, sl], b_s[:, sl]) @ M
    return M


def segmented_gated_delta_rule(
    q, k, v, g, beta, boundaries, warmup, scale=None, initial_state=None,
    use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, chunk_size=CHUNK,
    guard_eps: float | None = None,
) -> SegmentedResult:
    """boundaries: per sequence, a list of chunk-aligned token offsets inside (0, length);
    warmup: per sequence, an int tensor [num_segments, Hv] (row 0 is ignored); guard_eps: see
    the module docstring (None: every requested window is used)."""
    if guard_eps is not None and not 0.0 < guard_eps < 1.0:
        raise ValueError(f"guard_eps={guard_eps!r} must be in (0, 1)")
    n_seq, Hv, K, V = check_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    seqs = sequence_bounds(v.shape[0], v.shape[1], cu_seqlens)
    if len(boundaries) != len(seqs) or len(warmup) != len(seqs):
        raise ValueError(f"need boundaries and warmup for each of the {len(seqs)} sequences")
    o = torch.zeros_like(v)
    finals, inits, used = [], [], []
    for n, (b, start, end) in enumerate(seqs):
        length = end - start
        cuts, table = segment_table(n, length, boundaries[n], warmup[n], Hv, chunk_size)
        h0 = (torch.zeros(Hv, K, V, dtype=torch.float64, device=v.device) if initial_state is None
              else state_to_kv(initial_state[n].to(torch.float64), state_v_first))
        seq = head_major(q, k, v, g, beta, b, start, end)
        edges = [0] + cuts + [length]
        S_init = [h0]
        warmed = torch.zeros(len(edges) - 1, Hv, dtype=torch.bool)
        for s in range(1, len(edges) - 1):
            lo, hi = edges[s - 1], edges[s]
            prev = [x[:, lo:hi] for x in seq]
            # exact chaining through the previous segment's transition and zero-state end state
            _, H_prev = run_chunks(torch.zeros_like(h0), *prev, scale, chunk_size)
            M_prev = segment_transition(prev[1], prev[3], prev[4], chunk_size)
            exact = M_prev @ S_init[-1] + H_prev
            # warm-up, per head with its own window
            chosen = exact.clone()
            for h in range(Hv):
                n_warm = int(table[s, h])
                if n_warm == EXACT:
                    continue
                w = hi - n_warm * chunk_size
                if w <= 0:
                    window = [x[h:h + 1, 0:hi] for x in seq]
                    _, S_h = run_chunks(h0[h:h + 1], *window, scale, chunk_size)
                else:
                    window = [x[h:h + 1, w:hi] for x in seq]
                    if guard_eps is not None and not window_is_safe(window[1][0], window[3][0], window[4][0],
                                                                    guard_eps):
                        continue  # the guard refuses this window: keep the exact state
                    _, S_h = run_chunks(torch.zeros_like(h0[h:h + 1]), *window, scale, chunk_size)
                    warmed[s, h] = True
                chosen[h] = S_h[0]
            S_init.append(chosen)
        S = None
        for s in range(len(edges) - 1):
            lo, hi = edges[s], edges[s + 1]
            O, S = run_chunks(S_init[s], *[x[:, lo:hi] for x in seq], scale, chunk_size)
            o[b, start + lo:start + hi] = O.transpose(0, 1)
        finals.append(S if S is not None else h0)
        inits.append(torch.stack(S_init))
        used.append(warmed)
    return SegmentedResult(o=o, final_state=state_from_kv(torch.stack(finals), state_v_first),
                           segment_initial_states=inits, used_warmup=used)


# ---------------------------------------------------------------- the backward's reverse chain
#
# The state gradient runs backward: with dS_c the gradient of the state entering chunk c,
# dS_c = M_c^T dS_{c+1} + (the terms from chunk c's own outputs), M_c the chunk transition. A
# segment's reverse chain needs the gradient at its end. Warm-up in reverse: run the n chunks
# after the end from a zero gradient. The dropped term is Phi^T dS_w, Phi the product of the
# window's transitions and dS_w the exact gradient at the window's far end; ||Phi^T|| = ||Phi||
# <= e^{sum of g over the window} under 0 <= b ||k||^2 <= 2, so the forward's guard bounds it by
# eps * ||dS_w|| unchanged. A window that reaches past the sequence end starts from the final
# state's gradient instead: nothing is approximated.


@dataclass
class SegmentedStateGradient:
    initial_state_gradient: torch.Tensor  # [N, Hv, K, V] (or V, K) float64: the segmented reverse chain's dh0
    end_gradients: list                   # per sequence: [num_segments, Hv, K, V] float64 (kv layout), the
    #                                       gradient each segment's reverse chain starts from (the last: dht)
    exact_end_gradients: list             # the same, chained exactly through the whole sequence
    window_end_gradients: list            # per sequence: [num_segments, Hv, K, V]: the exact gradient at each
    #                                       window's far end (dS_w), zero where no window was used
    used_warmup: list                     # per sequence: bool [num_segments, Hv], True where a window was used


def chunk_state_gradient(dS_out, q_c, k_c, v_c, g_c, b_c, do_c, scale):
    """The gradient of the state entering one chunk (head-major [Hv, L, ...] slices), given the
    gradient dS_out of the state leaving it and the chunk's output gradient do_c: M_c^T dS_out
    plus the own-output terms. The chunk is affine in its incoming state, so autograd at a zero
    state gives it exactly."""
    S = torch.zeros_like(dS_out).requires_grad_(True)
    with torch.enable_grad():
        O, S_next = chunk_step(S, q_c, k_c, v_c, g_c, b_c, scale)
        (dS_in,) = torch.autograd.grad((O * do_c).sum() + (S_next * dS_out).sum(), S)
    return dS_in


def reverse_chunks(dS_end, q_s, k_s, v_s, g_s, b_s, do_s, scale, chunk_size=CHUNK, record=None):
    """Run the reverse chain over a head-major token range from the gradient at its end; returns
    the gradient at its start. record (a dict) gets the gradient at every chunk start offset."""
    dS = dS_end
    L = v_s.shape[1]
    for c0 in reversed(range(0, L, chunk_size)):
        sl = slice(c0, c0 + chunk_size)
        dS = chunk_state_gradient(dS, q_s[:, sl], k_s[:, sl], v_s[:, sl], g_s[:, sl], b_s[:, sl], do_s[:, sl], scale)
        if record is not None:
            record[c0] = dS
    return dS


def segmented_state_gradient(
    q, k, v, g, beta, do, boundaries, warmup, dht=None, scale=None, use_qk_l2norm_in_kernel=False,
    state_v_first=False, cu_seqlens=None, chunk_size=CHUNK, guard_eps: float | None = None,
) -> SegmentedStateGradient:
    """The backward's state gradient with the sequence cut into segments, as a CP backward computes
    it. boundaries as for segmented_gated_delta_rule; warmup[n] [num_segments, Hv]: for segment s
    (all but the last, whose row is ignored) and v-head h, n >= 1 runs the n chunks after the
    segment's end from a zero gradient (from dht where the window reaches the sequence end), -1
    chains exactly. guard_eps: a window is used only where window_is_safe holds on its tokens,
    else the gradient is chained exactly. dht: the final state's gradient (zero when None)."""
    if guard_eps is not None and not 0.0 < guard_eps < 1.0:
        raise ValueError(f"guard_eps={guard_eps!r} must be in (0, 1)")
    n_seq, Hv, K, V = check_shapes(q, k, v, g, beta, dht, cu_seqlens, state_v_first)
    if tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do shape {tuple(do.shape)}, expected v's {tuple(v.shape)}")
    q, k, v, g, beta, scale = prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    do = do.to(torch.float64)
    seqs = sequence_bounds(v.shape[0], v.shape[1], cu_seqlens)
    if len(boundaries) != len(seqs) or len(warmup) != len(seqs):
        raise ValueError(f"need boundaries and warmup for each of the {len(seqs)} sequences")
    dh0s, ends, exact_ends, window_ends, used = [], [], [], [], []
    for n, (b, start, end) in enumerate(seqs):
        length = end - start
        cuts, table = segment_table(n, length, boundaries[n], warmup[n], Hv, chunk_size)
        dS_T = (torch.zeros(Hv, K, V, dtype=torch.float64, device=v.device) if dht is None
                else state_to_kv(dht[n].to(torch.float64), state_v_first))
        seq = (*head_major(q, k, v, g, beta, b, start, end), do[b, start:end].transpose(0, 1))
        exact_at = {length: dS_T}
        reverse_chunks(dS_T, *seq, scale, chunk_size, record=exact_at)
        edges = [0] + cuts + [length]
        num_segments = len(edges) - 1
        chosen = [exact_at[edges[s + 1]].clone() for s in range(num_segments)]
        far = torch.zeros(num_segments, Hv, K, V, dtype=torch.float64, device=v.device)
        warmed = torch.zeros(num_segments, Hv, dtype=torch.bool)
        for s in range(num_segments - 1):
            hi = edges[s + 1]
            for h in range(Hv):
                n_warm = int(table[s, h])
                if n_warm == EXACT:
                    continue
                w = hi + n_warm * chunk_size
                if w >= length:  # the window reaches the sequence end: start from dht, exactly
                    window = [x[h:h + 1, hi:length] for x in seq]
                    chosen[s][h] = reverse_chunks(dS_T[h:h + 1], *window, scale, chunk_size)[0]
                    continue
                window = [x[h:h + 1, hi:w] for x in seq]
                if guard_eps is not None and not window_is_safe(window[1][0], window[3][0], window[4][0], guard_eps):
                    continue  # the guard refuses this window: keep the exact gradient
                chosen[s][h] = reverse_chunks(torch.zeros_like(dS_T[h:h + 1]), *window, scale, chunk_size)[0]
                far[s, h] = exact_at[w][h]
                warmed[s, h] = True
        dS = None
        for s in reversed(range(num_segments)):
            lo, hi = edges[s], edges[s + 1]
            dS = reverse_chunks(chosen[s], *[x[:, lo:hi] for x in seq], scale, chunk_size)
        dh0s.append(dS if dS is not None else dS_T)
        ends.append(torch.stack(chosen) if chosen else dS_T.new_zeros((0, Hv, K, V)))
        exact_ends.append(torch.stack([exact_at[edges[s + 1]] for s in range(num_segments)]) if chosen
                          else dS_T.new_zeros((0, Hv, K, V)))
        window_ends.append(far)
        used.append(warmed)
    return SegmentedStateGradient(initial_state_gradient=state_from_kv(torch.stack(dh0s), state_v_first),
                                  end_gradients=ends, exact_end_gradients=exact_ends,
                                  window_end_gradients=window_ends, used_warmup=used)
