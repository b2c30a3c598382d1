"""The backward's sync-free path (chunked_torch.device_chunk_grid), on the CPU.

Where the chain kernels run, the backward builds its chunk grid from the device offsets with
device ops only, so nothing waits for the GPU and a training step can be captured in a CUDA graph.
Here the grid is checked against the host grid it replaces, and the whole backward through it
against the torch-loop path, with the chain kernels replaced by a named CPU test double that walks
the same chunk layout and offsets (the kernels themselves are tests/test_gpu_backward_chain.py's):
varlen with tails, empty sequences, rows past the last offset, GVA, h0 and dht, both layouts, the
in-kernel L2 norm, and output gradients far below fp16's normal range.
"""
from __future__ import annotations

import pytest
import torch

from gdn_inputs import rel_l2
from test_backward_reference import draw

from flashqla_tune.backward import chain_kernels, chunked_torch
from flashqla_tune.backward.chunked_torch import chunk_gated_delta_rule_bwd_torch

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


def test_the_device_grid_stays_in_bounds_whatever_the_offsets_hold():
    for cu in ([0, 500, 100, 90], [-7, 30, 2 ** 40, 60], [5, 5, 5]):
        grid = chunked_torch.device_chunk_grid(torch.tensor(cu), 80)
        assert 0 <= int(grid.token_slot.min()) and int(grid.token_slot.max()) <= grid.num_chunks * 64
        assert 0 <= int(grid.slot_token.min()) and int(grid.slot_token.max()) <= 80
        assert int(grid.chunk_offsets[-1]) <= grid.num_chunks
        assert torch.all(grid.chunk_offsets[1:] >= grid.chunk_offsets[:-1])


class ChainKernelsDouble:
    """Test double of chain_kernels.chain_states / chain_gradients: the same arguments (16-bit operands,
    fp32 tiles, device offsets), the same recurrences walked per sequence on the CPU in fp32, and
    NaN in every chunk no sequence owns, as the kernels leave those unwritten."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _outputs(w, add, offsets):
        NC, Hv, C, K = w.shape
        V, N = add.shape[-1], offsets.numel() - 1
        nan = float("nan")
        return (torch.full((NC, Hv, K, V), nan), torch.full((NC, Hv, C, V), nan), torch.full((N, Hv, K, V), nan),
                [(int(offsets[i]), int(offsets[i + 1])) for i in range(N)])

    def chain_states(self, w, kd, u, decay, chunk_offsets, h0=None, values=True, out=None):
        self.calls.append("states")
        states, news, final, ranges = self._outputs(w, u, chunk_offsets)
        for s, (a, b) in enumerate(ranges):
            S = torch.zeros(states.shape[1:]) if h0 is None else h0[s].clone()
            for c in range(a, b):
                states[c] = S
                news[c] = u[c] - w[c].float() @ S
                S = decay[c][:, None, None] * S + kd[c].float().transpose(-1, -2) @ news[c]
            final[s] = S
        return states, news, final

    def chain_gradients(self, w, kd, qd, dout, ptdo, decay, chunk_offsets, dht=None, values=True, out=None):
        self.calls.append("gradients")
        grads, dnews, dh0, ranges = self._outputs(w, ptdo, chunk_offsets)
        for s, (a, b) in enumerate(ranges):
            dS = torch.zeros(grads.shape[1:]) if dht is None else dht[s].clone()
            for c in reversed(range(a, b)):
                grads[c] = dS
                dnews[c] = ptdo[c] + kd[c].float() @ dS
                dS = (decay[c][:, None, None] * dS + qd[c].float().transpose(-1, -2) @ dout[c].float()
                      - w[c].float().transpose(-1, -2) @ dnews[c])
            dh0[s] = dS
        return grads, dnews, dh0


@pytest.fixture
def chains_double(monkeypatch):
    double = ChainKernelsDouble()
    monkeypatch.setattr(chunked_torch, "uses_chain_kernels", lambda sequential, *a: sequential != "torch")
    monkeypatch.setattr(chunked_torch, "_chain_library_or_none", lambda *a: "library double")
    monkeypatch.setattr(chain_kernels, "chain_states", double.chain_states)
    monkeypatch.setattr(chain_kernels, "chain_gradients", double.chain_gradients)
    monkeypatch.setattr(chunked_torch, "chunk_grid", lambda *a: pytest.fail("the host grid was built"))
    return double


CASES = {
    "varlen_tails_gva": dict(seqlens=[1, 0, 130, 64, 65, 200], tail=11, hqk=1, hv=2),
    "batched_vk_l2norm": dict(batch=2, T=150, hqk=2, hv=2, state_v_first=True, normalised=False),
    "tiny_output_gradients": dict(seqlens=[190, 70], hqk=1, hv=2, do_size=3e-9),
    "large_output_gradients": dict(seqlens=[120], hqk=1, hv=1, do_size=2e4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_sync_free_backward_gives_the_loops_gradients(name, chains_double, monkeypatch):
    case = dict(CASES[name])
    do_size = case.pop("do_size", 1.0)
    l2norm = case.get("normalised") is False
    inputs, do, dht = draw(7, K=128, V=128, dtype=torch.bfloat16, **case)
    do, dht = (do.float() * do_size).to(do.dtype), dht * do_size
    cu = inputs.pop("cu_seqlens")
    args = dict(**inputs, do=do, dht=dht, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    got = chunk_gated_delta_rule_bwd_torch(**args)
    assert chains_double.calls == ["states", "gradients"]
    monkeypatch.undo()  # the loops on the host grid
    want = chunk_gated_delta_rule_bwd_torch(**args, sequential="torch")
    for n in NAMES:
        a, b = getattr(got, n), getattr(want, n)
        assert torch.isfinite(a).all(), f"{name}: {n} took values from a chunk no sequence owns"
        # fp16 operands in the chains: about 2^-11 of rounding, nothing of the scale of do
        assert rel_l2(a.double(), b.double()) < 3e-3, (name, n, rel_l2(a.double(), b.double()))
