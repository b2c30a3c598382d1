"""The transformers route on the H200: the shipped model's prefill by transformers' own code with
its GDN layers on a pack (built here with the default tiles), FLA kept out of the process, against
the model's float32 PyTorch path: logits relative L2 below 1e-2 and top-1 agreement >= 99% over
the positions where the reference's top-1 margin exceeds 0.1. The comparison is
benchmarks/transformers_route.py, run in a fresh interpreter so FLA cannot be imported there
whatever this one has loaded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "transformers_route.py"


@pytest.fixture(scope="module")
def pack(shipped_pack):
    return shipped_pack


def test_shipped_model_prefill_through_the_transformers_route(pack, tmp_path, capsys):
    out = tmp_path / "route"
    done = subprocess.run([sys.executable, str(SCRIPT), "--pack", str(pack), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    with capsys.disabled():
        print("\n" + done.stdout[-4000:] + done.stderr[-2000:])
    result = json.loads((out / "transformers_route.json").read_text())
    route = result["pack_route"]
    assert done.returncode == 0, result["status"]
    assert route["rel_l2"] < 1e-2
    assert route["top1_agreement"] >= 0.99
    assert route["counted_fraction"] > 0   # the agreement is over a stated, non-empty share of positions
    assert result["route"]["decoder_to_gdn_layer"]["4"] == 3
    assert set(result["route"]["calls_per_gdn_layer"].values()) == {result["route"]["forwards"]}
