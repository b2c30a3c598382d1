"""Where an eager call's host time goes (the target: under 30 us per call). On the GPU, for
2/8 heads, the mean host time per call of each layer of the call stack, timed over back-to-back
calls (the GPU runs behind; nothing synchronises inside the loop). The op-level rows are timed on
both host paths: "cpp" (the C++ host path, host_path.py: the default once a call of the signature
has run) and "python" (FLASHQLA_TUNE_HOST_PATH=python), with the number of calls the C++ path took.

  op        flashqla_tune.ops.chunk_gated_delta_rule, 1x2048 tokens: no table splits them, so this is
            the single chain's path
  op_cp     the same with the calibrated warm-up table of the protocol's gates
  op_32k, op_cp_32k   1x32768 tokens (with host offsets), where the default window and the
            calibrated table split (context parallel: three more launches, one stream, no events)
  single_32k   ops.run_checked without a table (one exact chain; Python path only)
  forward   runtime.forward (buffers, the launch struct, the library call; the Python path's core)
  launch    the library call alone with a prepared struct (TMA descriptors, two launches)
  empty     one torch.empty of the workspace;  stream  torch's current stream handle
  checks    ops.check_inputs
  fla_*, flashqla_*   FLA's and FlashQLA's calls on the same protocol inputs (2048 and 32768 tokens)
            in the same run, where their packages are installed (carry .anchors). An
            implementation that synchronises the host with the GPU inside its call (FlashQLA's
            CP planning does) shows max(host, GPU) here, which is what an eager caller waits.

Writes OUT_DIR/host_overhead.json and prints it (microseconds per call).

    FLA_DISABLE_BACKEND_DISPATCH=1 python -P tools/host_overhead.py OUT_DIR [--no-anchors]    (repository root)
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from flashqla_tune import abi, host_path, ops, runtime
from flashqla_tune.measure.cases import Case
from flashqla_tune.measure.impls import call, load_impls
from flashqla_tune.measure.inputs import make_rotation, protocol_warmup_table

CALLS = 200
CP_TABLE = protocol_warmup_table(8)


def per_call_us(fn, calls: int = CALLS) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    host = (time.perf_counter_ns() - t0) / calls / 1e3
    torch.cuda.synchronize()
    return round(host, 2)


def both_paths(fn, calls: int = CALLS) -> dict:
    """per_call_us on the Python host path, then on the C++ one (and how many calls it took)."""
    os.environ[host_path.ENV_SWITCH] = "python"
    try:
        python = per_call_us(fn, calls)
    finally:
        del os.environ[host_path.ENV_SWITCH]
    before = host_path.taken
    cpp = per_call_us(fn, calls)
    return {"cpp": cpp, "python": python, "cpp_calls_taken": host_path.taken - before, "calls": calls + 20}


def main(out_dir: str, anchors_too: bool = True) -> int:
    dev, T = "cuda", 2048
    q = F.normalize(torch.randn(1, T, 2, 128, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, 2, 128, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, 8, 128, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(1, T, 8, device=dev)) / 16
    beta = torch.rand(1, T, 8, device=dev)
    cu = torch.tensor([0, T], device=dev)
    h0 = torch.randn(1, 8, 128, 128, device=dev)
    plan = runtime.default_plan_for(ops.call_spec(q, v, False))
    lib = runtime.library(plan)
    o = torch.empty_like(v)
    final = torch.empty(1, 8, 128, 128, device=dev)
    workspace = torch.empty(lib.workspace_bytes(T, 1), dtype=torch.uint8, device=dev)
    args = abi.FqtGdnFwdArgs(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), g=g.data_ptr(), beta=beta.data_ptr(),
        cu_seqlens=cu.data_ptr(), initial_state=h0.data_ptr(), final_state=final.data_ptr(), o=o.data_ptr(),
        workspace=workspace.data_ptr(), total_tokens=T, num_seqs=1, scale=128 ** -0.5, use_qk_l2norm=0, prep_schedule=0)
    stream = runtime.current_stream_handle(v.device)
    long = make_rotation(Case(2, 8, (32768,)), 1, dev)[0]  # the protocol's inputs, one 32k sequence

    def long_call(**kw):
        return ops.chunk_gated_delta_rule(long.q, long.k, long.v, long.g, long.beta, initial_state=long.initial_state,
                                          output_final_state=True, cu_seqlens=long.cu_seqlens_long,
                                          cu_seqlens_cpu=long.cu_seqlens_cpu, **kw)

    long_calls = 40  # ~0.4 ms of GPU time and 7 launches each: stay far from a full launch queue
    t0 = time.perf_counter()
    host_path.extension()  # built (or loaded from the cache) before anything is timed
    with torch.no_grad():
        result = {
            "host_extension_ready_s": round(time.perf_counter() - t0, 1),
            "op_32k": both_paths(long_call, long_calls),
            "op_cp_32k": both_paths(lambda: long_call(warmup=CP_TABLE), long_calls),
            "single_32k": per_call_us(lambda: ops.run_checked(long.q, long.k, long.v, long.g, long.beta, None,
                                                              long.initial_state, True, False, False,
                                                              long.cu_seqlens_long, plan_name=""), long_calls),
            "op": both_paths(lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                                output_final_state=True, cu_seqlens=cu)),
            # with the calibrated table; 2048 tokens do not split, so no CP kernel runs
            "op_cp": both_paths(lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                                   output_final_state=True, cu_seqlens=cu,
                                                                   warmup=CP_TABLE)),
            "forward": per_call_us(lambda: runtime.forward(plan, q, k, v, g, beta, cu, h0, 128 ** -0.5, True, False)),
            "launch": per_call_us(lambda: lib.launch(args, stream)),
            "empty": per_call_us(lambda: torch.empty(lib.workspace_bytes(T, 1), dtype=torch.uint8, device=dev)),
            "stream": per_call_us(lambda: runtime.current_stream_handle(v.device)),
            "checks": per_call_us(lambda: ops.check_inputs(q, k, v, g, beta, h0, cu, None, False)),
        }
        short = make_rotation(Case(2, 8, (T,)), 1, dev)[0]
        anchors, skipped = load_impls(["fla", "flashqla"]) if anchors_too else ([], {})
        for impl in anchors:
            result[f"{impl.name}_2k"] = per_call_us(lambda: call(impl, short))
            result[f"{impl.name}_32k"] = per_call_us(lambda: call(impl, long), long_calls)
        for name, why in skipped.items():
            result[f"{name}_skipped"] = why
    result["unit"] = f"us per call, mean of {CALLS} back-to-back calls ({long_calls} for the 32k ones)"
    print(json.dumps(result))
    with open(f"{out_dir}/host_overhead.json", "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--no-anchors" not in sys.argv[2:]))
