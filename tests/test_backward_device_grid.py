"""The backward's sync-free path (chunked_torch.device_chunk_grid), on the CPU.

Where the chain kernels run, the backward builds its chunk grid from the device offsets with
device ops only, so nothing waits for the GPU and a training step can be captured in a CUDA graph.
Here the grid is checked against the host grid it replaces, and the whole backward through it
against the torch-loop path, with the chain kernels replaced by a named CPU test double that walks
the same chunk layout and offsets, and the per-chunk gradient kernel by one that computes its results
in torch (the kernels themselves: tests/test_gpu_backward_chain.py, tests/test_gpu_backward_chunk.py):
varlen with tails, empty sequences, rows past the last offset, GVA, h0 and dht, both layouts, the
in-kernel L2 norm, and output gradients far below fp16's normal range.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from gdn_inputs import rel_l2
from test_backward_reference import draw

from flashqla_tune.backward import chain_kernels, chain_segments, chunk_kernels, chunked_torch
from flashqla_tune.backward.chunked_torch import chunk_gated_delta_rule_bwd_torch
from flashqla_tune.oracle.chunked import decay_mask

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.mark.parametrize("seqlens, tail", [([1, 0, 130, 64, 65, 300], 0), ([200], 37), ([0, 70], 5), ([64], 0)])
def test_the_device_grid_moves_rows_as_the_host_grid_does(seqlens, tail):
    total = sum(seqlens) + tail
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    host = chunked_torch.chunk_grid(tuple(cu.tolist()), torch.device("cpu"))
    dev = chunked_torch.device_chunk_grid(cu, total)
    assert dev.num_seqs == host.num_seqs and dev.num_chunks >= host.num_chunks and dev.steps is None
    assert torch.equal(dev.chunk_offsets, host.chunk_offsets)
    assert torch.equal(dev.chunk_sequence[:host.num_chunks], host.chunk_sequence)
    x = torch.randn(total, 3, 5)
    chunks = chunked_torch.to_chunks(x, dev)
    assert torch.equal(chunks[:host.num_chunks], chunked_torch.to_chunks(x, host))
    assert not chunks[host.num_chunks:].any()            # the spare chunks hold zeros
    y = torch.randn(dev.num_chunks, 3, 64, 5)
    back = chunked_torch.from_chunks(y, dev, total)
    assert torch.equal(back, chunked_torch.from_chunks(y[:host.num_chunks], host, total))
    for grid in (dev, host):   # the kernel's token-major chunks: one gather
        nc = grid.num_chunks
        buf, view = chunked_torch.token_major_chunks(nc, 4, (5,), torch.device("cpu"))
        view.copy_(torch.randn(nc, 4, 64, 5))
        assert torch.equal(chunked_torch.from_token_major_chunks(buf, grid, total),
                           chunked_torch.from_chunks(view, grid, total))
        # rounded before the gather: the same as rounding the gathered rows
        assert torch.equal(chunked_torch.from_token_major_chunks(buf, grid, total, torch.bfloat16),
                           chunked_torch.from_chunks(view, grid, total).bfloat16())
    padded = chunked_torch.padded_rows(x.double(), torch.float32)
    assert padded.dtype == torch.float32 and not padded[-1].any()
    assert torch.equal(chunked_torch.gather_chunks(padded, dev), chunks)


@pytest.mark.parametrize("make", ["host", "uniform"])
def test_an_identity_grid_moves_rows_as_a_gathering_grid_does(make):
    """Sequences of whole chunks: the grid is an identity (chunk_grid sees it in the offsets,
    uniform_chunk_grid is told it), and its views and copies move every row as the same grid
    with gathers does, rows past the sequences zero."""
    total, tail = 3 * 128, 40
    grid = (chunked_torch.chunk_grid((0, 128, 256, 384), torch.device("cpu")) if make == "host"
            else chunked_torch.uniform_chunk_grid(3, 128, torch.device("cpu")))
    gathering = dataclasses.replace(grid, identity=False)
    assert grid.identity and grid.num_chunks == 6 and torch.equal(grid.chunk_offsets, torch.tensor([0, 2, 4, 6]))
    assert torch.equal(grid.chunk_sequence, torch.tensor([0, 0, 1, 1, 2, 2]))
    x = torch.randn(total + tail, 4, 5)
    chunks = chunked_torch.to_chunks(x, grid)
    assert torch.equal(chunks, chunked_torch.to_chunks(x, gathering))
    assert chunks.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()   # a copy, never the input
    assert chunked_torch.chunk_rows(x[:total], grid, torch.float64).dtype == torch.float64
    y = torch.randn(6, 4, 64, 5)
    for rows in (total, total + tail):
        assert torch.equal(chunked_torch.from_chunks(y, grid, rows), chunked_torch.from_chunks(y, gathering, rows))
        buf, view = chunked_torch.token_major_chunks(6, 4, (5,), torch.device("cpu"))
        view.copy_(y)
        assert torch.equal(chunked_torch.from_token_major_chunks(buf, grid, rows, torch.bfloat16),
                           chunked_torch.from_token_major_chunks(buf, gathering, rows, torch.bfloat16))
    assert not chunked_torch.chunk_grid((0, 128, 200), torch.device("cpu")).identity
    with pytest.raises(ValueError, match="multiple of 64 tokens, got 2 sequences of 100"):
        chunked_torch.uniform_chunk_grid(2, 100, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_the_kernels_read_in_place_are_views_only_where_they_can(dtype):
    """chunk_rows(copy=False): the kernels' inputs in the call's dtype. An identity grid over rows of
    whole 16-byte pieces gives a view of the rows themselves (no copy); any other grid gathers
    (a fresh buffer, pad slots zero), and rows that are not whole pieces are copied
    (kernel_library.whole_pieces)."""
    from flashqla_tune.backward.kernel_library import whole_pieces

    piece = 16 // torch.empty((), dtype=dtype).element_size()
    grid = chunked_torch.uniform_chunk_grid(2, 128, torch.device("cpu"))
    x = torch.randn(256, 4, 2 * piece).to(dtype)
    assert whole_pieces(x)
    view = chunked_torch.chunk_rows(x, grid, copy=False)
    assert view.dtype == dtype and view.data_ptr() == x.data_ptr() and view.shape == (4, 4, 64, 2 * piece)
    assert torch.equal(view, chunked_torch.to_chunks(x, grid))
    copied = chunked_torch.chunk_rows(x, grid)
    assert copied.data_ptr() != x.data_ptr() and torch.equal(copied, view)
    host = chunked_torch.chunk_grid((0, 100, 256), torch.device("cpu"))
    gathered = chunked_torch.chunk_rows(x, host, copy=False)
    assert gathered.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert torch.equal(gathered, chunked_torch.to_chunks(x, host))
    odd = torch.randn(256, 4, 2 * piece + 1).to(dtype)[..., 1:]   # columns start off a piece
    assert not whole_pieces(odd)
    assert not whole_pieces(x.transpose(1, 2))     # columns not contiguous


def test_the_forwards_host_names_one_length_only_when_it_fixes_every_sequence():
    from flashqla_tune.ops import uniform_sequence_tokens

    cu = torch.zeros(3)   # device offsets: never read
    assert uniform_sequence_tokens(2048, None, None) == 2048              # batch rows of 2048
    assert uniform_sequence_tokens(2000, None, None) == 0                 # rows not whole chunks
    assert uniform_sequence_tokens(4096, cu, [0, 2048, 4096]) == 2048     # equal lengths
    assert uniform_sequence_tokens(32768, cu[:2], torch.tensor([0, 32768])) == 32768
    assert uniform_sequence_tokens(4096, cu, None) == 0                   # unknown
    assert uniform_sequence_tokens(4000, cu, [0, 2000, 4000]) == 0        # not whole chunks
    assert uniform_sequence_tokens(192, cu, [0, 64, 128, 160]) == 0       # a shorter one, rows past the end
    assert uniform_sequence_tokens(128, cu, [0, 64, 64]) == 0             # an empty one, rows past the end
    assert uniform_sequence_tokens(192, cu, [0, 64, 128]) == 0            # equal lengths, rows past the end


def test_the_device_grid_stays_in_bounds_whatever_the_offsets_hold():
    for cu in ([0, 500, 100, 90], [-7, 30, 2 ** 40, 60], [5, 5, 5]):
        grid = chunked_torch.device_chunk_grid(torch.tensor(cu), 80)
        assert 0 <= int(grid.token_slot.min()) and int(grid.token_slot.max()) <= grid.num_chunks * 64
        assert 0 <= int(grid.slot_token.min()) and int(grid.slot_token.max()) <= 80
        assert int(grid.chunk_offsets[-1]) <= grid.num_chunks
        assert torch.all(grid.chunk_offsets[1:] >= grid.chunk_offsets[:-1])


class ChainKernelsDouble:
    """Test double of chain_kernels.chain_states / chain_gradients: the same arguments (16-bit operands,
    fp32 terms as [chunks, Hv, 64, V] or the kernels' add tiles, each times its per-chunk scale where
    one is given, device segments with the guard's input), the same recurrences walked per segment and
    v-head on the CPU in fp32 with the kernels' warm-up rule (csrc/gdn_bwd_chain.cuh chain_range), every
    chunk's state and values stored in the operand dtype and the end states in fp32, as the kernels do,
    and NaN in every chunk no segment stores, as the kernels leave those unwritten."""

    def __init__(self):
        self.calls = []
        self.warm_windows = 0     # windows taken (not refused by the guard), over both directions
        self.inputs = []          # the per-chunk kernel's q, v and dO, per call

    @staticmethod
    def _outputs(w, add, segments):
        NC, Hv, C, K = w.shape
        V, N = add.shape[-1], segments.num_seqs
        nan, op = float("nan"), w.dtype
        return (torch.full((NC, Hv, K, V), nan, dtype=op), torch.full((NC, Hv, C, V), nan, dtype=op),
                torch.full((N, Hv, K, V), nan))

    def _walks(self, segments, guard, backward):
        """(v-head, chunks in walk order, warm-up iterations, sequence, from state_in, to state_out) per
        used segment and v-head."""
        Hv = segments.warmup.numel() if segments.splits else None
        for first, begin, end, last, seq in segments.table.tolist():
            if seq < 0:
                continue
            for hv in range(Hv if Hv is not None else 1):
                n = int(segments.warmup[hv]) if segments.splits else 0
                warm, lo, hi = False, 0, 0
                if (end < last) if backward else (begin > first):
                    lo, hi = (end, end + n) if backward else (begin - n, begin)
                    if n > 0 and ((hi < last) if backward else (lo > first)):
                        warm = float(guard[lo:hi, hv].sum()) <= segments.log_eps
                self.warm_windows += warm
                if backward:
                    stop = hi if warm else last
                    yield hv, list(reversed(range(begin, stop))), stop - end, seq, not warm, begin == first
                else:
                    start = lo if warm else first
                    yield hv, list(range(start, end)), begin - start, seq, not warm, end == last

    @staticmethod
    def _add_term(add, scale):
        """The fp32 term as [chunks, Hv, 64, V], times its per-chunk scale."""
        rows = chain_kernels.from_add_tiles(add) if add.dim() == 5 else add
        return rows if scale is None else rows * scale[..., None, None]

    def chain_states(self, w, kd, u, decay, segments, h0=None, values=True, out=None, window_log_decay=None,
                     u_scale=None):
        self.calls.append("states")
        u = self._add_term(u, u_scale)
        states, news, final = self._outputs(w, u, segments)
        for hv, chunks, skip, seq, from_state, to_state in self._walks(segments, window_log_decay, False):
            heads = hv if segments.splits else slice(None)
            S = torch.zeros(states[0, heads].shape) if h0 is None or not from_state else h0[seq, heads].clone()
            for i, c in enumerate(chunks):
                new = u[c, heads] - w[c, heads].float() @ S
                if i >= skip:
                    states[c, heads], news[c, heads] = S, new
                dc = decay[c, heads][..., None, None] if not segments.splits else decay[c, heads]
                S = dc * S + kd[c, heads].float().transpose(-1, -2) @ new
            if to_state:
                final[seq, heads] = S
        return states, news, final

    def chain_gradients(self, w, kd, qd, dout, ptdo, decay, segments, dht=None, values=True, out=None,
                        window_log_decay=None, ptdo_scale=None):
        self.calls.append("gradients")
        ptdo = self._add_term(ptdo, ptdo_scale)
        grads, dnews, dh0 = self._outputs(w, ptdo, segments)
        for hv, chunks, skip, seq, from_state, to_state in self._walks(segments, window_log_decay, True):
            heads = hv if segments.splits else slice(None)
            dS = torch.zeros(grads[0, heads].shape) if dht is None or not from_state else dht[seq, heads].clone()
            for i, c in enumerate(chunks):
                dnew = ptdo[c, heads] + kd[c, heads].float() @ dS
                if i >= skip:
                    grads[c, heads], dnews[c, heads] = dS, dnew
                dc = decay[c, heads][..., None, None] if not segments.splits else decay[c, heads]
                dS = (dc * dS + qd[c, heads].float().transpose(-1, -2) @ dout[c, heads].float()
                      - w[c, heads].float().transpose(-1, -2) @ dnew)
            if to_state:
                dh0[seq, heads] = dS
        return grads, dnews, dh0

    def chunk_gradients(self, q, k, v, dout, beta, gamma, a0, state, dstate, vn, dvn, unit_u, unit_d, dout_scale=1.0,
                        out=None):
        """The per-chunk gradient kernel's results in torch: step 3 on its inputs, q and k per q/k
        head, dO times dout_scale, the chains' results (16-bit, as the kernel takes them) divided by
        their units, dq and dk summed over each q/k head's v-heads in order; written into `out` when
        given, as the kernel does."""
        self.calls.append("chunk")
        assert all(t.dtype == chain_kernels.spec_for(128, 128).torch_dtype for t in (state, dstate, vn, dvn))
        self.inputs.append(dict(q=q, v=v, dout=dout))   # as the kernel would read them
        q, k, v, dout = (x.float() for x in (q, k, v, dout))
        group = v.shape[1] // q.shape[1]
        qc, kc = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        Gamma = decay_mask(gamma)
        A = Gamma * a0
        uu, ud = unit_u[..., None, None], unit_d[..., None, None]
        got = chunked_torch.per_chunk_gradients(qc, kc, v, beta, dout_scale * dout, gamma, Gamma, a0, A, A * beta[..., None, :],
                                                gamma.exp()[..., None] * kc, qc @ kc.transpose(-1, -2), state / uu,
                                                dstate / ud, vn / uu, dvn / ud)
        Hqk = q.shape[1]
        got = tuple(x.view(x.shape[0], Hqk, group, *x.shape[2:]).sum(2) if i < 2 else x for i, x in enumerate(got))
        if out is None:
            return got
        for buffer, result in zip(out, got):
            assert buffer.shape == result.shape
            buffer.copy_(result)
        return out


@pytest.fixture
def chains_double(monkeypatch):
    """The three kernels replaced by CPU test doubles: the chains' (ChainKernelsDouble), the
    per-chunk kernel's (its chunk_gradients) and the prep's (test_backward_prep_kernels'
    torch_backward_prep), so q, k, v and dO reach them as the kernels would read them."""
    from flashqla_tune.backward import prep_kernels
    from test_backward_prep_kernels import torch_backward_prep

    double = ChainKernelsDouble()
    monkeypatch.setattr(chunked_torch, "uses_chain_kernels", lambda sequential, *a: sequential != "torch")
    monkeypatch.setattr(chunked_torch, "_chain_library_or_none", lambda *a: "library double")
    monkeypatch.setattr(chain_kernels, "chain_states", double.chain_states)
    monkeypatch.setattr(chain_kernels, "chain_gradients", double.chain_gradients)
    monkeypatch.setattr(chunked_torch, "_chunk_library_or_none", lambda *a: "library double")
    monkeypatch.setattr(chunked_torch, "_prep_library_or_none", lambda *a: "library double")
    monkeypatch.setattr(prep_kernels, "backward_prep", torch_backward_prep)
    monkeypatch.setattr(chunk_kernels, "chunk_gradients", double.chunk_gradients)
    monkeypatch.setattr(chunked_torch, "chunk_grid", lambda *a: pytest.fail("the host grid was built"))
    return double


CASES = {
    "varlen_tails_gva": dict(seqlens=[1, 0, 130, 64, 65, 200], tail=11, hqk=1, hv=2),
    "batched_vk_l2norm": dict(batch=2, T=150, hqk=2, hv=2, state_v_first=True, normalised=False),
    "tiny_output_gradients": dict(seqlens=[190, 70], hqk=1, hv=2, do_size=3e-9),
    "large_output_gradients": dict(seqlens=[120], hqk=1, hv=1, do_size=2e4),
    # the op's scale, split between D Q and dO's unit (split_scale): far from K^-1/2 either way, and zero
    "tiny_scale": dict(seqlens=[190, 70], hqk=1, hv=2, scale=1e-6, dht=False),
    "tiny_scale_with_dht": dict(seqlens=[190, 70], hqk=1, hv=2, scale=1e-6),
    "large_scale": dict(seqlens=[120], hqk=1, hv=2, scale=3e3),
    "zero_scale": dict(seqlens=[130], hqk=1, hv=2, scale=0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_sync_free_backward_gives_the_loops_gradients(name, chains_double, monkeypatch):
    case = dict(CASES[name])
    do_size = case.pop("do_size", 1.0)
    scale = case.pop("scale", None)
    l2norm = case.get("normalised") is False
    inputs, do, dht = draw(7, K=128, V=128, dtype=torch.bfloat16, **case)
    do, dht = (do.float() * do_size).to(do.dtype), None if dht is None else dht * do_size
    cu = inputs.pop("cu_seqlens")
    args = dict(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu, scale=scale)
    got = chunk_gated_delta_rule_bwd_torch(**args)
    assert chains_double.calls == ["states", "gradients", "chunk"]
    monkeypatch.undo()  # the loops on the host grid
    want = chunk_gated_delta_rule_bwd_torch(**args, sequential="torch")
    for n in NAMES:
        a, b = getattr(got, n), getattr(want, n)
        assert torch.isfinite(a).all(), f"{name}: {n} took values from a chunk no sequence owns"
        if scale == 0.0 and n == "dq":   # q reaches the loss only through the scale
            assert not a.any() and not b.any(), name
            continue
        # fp16 operands in the chains: about 2^-11 of rounding, nothing of the scale of do
        assert rel_l2(a.double(), b.double()) < 3e-3, (name, n, rel_l2(a.double(), b.double()))


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 1e39, -1e39])
def test_a_scale_outside_fp32_is_refused_before_any_work(scale):
    inputs, do, dht = draw(3, seqlens=[70], hqk=1, hv=1, K=128, V=128)
    with pytest.raises(ValueError, match="must be finite and within fp32's range"):
        chunk_gated_delta_rule_bwd_torch(**inputs, do=do, dht=dht, scale=scale)


@pytest.mark.parametrize("state_v_first, dtype", [(False, torch.bfloat16), (True, torch.bfloat16),
                                                  (False, torch.float16)])
def test_sequences_the_host_knows_give_the_loops_gradients_without_a_device_grid(state_v_first, dtype, chains_double,
                                                                                 monkeypatch):
    """Batch rows of whole chunks, as the forward's host hands them on (sequence_tokens): the identity
    grid, no device grid built, the loops' gradients; the call's rows reach the kernels in place
    (in fp16, q and k still get the prep's contiguous copy)."""
    inputs, do, dht = draw(13, batch=3, T=128, hqk=1, hv=2, K=128, V=128, state_v_first=state_v_first, dtype=dtype)
    args = dict(**inputs, do=do, dht=dht)
    monkeypatch.setattr(chunked_torch, "device_chunk_grid", lambda *a: pytest.fail("the device grid was built"))
    got = chunk_gated_delta_rule_bwd_torch(**args, sequence_tokens=128)
    assert chains_double.calls == ["states", "gradients", "chunk"]
    # the kernels read the call's rows in place, in the call's dtype: no conversion copy
    read = chains_double.inputs[0]
    for name, t in (("q", inputs["q"]), ("v", inputs["v"]), ("dout", do)):
        assert read[name].dtype == t.dtype and read[name].data_ptr() == t.data_ptr(), name
    monkeypatch.undo()
    want = chunk_gated_delta_rule_bwd_torch(**args, sequential="torch")
    for n in NAMES:
        a, b = getattr(got, n), getattr(want, n)
        assert rel_l2(a.double(), b.double()) < 3e-3, (n, rel_l2(a.double(), b.double()))


def test_inputs_of_mixed_dtypes_reach_the_kernels_in_fp32(chains_double, monkeypatch):
    """A direct call whose dO is not v's dtype (the op's calls never are): the kernels cannot read
    the pair as one dtype, so the backward converts them all, as before, and gives the loops'
    gradients."""
    inputs, do, dht = draw(19, batch=2, T=128, hqk=1, hv=2, K=128, V=128)
    got = chunk_gated_delta_rule_bwd_torch(**inputs, do=do.float(), dht=dht, sequence_tokens=128)
    read = chains_double.inputs[0]
    assert all(read[name].dtype == torch.float32 for name in ("q", "v", "dout"))
    monkeypatch.undo()
    want = chunk_gated_delta_rule_bwd_torch(**inputs, do=do.float(), dht=dht, sequential="torch")
    for n in NAMES:
        a, b = getattr(got, n), getattr(want, n)
        assert rel_l2(a.double(), b.double()) < 3e-3, (n, rel_l2(a.double(), b.double()))


def test_offsets_that_are_not_the_hosts_lengths_poison_every_gradient(chains_double):
    inputs, do, dht = draw(17, seqlens=[100, 156], hqk=1, hv=2, K=128, V=128)
    got = chunk_gated_delta_rule_bwd_torch(**inputs, do=do, dht=dht, sequence_tokens=128)
    for n in NAMES:
        assert torch.isnan(getattr(got, n)).all(), f"{n} holds numbers from sequences mixed up"
    with pytest.raises(ValueError, match="sequence_tokens=192 must be a multiple of 64 that the 2 sequences"):
        chunk_gated_delta_rule_bwd_torch(**inputs, do=do, dht=dht, sequence_tokens=192)


# ---------------------------------------------------------------- context parallelism in the chains

def _bucket_table(split_from: int, length: int) -> torch.Tensor:
    """A segment table: sequences of at most 2^(split_from - 1) chunks whole, longer ones cut every
    `length` chunks."""
    return torch.tensor([0] * split_from + [length] * (32 - split_from), dtype=torch.int32)


def test_split_sequences_cut_every_sequence_into_its_own_segments():
    counts = [0, 1, 5, 40, 130, 16, 17]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    warmup = torch.tensor([8, -1], dtype=torch.int32)
    table = chain_segments.split_sequences(offsets, _bucket_table(4, 16), 30, warmup, -11.5)
    rows = table.table.tolist()
    assert table.num_seqs == len(counts) and table.num_segments == 30 and table.splits
    used = [r for r in rows if r[4] >= 0]
    assert all(r[4] == -1 for r in rows[len(used):])                 # unused slots come last
    # 0, 1 and 5 chunks stay whole (at most 8 chunks); 16 is no longer than its length
    assert [sum(r[4] == s for r in used) for s in range(len(counts))] == [1, 1, 1, 3, 9, 1, 2]
    for s, n in enumerate(counts):
        mine = [r for r in used if r[4] == s]
        first, last = int(offsets[s]), int(offsets[s + 1])
        assert all(r[0] == first and r[3] == last for r in mine)
        assert [c for r in mine for c in range(r[1], r[2])] == list(range(first, last))  # each chunk once, in order
        assert all(r[2] - r[1] <= 16 for r in mine)
    assert torch.equal(chain_segments.whole_sequences(offsets).table[:, 1], offsets[:-1])


def test_split_sequences_refuse_what_the_kernels_cannot_take():
    offsets, warmup = torch.tensor([0, 40, 50]), torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_segments=1 is fewer than the 2 sequences"):
        chain_segments.split_sequences(offsets, _bucket_table(4, 16), 1, warmup, -11.5)
    with pytest.raises(ValueError, match="log_eps=0.0 must be negative"):
        chain_segments.split_sequences(offsets, _bucket_table(4, 16), 8, warmup, 0.0)
    with pytest.raises(ValueError, match="segment_chunks has 3 entries"):
        chain_segments.split_sequences(offsets, torch.tensor([0, 1, 2]), 8, warmup, -11.5)


def test_the_guard_refuses_a_window_with_a_token_outside_the_bound():
    gamma_last = torch.tensor([[-3.0, -3.0], [-3.0, float("nan")]])
    beta = torch.full((2, 2, 64), 0.5)
    norms = torch.ones(2, 2, 64)
    norms[1, 0, 7] = 4.5                      # b |k|^2 = 2.25 > 2
    got = chain_segments.window_log_decay(gamma_last, beta, norms)
    assert got[0].tolist() == [-3.0, -3.0] and got[1, 0] == float("inf") and got[1, 1].isnan()
    beta[0, 1, 3] = -0.1                      # a negative beta
    assert chain_segments.window_log_decay(gamma_last, beta, norms)[0, 1] == float("inf")


@dataclass(frozen=True)
class ForwardTablesDouble:
    """Test double of warmup_tables.WarmupTables with what the backward reads: every sequence of more
    than 4 chunks cut every 3 chunks, `window` chunks of warm-up per v-head."""
    warmup: torch.Tensor
    segment_chunks: torch.Tensor = _bucket_table(3, 3)
    log_eps: float = -11.5
    splits: bool = True

    @staticmethod
    def bound(total_tokens: int, num_seqs: int) -> int:
        return num_seqs + total_tokens // (3 * 64) + 1


@pytest.mark.parametrize("gate", ["strong", "zero"])
def test_a_split_backward_gives_the_loops_gradients_and_the_guard_chains_exactly(gate, chains_double, monkeypatch):
    """The backward with the forward's tables splits its chains (through the kernels' double): with gates
    that decay, windows are taken and the gradients stay the loops' within the chains' rounding; with
    gates that do not, the guard refuses every window and the result is bitwise the unsplit one."""
    inputs, do, dht = draw(11, seqlens=[700, 64, 390, 3], hqk=1, hv=2, K=128, V=128, gate=gate)
    cp = ForwardTablesDouble(torch.tensor([2, 4], dtype=torch.int32))
    args = dict(**inputs, do=do, dht=dht)
    split = chunk_gated_delta_rule_bwd_torch(**args, cp=cp)
    windows = chains_double.warm_windows
    whole = chunk_gated_delta_rule_bwd_torch(**args)
    monkeypatch.undo()
    want = chunk_gated_delta_rule_bwd_torch(**args, sequential="torch")
    for n in NAMES:
        a, b = getattr(split, n), getattr(want, n)
        assert torch.isfinite(a).all(), f"{gate}: {n} has values from a chunk no segment stored"
        assert rel_l2(a.double(), b.double()) < 3e-3, (gate, n, rel_l2(a.double(), b.double()))
    if gate == "zero":
        assert windows == 0 and all(torch.equal(getattr(split, n), getattr(whole, n)) for n in NAMES)
    else:
        assert windows > 0
