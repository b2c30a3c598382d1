"""Test doubles for pack tests (never used outside tests): a pack folder written without a
compiler (FakeBinary bytes stand in for the .so files) and a FakeLibraryOpener that records
what load() would have opened with ctypes."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from flashqla_tune.calibrate import Calibration, CalibrationSettings, calibrate_gates, save_calibration
from flashqla_tune.environment import GPUInfo
from flashqla_tune.pack import (BINARIES, CALIBRATION, UNTUNED_TARGET, Manifest, PackPlan, sha256_file,
                                write_manifest)
from flashqla_tune.pack_build import plan_heads
from flashqla_tune.plan import default_plan
from flashqla_tune.spec import GDNSpec

MODEL_SPEC = GDNSpec(2, 8, qk_l2norm_in_kernel=True, beta_max=1.0)
H200 = GPUInfo("NVIDIA H200", (9, 0), 132, "570.86.15")
SHA = "ab" * 32


def synthetic_calibration(spec: GDNSpec = MODEL_SPEC, layers: int = 3) -> Calibration:
    """Layer l, head h decays at -(h + 1) * (l + 1) / 64 per token, except head 5 of layer 1
    which never decays (an exact head), so tables differ by layer and head."""
    settings = CalibrationSettings()
    stats = []
    for layer in range(layers):
        rate = torch.tensor([(h + 1) * (layer + 1) / 64 for h in range(spec.num_v_heads)], dtype=torch.float64)
        g = -rate.expand(4096, -1).clone()
        if layer == 1:
            g[:, 5] = 0.0
        stats.append(calibrate_gates(g, settings, layer=layer, decoder_layer=2 * layer))
    return Calibration(checkpoint_sha256=SHA, checkpoint_path="/synthetic", family="qwen3_5", model_type="qwen3_5",
                       spec=spec.to_dict(), corpus={"name": "synthetic"}, settings=settings, layers=stats)


def make_pack(folder: Path, tp_sizes=(1, 2), gpu: GPUInfo | None = None, spec: GDNSpec = MODEL_SPEC,
              backward: bool = True) -> Path:
    folder = Path(folder)
    (folder / BINARIES).mkdir(parents=True)
    cal = synthetic_calibration(spec)
    save_calibration(cal, folder / CALIBRATION)
    plans = []
    for h in plan_heads(spec, tp_sizes):
        plan = default_plan(h.spec)
        rel = f"{BINARIES}/{plan.name}.so"
        (folder / rel).write_bytes(b"FakeBinary " + plan.name.encode())
        tuning = {"speedup_over_default": 1.0} if gpu else None
        plans.append(PackPlan(h.tp_size, h.form, plan, rel, sha256_file(folder / rel), tuning))
    record = ({"name": gpu.name, "arch": gpu.arch, "driver": gpu.driver, "sm_count": gpu.sm_count} if gpu
              else {"target": UNTUNED_TARGET, "name": None, "arch": "sm_90a"})
    write_manifest(folder, Manifest(spec=spec, checkpoint_sha256=SHA, checkpoint_path="/synthetic",
                                    calibration_sha256=sha256_file(folder / CALIBRATION),
                                    num_gdn_layers=len(cal.layers), tp_sizes=tuple(tp_sizes), gpu=record,
                                    toolchain={"nvcc": "13.0", "cutlass": "4.2.0", "torch": torch.__version__},
                                    plans=tuple(plans), backward=backward_doubles(folder, spec) if backward else ()))
    return folder


def backward_doubles(folder: Path, spec: GDNSpec) -> tuple:
    """The backward library records `flashqla-tune build` writes, one per kind with a library for these
    head dims (chain, prep, chunk), over FakeBinary files in folder/binaries."""
    from flashqla_tune.backward import libraries
    from flashqla_tune.pack import BackwardLibrary

    records = []
    for kind, module in libraries.modules().items():
        try:
            lib_spec = module.spec_for(spec.head_k_dim, spec.head_v_dim)
        except ValueError:
            continue
        rel = f"{BINARIES}/{lib_spec.name}.so"
        (folder / rel).write_bytes(f"FakeBinary backward {kind}".encode())
        records.append(BackwardLibrary(kind, rel, sha256_file(folder / rel), lib_spec.to_dict(), module.ABI_VERSION))
    return tuple(records)


def edit_manifest(folder: Path, change) -> None:
    path = Path(folder) / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


class FakeLibraryOpener:
    def __init__(self):
        self.opened = []

    def __call__(self, so_path, plan):
        self.opened.append((Path(so_path).name, plan.name))
        return ("FakeLibrary", plan.name)
