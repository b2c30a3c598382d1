"""Eager host time per call of the op on the C++ host path, 2/8 heads: the calibrated CP call and
the default call at 32768 tokens and the single chain at 2048, each timed one call at a time after
a synchronize (an empty launch queue) and as back-to-back means over 5 to 80 calls, so a
launch-queue effect shows as the gap between the two. Microseconds, in OUT_DIR/host_queue_probe.json
(the published copy: docs/results/host-queue-probe.json).

    python3 benchmarks/host_queue_probe.py OUT_DIR      (repository root; benchmarks/h200_steps.sh host)
"""
import json
import sys
import time

import torch

from flashqla_tune import host_path, ops
from flashqla_tune.measure.cases import Case
from flashqla_tune.measure.inputs import make_rotation, protocol_warmup_table

BACK_TO_BACK = (5, 10, 20, 40, 80)
ONE_AT_A_TIME = 100


def op_call(x, **kw):
    return lambda: ops.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
                                              output_final_state=True, cu_seqlens=x.cu_seqlens_long,
                                              cu_seqlens_cpu=x.cu_seqlens_cpu, **kw)


def probe(fn) -> dict:
    for _ in range(30):  # warm: the first call of a signature takes the Python path
        fn()
    torch.cuda.synchronize()
    result = {}
    for n in BACK_TO_BACK:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        result[f"b2b_{n}"] = round((time.perf_counter_ns() - t0) / n / 1e3, 2)
        torch.cuda.synchronize()
    alone = []
    for _ in range(ONE_AT_A_TIME):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        alone.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    alone.sort()
    result.update(isolated_median=round(alone[50], 2), isolated_mean=round(sum(alone) / len(alone), 2),
                  isolated_p10=round(alone[10], 2), isolated_p90=round(alone[90], 2),
                  cpp_calls_taken=host_path.taken)
    return result


def main(out_dir: str) -> int:
    long = make_rotation(Case(2, 8, (32768,)), 1, "cuda")[0]
    short = make_rotation(Case(2, 8, (2048,)), 1, "cuda")[0]
    calls = {"cp_32k": op_call(long, warmup=protocol_warmup_table(8)), "default_32k": op_call(long),
             "single_2k": op_call(short)}
    host_path.extension()  # built or loaded before anything is timed (else calls take the Python path)
    results = {}
    with torch.no_grad():
        for name, fn in calls.items():
            results[name] = probe(fn)
            print(name, results[name], flush=True)
    with open(f"{out_dir}/host_queue_probe.json", "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
