"""Host time of the library call alone (fqt_gdn_fwd: the launches and their argument set-up, no
Python op) for a calibrated CP call at 32k tokens on 2/8 heads, this tree's build beside an older
csrc/ folder (FQT_BASE_CSRC), in one process and alternating, so that host noise falls on both
alike. The arguments are the ones the op itself built for the call (captured from its launch,
measure.variants.capture_launch), each build given a workspace of its own size. Microseconds, in
OUT_DIR/host_launch_ab.json (the published copy: docs/results/host-launch-ab.json).

    FQT_BASE_CSRC=.carry/base-csrc python -P benchmarks/host_launch_ab.py OUT_DIR    (repository
        root; benchmarks/h200_steps.sh host-ab)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_queue_probe import op_call  # noqa: E402  the op's call on one of the protocol's inputs

from flashqla_tune import host_path, runtime  # noqa: E402
from flashqla_tune.build import BuildConfig  # noqa: E402
from flashqla_tune.loader import open_library  # noqa: E402
from flashqla_tune.measure.cases import Case  # noqa: E402
from flashqla_tune.measure.inputs import make_rotation, protocol_warmup_table  # noqa: E402
from flashqla_tune.measure.variants import build_variants, capture_launch  # noqa: E402
from flashqla_tune.spec import GDNSpec  # noqa: E402

ROUNDS, ISOLATED, BACK_TO_BACK = 10, 30, 20


def with_own_workspace(lib, args):
    """(lib, a copy of args whose workspace is sized by lib and stays alive while it is replayed,
    the workspace tensor)."""
    args = type(args).from_buffer_copy(args)
    workspace = torch.empty(lib.workspace_bytes(args.total_tokens, args.num_seqs, args.max_segments),
                            dtype=torch.uint8, device="cuda")
    args.workspace = workspace.data_ptr()
    return lib, args, workspace


def isolated_us(lib, args, stream) -> list[float]:
    times = []
    for _ in range(ISOLATED):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        lib.launch(args, stream)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def back_to_back_us(lib, args, stream) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(BACK_TO_BACK):
        lib.launch(args, stream)
    mean = (time.perf_counter_ns() - t0) / BACK_TO_BACK / 1e3
    torch.cuda.synchronize()
    return mean


def main(out_dir: str) -> int:
    base = os.environ.get("FQT_BASE_CSRC")
    if not base:
        print("FQT_BASE_CSRC (an older csrc/ folder) is not set", file=sys.stderr)
        return 2
    # The op's call below takes the Python host path, whose launch is the one captured; switched
    # off, the C++ host path's extension does not build in the background while the host is timed.
    os.environ[host_path.ENV_SWITCH] = "python"
    plan = runtime.default_plan_for(GDNSpec(2, 8))
    entries = build_variants([plan], {"this": ("-DNDEBUG",), "base": BuildConfig(csrc=base, extra_flags=("-DNDEBUG",))})
    libs = {name: open_library(e[0].so_path, plan) for name, e in entries.items()}
    x = make_rotation(Case(2, 8, (32768,)), 1, "cuda")[0]
    table = protocol_warmup_table(8)
    with torch.no_grad():
        args, stream = capture_launch(plan, libs["this"], op_call(x, warmup=table))
    calls = {name: with_own_workspace(lib, args) for name, lib in libs.items()}
    samples = {name: {"isolated": [], "b2b": []} for name in calls}
    with torch.no_grad():
        for lib, args, _ in calls.values():
            for _ in range(20):
                lib.launch(args, stream)
        for _ in range(ROUNDS):
            for name, (lib, args, _) in calls.items():
                samples[name]["isolated"] += isolated_us(lib, args, stream)
                samples[name]["b2b"].append(back_to_back_us(lib, args, stream))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "call": "2/8 1x32768, calibrated table",
              "base_csrc": base, "max_segments": {n: c[1].max_segments for n, c in calls.items()}, "us": {}}
    for name, s in samples.items():
        iso = sorted(s["isolated"])
        result["us"][name] = {"isolated_median": round(statistics.median(iso), 2),
                              "isolated_p10": round(iso[len(iso) // 10], 2),
                              "isolated_p90": round(iso[9 * len(iso) // 10], 2),
                              "b2b_mean_median": round(statistics.median(s["b2b"]), 2)}
    print(json.dumps(result))
    with open(f"{out_dir}/host_launch_ab.json", "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
