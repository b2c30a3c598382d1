"""`flashqla-tune info` and the op's host-side checks (everything that runs before the GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashqla_tune.cli import main
from flashqla_tune.ops import UnsupportedError, _check_offsets, chunk_gated_delta_rule

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def test_info_without_checkpoint(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "nvcc" in out and "cutlass" in out and "cache" in out


def test_info_with_checkpoint_lists_gdn_layers(capsys):
    assert main(["info", str(CONFIGS / "qwen3-next-80b-a3b")]) == 0
    out = capsys.readouterr().out
    assert "36 GDN of 48 layers" in out and "gdn_qk16_v32_k128_v128_c64_scalar_bf16_kv_l2n" in out
    assert main(["info", "--json", str(CONFIGS / "qwen3.5-27b")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["spec"]["num_v_heads"] == 48 and len(data["model"]["gdn_layers"]) == 48


def test_info_on_a_non_gdn_model_is_a_clear_error(capsys):
    assert main(["info", str(CONFIGS / "not-gdn-llama")]) == 2
    assert "model_type='llama' is not a GDN model" in capsys.readouterr().err


def _inputs(B=1, T=8, hqk=2, hv=4, K=128, V=128, dtype=torch.bfloat16):
    return (torch.zeros(B, T, hqk, K, dtype=dtype), torch.zeros(B, T, hqk, K, dtype=dtype),
            torch.zeros(B, T, hv, V, dtype=dtype), torch.zeros(B, T, hv), torch.zeros(B, T, hv))


@pytest.mark.parametrize("mutate, error, match", [
    (lambda a: (a[0][..., :64], a[1][..., :64], *a[2:]), UnsupportedError, "K=64, V=128"),
    (lambda a: (a[0], a[1][:, :, :1], *a[2:]), ValueError, "q shape .* != k shape"),
    (lambda a: (*a[:2], torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16), *a[3:]), ValueError, "Hv=3 must be a multiple of q/k heads Hqk=2"),
    (lambda a: tuple(t.float() for t in a), UnsupportedError, "bfloat16/float16; got torch.float32"),
    (lambda a: (*a[:3], a[3][..., :1], a[4]), ValueError, r"g shape \(1, 8, 1\), expected"),
    (lambda a: (*a[:4], a[4].double()), UnsupportedError, "beta dtype torch.float64"),
    (lambda a: a, ValueError, "must be on a CUDA device, got cpu"),
])
def test_op_rejects_bad_inputs_with_named_values(mutate, error, match):
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule(*mutate(_inputs()))


def test_op_checks_state_and_varlen_shapes_before_the_device():
    q, k, v, g, b = _inputs()
    with pytest.raises(ValueError, match="varlen .* needs batch size 1, got B=2"):
        chunk_gated_delta_rule(*_inputs(B=2), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match=r"initial_state shape \(1, 4, 128, 64\)"):
        chunk_gated_delta_rule(q, k, v, g, b, initial_state=torch.zeros(1, 4, 128, 64))


def test_launch_limits_are_host_errors():
    q, k, v, g, b = _inputs()
    with pytest.raises(UnsupportedError, match="65536 sequences in one call; the kernels take at most 65535"):
        chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=torch.zeros(65537, dtype=torch.int64))


def test_cu_seqlens_cpu_values_are_checked():
    _check_offsets(torch.tensor([0, 3, 8]), 3, 8)
    with pytest.raises(ValueError, match="must start at 0"):
        _check_offsets([1, 8], 2, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\]=2 < cu_seqlens\[1\]=5"):
        _check_offsets([0, 5, 2], 3, 8)
    with pytest.raises(ValueError, match="ends at 9 but the inputs hold only T=8"):
        _check_offsets([0, 9], 2, 8)
    with pytest.raises(ValueError, match="has 2 entries but cu_seqlens has 3"):
        _check_offsets([0, 8], 3, 8)


def test_a_gpu_other_than_sm90_is_refused_by_name(monkeypatch):
    """Simulated devices (no GPU here): an A100 is refused with its name and arch; the answer
    is kept per device index, so an H200 on another index is asked separately and accepted."""
    from flashqla_tune import ops

    caps = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: caps[index])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: ["NVIDIA A100", "NVIDIA H200"][index])
    ops._check_gpu_index.cache_clear()
    try:
        with pytest.raises(UnsupportedError, match="NVIDIA A100 is sm_80; the kernels are built for sm_90a"):
            ops.check_gpu(torch.device("cuda", 0))
        ops.check_gpu(torch.device("cuda", 1))
        caps[1] = (8, 6)  # cached: the arch of a device is asked once
        ops.check_gpu(torch.device("cuda", 1))
    finally:
        ops._check_gpu_index.cache_clear()
