"""Calibration where FLA and causal-conv1d are importable, as in a serving environment.

tests/fla_stand_in holds stand-ins for both packages (and for the `kernels` library's hub layers)
whose ops fail as Triton kernels do on a machine without a GPU driver ("0 active drivers"). Put
first on sys.path of a fresh interpreter, they make transformers route its GDN layers to them,
which the child checks by calling transformers' own dispatch functions. There, calibration of
the shipped default model (and of a tiny Qwen3-Next) must still succeed, give the same
statistics to the bit as in this interpreter (which has none of them), and leave transformers'
dispatch as it found it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from fixtures.calibrate_tiny import make_qwen3_next, write_corpus
from flashqla_tune.calibrate.adapters.torch_layer_math import dispatch_pins
from flashqla_tune.calibrate.default_model import default_model_path
from flashqla_tune.calibrate.pipeline import calibrate_checkpoint

TESTS = Path(__file__).resolve().parent
STAND_IN = TESTS / "fla_stand_in"
DRIVER_ERROR = "0 active drivers"
# transformers 5.25 and later send a call to a kernel package only for inputs on a device it supports
CPU_CALLS_STAY_ON_TORCH = Version(transformers.__version__) >= Version("5.25")

pytestmark = pytest.mark.skipif(not (default_model_path() / "model.safetensors").is_file(),
                                reason="the embedded default model is not in this tree")

# Calibration settings both sides use; one thread, so that the comparison can be to the bit.
CAL_ARGS = dict(seq_len=256, max_sequences=4, batch_size=2, device="cpu", dtype="float32", progress=False,
                write=False)

# Run with the stand-ins first on sys.path: probes where transformers routes, what an unpinned
# layer does, calibrates both checkpoints, checks the refusals, and prints one JSON line.
CHILD = r'''
import json, sys, types
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next
from flashqla_tune.calibrate.adapters import torch_layer_math, transformers_qwen
from flashqla_tune.calibrate.pipeline import calibrate_checkpoint
from flashqla_tune.calibration_settings import CalibrationError

tiny, corpus, cal_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(1)
MODELING = (modeling_qwen3_5, modeling_qwen3_next)
out = {}


def routes(m):
    """What transformers' own dispatch functions do with a small CPU call."""
    q, g = torch.randn(1, 4, 2, 8), torch.zeros(1, 4, 2)
    calls = {"torch_chunk_gated_delta_rule": lambda: m.torch_chunk_gated_delta_rule(q, q, q, g, g.sigmoid()),
             "causal_conv1d_fn": lambda: m.causal_conv1d_fn(torch.randn(1, 6, 4), torch.randn(6, 4),
                                                            activation="silu")}
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "ran"
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    return seen


def calibrate(ckpt, corpus_path):
    return calibrate_checkpoint(ckpt, corpus_path, **cal_args).calibration.to_dict()["layers"]


def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


out["pins"] = {m.__name__: sorted(torch_layer_math.dispatch_pins(m)) for m in MODELING}
out["routes_before"] = {m.__name__: routes(m) for m in MODELING}
# the calibration's own layer, run without the pin: what users saw
real_pin, real_check = transformers_qwen.pinned_torch_path, transformers_qwen.check_torch_only
transformers_qwen.pinned_torch_path = lambda modeling: __import__("contextlib").nullcontext()
transformers_qwen.check_torch_only = lambda *a: None
out["unpinned_run"] = error_of(lambda: calibrate(None, None))
transformers_qwen.pinned_torch_path, transformers_qwen.check_torch_only = real_pin, real_check
from transformers import AutoConfig
from flashqla_tune.calibrate.default_model import default_model_path
with torch.device("meta"):
    layer = modeling_qwen3_5.Qwen3_5DecoderLayer(AutoConfig.from_pretrained(str(default_model_path())), 0)
out["unpinned_check"] = error_of(lambda: torch_layer_math.check_torch_only(layer, modeling_qwen3_5, "layer 0"))

before = [dict(vars(m)) for m in MODELING]
out["default"] = calibrate(None, None)
out["tiny_qwen3_next"] = calibrate(tiny, corpus)
after = [dict(vars(m)) for m in MODELING]
out["restored"] = all(a.keys() == b.keys() and all(a[k] is b[k] for k in b) for a, b in zip(after, before))

out["routes_after"] = {m.__name__: routes(m) for m in MODELING}
# A modeling module that imports its kernels at module level, as earlier transformers 5.x did.
src = (
    "import torch\n"
    "from fla.modules import FusedRMSNormGated\n"
    "from fla.ops.gated_delta_rule import chunk_gated_delta_rule\n"
    "def torch_chunk_gated_delta_rule(x, **kw):\n"
    "    return 2 * x\n"
    "class GatedNorm(torch.nn.Module):\n"
    "    def forward(self, x, g):\n"
    "        return x * torch.sigmoid(g)\n"
    "class Mixer(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.norm = GatedNorm() if FusedRMSNormGated is None else FusedRMSNormGated(4)\n"
    "        self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule\n"
    "    def forward(self, x):\n"
    "        return self.norm(self.chunk_gated_delta_rule(x), x)\n")
old_style = types.ModuleType("transformers.models.gdn_with_optional_imports")
exec(compile(src, old_style.__name__, "exec"), vars(old_style))
x = torch.ones(2, 4)
out["old_style_unpinned"] = error_of(lambda: torch_layer_math.check_torch_only(old_style.Mixer(), old_style, "m"))
with torch_layer_math.pinned_torch_path(old_style):
    mixer = old_style.Mixer()
    torch_layer_math.check_torch_only(mixer, old_style, "mixer")
    out["old_style_pinned"] = torch.allclose(mixer(x), 2 * x * torch.sigmoid(x))
out["old_style_restored"] = old_style.chunk_gated_delta_rule.__module__.startswith("fla.")
# The dispatch functions as the `kernels` library leaves them, after a kernelize that found hub kernels.
import fla, causal_conv1d
from hub_layer_stand_in import as_hub_layer, kernelized
originals = {n: getattr(modeling_qwen3_5, n) for n in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}
hub = {"torch_chunk_gated_delta_rule": kernelized(as_hub_layer(originals["torch_chunk_gated_delta_rule"]),
                                                  fla.chunk_gated_delta_rule),
       "causal_conv1d_fn": kernelized(as_hub_layer(originals["causal_conv1d_fn"]), causal_conv1d.causal_conv1d_fn)}
for name, layer in hub.items():
    setattr(modeling_qwen3_5, name, layer)
out["hub_routes"] = routes(modeling_qwen3_5)
out["hub_default"] = calibrate(None, None)
out["hub_restored"] = all(getattr(modeling_qwen3_5, n) is layer for n, layer in hub.items())
for name, fn in originals.items():
    setattr(modeling_qwen3_5, name, fn)
# A dispatch point of a form the pin does not know: the kernel itself as the module's function.
modeling_qwen3_5.torch_chunk_gated_delta_rule = fla.chunk_gated_delta_rule
out["unknown_dispatch"] = error_of(lambda: calibrate(None, None))
print(json.dumps(out))
'''


def run_with_stand_in(tiny: Path, corpus: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STAND_IN)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p])
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny), str(corpus), json.dumps(CAL_ARGS)],
                          capture_output=True, text=True, env=env, cwd=TESTS, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def calibrate_here(ckpt, corpus) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return calibrate_checkpoint(ckpt, corpus, **CAL_ARGS).calibration.to_dict()["layers"]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("with_fla")
    make_qwen3_next(root / "qwen3_next", seed=5)
    return root / "qwen3_next", write_corpus(root / "corpus.txt")


@pytest.fixture(scope="module")
def with_fla(checkpoints):
    return run_with_stand_in(*checkpoints)


def test_the_stand_in_makes_transformers_choose_fla(with_fla):
    """Before 5.25 transformers sends CPU calls to the stand-in kernels (and they die as Triton does
    there); from 5.25 its dispatch checks the inputs' device against the kernel package's and keeps
    CPU calls on its PyTorch code, but CUDA calls still go to FLA, so the pins are found either way."""
    for module, routes in with_fla["routes_before"].items():
        for fn, outcome in routes.items():
            if CPU_CALLS_STAY_ON_TORCH:
                assert outcome == "ran", (module, fn, outcome)
            else:
                assert DRIVER_ERROR in outcome, (module, fn, outcome)
        assert set(with_fla["pins"][module]) >= {"torch_chunk_gated_delta_rule", "causal_conv1d_fn"}


@pytest.mark.skipif(any(importlib.util.find_spec(p) for p in ("fla", "causal_conv1d", "kernels")),
                    reason="a kernel package is installed here")
def test_without_kernel_packages_nothing_is_pinned():
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next

    for modeling in (modeling_qwen3_5, modeling_qwen3_next):
        assert dispatch_pins(modeling) == {}   # calibration runs exactly what it ran before


def test_without_the_pin_calibration_dies_in_the_kernel(with_fla):
    """What users saw before 5.25 on a CPU; from 5.25 the unpinned CPU run stays on transformers'
    PyTorch code by itself (a CUDA calibration would still reach FLA). The check refuses either way."""
    if CPU_CALLS_STAY_ON_TORCH:
        assert with_fla["unpinned_run"] is None, with_fla["unpinned_run"]
    else:
        assert with_fla["unpinned_run"] is not None and DRIVER_ERROR in with_fla["unpinned_run"]
    check = with_fla["unpinned_check"]
    assert check.startswith(f"CalibrationError: transformers {transformers.__version__}: layer 0 would run code")
    assert "(fla: 'chunk_gated_delta_rule')" in check and "(causal_conv1d: 'causal_conv1d_fn')" in check


def test_calibration_with_fla_importable_matches_calibration_without(with_fla, checkpoints):
    assert len(with_fla["default"]) == 5 and len(with_fla["tiny_qwen3_next"]) == 3
    assert with_fla["default"] == calibrate_here(None, None)
    assert with_fla["tiny_qwen3_next"] == calibrate_here(*checkpoints)


def test_the_pin_lasts_only_for_the_calibration(with_fla):
    assert with_fla["restored"]
    assert with_fla["routes_after"] == with_fla["routes_before"]   # the user's process keeps its FLA


def test_module_level_kernel_imports_are_pinned_too(with_fla):
    assert "(fla: 'FusedRMSNormGated')" in with_fla["old_style_unpinned"]
    assert with_fla["old_style_pinned"] is True and with_fla["old_style_restored"] is True


def test_hub_kernel_layers_are_pinned_too(with_fla):
    assert all(DRIVER_ERROR in outcome for outcome in with_fla["hub_routes"].values()), with_fla["hub_routes"]
    assert with_fla["hub_default"] == with_fla["default"] and with_fla["hub_restored"]


def test_an_unknown_dispatch_point_is_refused_with_the_transformers_version(with_fla):
    err = with_fla["unknown_dispatch"]
    assert err.startswith(f"CalibrationError: transformers {transformers.__version__}: decoder layer 0 would run")
    assert "torch_chunk_gated_delta_rule (fla: 'chunk_gated_delta_rule')" in err and DRIVER_ERROR not in err
