"""Is the 32k CP call's host time a launch-queue effect? Back-to-back means over N calls, and
calls timed one at a time after a synchronize (an empty queue)."""
import json, sys, time
import torch
from flashqla_tune import host_path, ops
from flashqla_tune.bench.cases import Case
from flashqla_tune.bench.inputs import make_rotation, protocol_warmup_table

CP_TABLE = protocol_warmup_table(8)
long = make_rotation(Case(2, 8, (32768,)), 1, "cuda")[0]
short = make_rotation(Case(2, 8, (2048,)), 1, "cuda")[0]
def mk(x, **kw):
    return lambda: ops.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
        output_final_state=True, cu_seqlens=x.cu_seqlens_long, cu_seqlens_cpu=x.cu_seqlens_cpu, **kw)
fns = {"cp_32k": mk(long, warmup=CP_TABLE), "default_32k": mk(long), "single_2k": mk(short)}
res = {}
host_path.extension()  # built or loaded before anything is timed (else calls take the Python path)
with torch.no_grad():
    for name, fn in fns.items():
        for _ in range(30): fn()
        torch.cuda.synchronize()
        r = {}
        for n in (5, 10, 20, 40, 80):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(n): fn()
            r[f"b2b_{n}"] = round((time.perf_counter_ns() - t0) / n / 1e3, 2)
            torch.cuda.synchronize()
        iso = []
        for _ in range(100):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns(); fn(); iso.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        iso.sort()
        r["isolated_median"] = round(iso[50], 2); r["isolated_mean"] = round(sum(iso) / len(iso), 2)
        r["isolated_p10"] = round(iso[10], 2); r["isolated_p90"] = round(iso[90], 2)
        r["cpp_calls_taken"] = host_path.taken
        res[name] = r
        print(name, r, flush=True)
json.dump(res, open(sys.argv[1] + "/host_queue_probe.json", "w"), indent=1)
