// Host side of the GDN forward: workspace layout, TMA descriptors, launches. Never synchronises.
//
// Two launches per call without context parallelism (five with it, six with more than
// kFusedSegmentSeqs sequences: gdn_cp.cuh lists them): the prep kernel
// (parallel over chunks), then the sequential kernel as its programmatic dependent (PDL). When the
// sequential grid leaves most SMs idle (few heads, few long sequences), the two overlap: the prep
// runs on the idle SMs in chunk order and publishes each item, and the sequential kernel consumes
// items as they become ready. Otherwise the prep fills the GPU and the sequential kernel only
// hides its launch and prologue behind it.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>
#include <type_traits>

#include "gdn_abi.h"
#include "gdn_cp.cuh"
#include "gdn_fwd_mainloop.cuh"
#include "gdn_gate_options.cuh"
#include "gdn_prep.cuh"
#include "gdn_segment_policy.h"  // kMaxSequences, kMaxSegments

namespace fqt {

inline int64_t align256(int64_t x) { return (x + 255) / 256 * 256; }

constexpr int kMaxDevices = 64;
struct DeviceSetup {
  std::once_flag once;
  cudaError_t error = cudaSuccess;
  int sm_count = 0;
  int prep_ctas_per_sm = 1;
};

// Scratch: normalised q and k (token-indexed), then slot-indexed gamma, Aw and P, then the
// prep's ready flags [Hqk, slots]; with context parallelism (segments > 0) then the segment
// tables, the jobs, the forward pass's job order and the fp32 boundary, H and M states of up to
// `segments` segments.
template <class Cfg>
struct Workspace {
  int64_t qn, kn, gamma, aw, p, ready, total;
  int64_t segments = 0, seg_seq = 0, seg_index = 0, seq_first = 0, seq_count = 0, jobs_state = 0, jobs_fwd = 0,
          exact = 0, fwd_order = 0, boundary = 0, h_end = 0, m_end = 0;
  Workspace(int64_t T, int64_t N, int64_t max_segments) {
    const int64_t slots = num_chunk_slots(T, N);
    const int64_t qk_bytes = align256(T * Cfg::Hqk * Cfg::HeadK * int64_t(sizeof(typename Cfg::Elem)));
    const int64_t mat_bytes = align256(int64_t(Cfg::Hv) * slots * kChunk * kChunk * int64_t(sizeof(typename Cfg::Elem)));
    qn = 0;
    kn = qn + qk_bytes;
    gamma = kn + qk_bytes;
    aw = gamma + align256(int64_t(Cfg::Hv) * slots * kChunk * int64_t(sizeof(float)));
    p = aw + mat_bytes;
    ready = p + mat_bytes;
    total = ready + align256(int64_t(Cfg::Hqk) * slots * int64_t(sizeof(uint32_t)));
    if (max_segments <= 0) return;
    const int64_t S = segments = max_segments;
    const int64_t states = align256(S * Cfg::Hv * int64_t(Cfg::HeadK) * Cfg::HeadV * int64_t(sizeof(float)));
    seg_seq = total;
    seg_index = seg_seq + align256(S * 4);
    seq_first = seg_index + align256(S * 4);
    seq_count = seq_first + align256(N * 8);
    jobs_state = seq_count + align256(N * 4);
    jobs_fwd = jobs_state + align256(3 * S * Cfg::Hv * int64_t(sizeof(CpJob)));
    exact = jobs_fwd + align256(S * Cfg::Hv * int64_t(sizeof(CpJob)));
    fwd_order = exact + align256(S * Cfg::Hv * 4);
    boundary = fwd_order + align256(S * 4);
    h_end = boundary + states;
    m_end = h_end + states;
    total = m_end + states;
  }
};

// `kernel` as the programmatic dependent of the kernel before it on the stream: it may start
// before that kernel ends, so it must wait for it (griddepcontrol.wait) before reading its output.
template <class Kernel, class Args>
cudaError_t launch_dependent(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, const Args& args,
                             cudaStream_t stream) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args);
}

// The sequential kernel, one CTA per (v tile, v-head, grid z: a sequence, or a CP job row), as
// the programmatic dependent of the kernel before it on the stream (the prep; with CP, the chain):
// its launch and prologue hide behind that kernel.
template <class Cfg, class Kernel>
cudaError_t launch_programmatic(Kernel kernel, const FwdParams<Cfg>& fp, int64_t grid_z, cudaStream_t stream) {
  return launch_dependent(kernel, dim3(Cfg::HeadV / Cfg::BlockV, Cfg::Hv, unsigned(grid_z)), dim3(Cfg::Threads),
                          Cfg::SmemBytes, fp, stream);
}

// The in-kernel gate's parameters of a call: read from the arguments only by a plan that computes
// the gate (a caller built before these fields passes a struct without them).
template <class Gates>
GateInputs gate_inputs_of(const FqtGdnFwdArgs& a) {
  if constexpr (Gates::GateInKernel) return GateInputs{a.a_log, a.dt_bias};
  else return GateInputs{nullptr, nullptr};
}

// The context-parallel planning kernels' arguments: the call's inputs and tables, and where
// their plan goes in the workspace.
template <class Cfg, class Gates>
CpPlanArgs cp_plan_args(const FqtGdnFwdArgs& a, const Workspace<Cfg>& ws, char* base) {
  return CpPlanArgs{a.cu_seqlens,
                    a.segment_chunks,
                    a.warmup,
                    a.g,
                    a.beta,
                    a.k,
                    a.initial_state,
                    a.final_state,
                    reinterpret_cast<int32_t*>(base + ws.seg_seq),
                    reinterpret_cast<int32_t*>(base + ws.seg_index),
                    reinterpret_cast<int64_t*>(base + ws.seq_first),
                    reinterpret_cast<int32_t*>(base + ws.seq_count),
                    reinterpret_cast<CpJob*>(base + ws.jobs_state),
                    reinterpret_cast<CpJob*>(base + ws.jobs_fwd),
                    reinterpret_cast<int32_t*>(base + ws.exact),
                    reinterpret_cast<int32_t*>(base + ws.fwd_order),
                    reinterpret_cast<float*>(base + ws.boundary),
                    reinterpret_cast<float*>(base + ws.h_end),
                    reinterpret_cast<float*>(base + ws.m_end),
                    a.total_tokens,
                    a.num_seqs,
                    ws.segments,
                    a.log_eps,
                    a.use_qk_l2norm,
                    a.num_seqs <= kFusedSegmentSeqs ? 1 : 0,
                    gate_inputs_of<Gates>(a)};  // the guard reads g and beta as the prep does
}

// Column slices of the exact chain, one CTA each per (sequence, v-head). Only exact heads' CTAs
// work (the others return at once), and a narrower slice walks the chain faster: each step's
// 128 x 128 fp32 product has fewer columns per thread. The narrowest width is taken whose working
// CTAs, counted from the table's exact heads, fit on the SMs at once (the measurements behind the
// rule: docs/kernel-notes.md).
template <int HeadV>
int chain_columns(int64_t num_seqs, int32_t exact_heads, int sm_count) {
  const int64_t heads = exact_heads > 0 ? exact_heads : 1;  // a failed guard may chain any head
  for (int columns : {4, 8})
    if (num_seqs * heads * (HeadV / columns) <= sm_count) return columns;
  return 16;
}

template <class Cfg, int Columns>
cudaError_t launch_chain(const CpPlanArgs& pa, cudaStream_t stream) {
  cp_chain_kernel<Cfg::Hv, Cfg::HeadK, Cfg::HeadV, Cfg::StateVFirst, Columns>
      <<<dim3(unsigned(pa.num_seqs), Cfg::Hv, Cfg::HeadV / Columns), kChainThreads,
         chain_smem_bytes<Cfg::HeadK, Columns>(), stream>>>(pa);
  return cudaGetLastError();
}

// After the prep (whose CTAs planned the jobs once their items were done): the state pass, the
// exact chain, the forward pass. The segments kernel, when the call needs it, ran before the prep.
template <class Cfg>
cudaError_t gdn_fwd_cp_launch(const FqtGdnFwdArgs& a, const CpPlanArgs& pa, FwdParams<Cfg> fp, int sm_count,
                              cudaStream_t stream) {
  static_assert(Cfg::HeadK == Cfg::HeadV, "a transition job (S = I) needs K = V");
  const int64_t S = pa.num_segments;
  cudaError_t err = cudaSuccess;
  fp.initial_state = nullptr;
  fp.final_state = nullptr;
  fp.ready = nullptr;
  fp.jobs = pa.jobs_state;
  const dim3 tiles_heads(Cfg::HeadV / Cfg::BlockV, Cfg::Hv);
  gdn_fwd_kernel<Cfg, true><<<dim3(tiles_heads.x, tiles_heads.y, unsigned(3 * S)), Cfg::Threads, Cfg::SmemBytes, stream>>>(fp);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  // The chain needs the state pass. The forward pass is the chain's programmatic dependent: its
  // unchained half (grid z < S) runs beside the chain, its chained half waits for it in the kernel.
  // The results are the same bit for bit whatever the chain's column width.
  switch (chain_columns<Cfg::HeadV>(a.num_seqs, a.exact_heads, sm_count)) {
    case 4: err = launch_chain<Cfg, 4>(pa, stream); break;
    case 8: err = launch_chain<Cfg, 8>(pa, stream); break;
    default: err = launch_chain<Cfg, 16>(pa, stream); break;
  }
  if (err != cudaSuccess) return err;
  fp.jobs = pa.jobs_fwd;
  fp.job_pass = kUnchainedThenChained;
  fp.job_order = pa.fwd_order;
  return launch_programmatic<Cfg>(gdn_fwd_kernel<Cfg>, fp, 2 * S, stream);
}

// Gates: the plan's in-kernel gate and beta options (gdn_gate_options.cuh). Only the prep and the
// guard read the call's g and beta; with an in-kernel gate a.a_log must be given.
template <class Cfg, class Gates = PrecomputedGates>
cudaError_t gdn_fwd_launch(const FqtGdnFwdArgs& a, cudaStream_t stream) {
  using Elem = typename Cfg::Elem;
  const int64_t T = a.total_tokens, N = a.num_seqs;
  if (N <= 0 || T < 0) return cudaErrorInvalidValue;
  if (Gates::GateInKernel && a.a_log == nullptr) return cudaErrorInvalidValue;
  const GateInputs gate_inputs = gate_inputs_of<Gates>(a);
  if (T == 0) return cudaSuccess;  // nothing to compute; final states are handled by the caller
  const bool cp = a.warmup != nullptr;
  if (cp && (a.segment_chunks == nullptr || a.max_segments < N || a.max_segments > kMaxSegments))
    return cudaErrorInvalidValue;
  const int64_t slots = num_chunk_slots(T, N);
  const Workspace<Cfg> ws(T, N, cp ? a.max_segments : 0);
  char* base = static_cast<char*>(a.workspace);

  using PrepCfg = PrepConfig<Elem, Cfg::Hqk, Cfg::HeadK, Cfg::PrepThreads>;
  auto prep = gdn_prep_kernel<Elem, Cfg::Hqk, Cfg::Hv, Cfg::HeadK, Cfg::PrepThreads, Gates>;
  auto main_kernel = gdn_fwd_kernel<Cfg>;
  // Once per device and plan (thread-safe): function attributes and occupancy belong to the
  // device's copy of the kernels, the SM count to the device.
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  static DeviceSetup setups[kMaxDevices];
  DeviceSetup& setup = setups[device];
  std::call_once(setup.once, [&] {
    int sms = 0, per_sm = 0;
    cudaError_t e = cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, PrepCfg::SmemBytes);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(main_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SmemBytes);
    if constexpr (TwoPerSmConfig<Cfg>::exists) {
      using Two = typename TwoPerSmConfig<Cfg>::type;
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(gdn_fwd_kernel<Two>, cudaFuncAttributeMaxDynamicSharedMemorySize, Two::SmemBytes);
    }
    if (e == cudaSuccess)  // the context-parallel state pass
      e = cudaFuncSetAttribute(gdn_fwd_kernel<Cfg, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SmemBytes);
    if (e == cudaSuccess)  // the exact chain's three column widths
      e = cudaFuncSetAttribute(cp_chain_kernel<Cfg::Hv, Cfg::HeadK, Cfg::HeadV, Cfg::StateVFirst, 4>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, chain_smem_bytes<Cfg::HeadK, 4>());
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(cp_chain_kernel<Cfg::Hv, Cfg::HeadK, Cfg::HeadV, Cfg::StateVFirst, 8>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, chain_smem_bytes<Cfg::HeadK, 8>());
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(cp_chain_kernel<Cfg::Hv, Cfg::HeadK, Cfg::HeadV, Cfg::StateVFirst, 16>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, chain_smem_bytes<Cfg::HeadK, 16>());
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prep, PrepCfg::Threads, PrepCfg::SmemBytes);
    setup.error = e;
    setup.sm_count = sms;
    setup.prep_ctas_per_sm = per_sm > 0 ? per_sm : 1;
  });
  if (setup.error != cudaSuccess) return setup.error;
  const int sm_count = setup.sm_count, prep_ctas_per_sm = setup.prep_ctas_per_sm;
  if (a.prep_schedule != FQT_PREP_AUTO && a.prep_schedule != FQT_PREP_SERIAL && a.prep_schedule != FQT_PREP_OVERLAP)
    return cudaErrorInvalidValue;

  if (slots > 0x7fffffff || N > kMaxSequences) return cudaErrorInvalidValue;
  const int64_t main_ctas = int64_t(Cfg::HeadV / Cfg::BlockV) * Cfg::Hv * N;
  const int64_t main_sms = (main_ctas + Cfg::CtasPerSm - 1) / Cfg::CtasPerSm;
  // Overlap pays when the free SMs produce items faster than the chains consume them (N x Hqk
  // items per chunk step) and the sequences are long enough to amortise waiting for the first
  // item; the thresholds come from measurements in docs/kernel-notes.md.
  const int64_t free_sms = sm_count - main_sms;
  bool overlap = free_sms >= 12 * N * Cfg::Hqk && T >= 4096 * N;
  if (a.prep_schedule == FQT_PREP_SERIAL) overlap = false;
  // Forced overlap needs one free SM; with few it is correct but slow (a test and benchmark switch).
  if (a.prep_schedule == FQT_PREP_OVERLAP) overlap = main_sms < sm_count;
  if (cp) overlap = false;  // the state passes read the whole prep output

  PrepArgs<PrepCfg> pa{
      PrepCfg::tma_qk(static_cast<const Elem*>(a.q), T),
      PrepCfg::tma_qk(static_cast<const Elem*>(a.k), T),
      a.g,
      a.beta,
      a.cu_seqlens,
      base + ws.qn,
      base + ws.kn,
      reinterpret_cast<float*>(base + ws.gamma),
      base + ws.aw,
      base + ws.p,
      overlap ? reinterpret_cast<uint32_t*>(base + ws.ready) : nullptr,
      T,
      N,
      slots,
      0,
      a.scale,
      a.use_qk_l2norm,
      overlap ? kChunkMajor : kSlotMajor,
      CpPlanArgs{},  // no job rows unless the call is context-parallel (below)
      gate_inputs,
  };
  int64_t prep_ctas;
  if (overlap) {
    // Chunk c of every sequence before chunk c + 1 of any; the prep keeps to the SMs the
    // sequential grid leaves (one CTA each, so the sequential CTAs find whole SMs free).
    pa.num_items = ((T + kChunk - 1) / kChunk) * N * Cfg::Hqk;
    prep_ctas = sm_count - main_sms;
    err = cudaMemsetAsync(pa.ready, 0, size_t(Cfg::Hqk) * size_t(slots) * sizeof(uint32_t), stream);
    if (err != cudaSuccess) return err;
  } else {
    pa.num_items = slots * Cfg::Hqk;
    prep_ctas = int64_t(sm_count) * prep_ctas_per_sm;
  }
  prep_ctas = prep_ctas < pa.num_items ? prep_ctas : pa.num_items;
  CpPlanArgs cpa{};
  if (cp) {
    cpa = cp_plan_args<Cfg, Gates>(a, ws, base);
    pa.cp = cpa;  // the prep's CTAs plan the jobs after their items
    if (!cpa.fused_segments) {  // many sequences: one CTA plans them all first (it reads only inputs)
      cp_segments_kernel<<<1, kPlanThreads, 0, stream>>>(cpa);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }
  prep<<<unsigned(prep_ctas > 0 ? prep_ctas : 1), PrepCfg::Threads, PrepCfg::SmemBytes, stream>>>(pa);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  const Elem* q = static_cast<const Elem*>(a.use_qk_l2norm ? pa.q_normed : a.q);
  const Elem* k = static_cast<const Elem*>(a.use_qk_l2norm ? pa.k_normed : a.k);
  const int64_t mat_rows = int64_t(Cfg::Hv) * slots * kChunk;
  FwdParams<Cfg> fp{
      Cfg::tma_qk(q, T),
      Cfg::tma_qk(k, T),
      Cfg::tma_v(static_cast<const Elem*>(a.v), T),
      Cfg::tma_mat(static_cast<const Elem*>(pa.aw), mat_rows),
      Cfg::tma_mat(static_cast<const Elem*>(pa.p), mat_rows),
      pa.gamma,
      pa.ready,
      a.cu_seqlens,
      a.initial_state,
      a.final_state,
      nullptr,
      static_cast<Elem*>(a.o),
      T,
      N,
      slots,
      a.scale,
  };
  if (cp) return gdn_fwd_cp_launch<Cfg>(a, cpa, fp, sm_count, stream);
  if constexpr (TwoPerSmConfig<Cfg>::exists) {
    // More chains than SMs: two per SM in one wave instead of two waves (no prep overlap then).
    using Two = typename TwoPerSmConfig<Cfg>::type;
    static_assert(std::is_same_v<FwdParams<Two>, FwdParams<Cfg>>, "the two configurations must load the same tiles");
    if (main_ctas > sm_count && !overlap) return launch_programmatic<Two>(gdn_fwd_kernel<Two>, fp, N, stream);
  }
  return launch_programmatic<Cfg>(main_kernel, fp, N, stream);
}

template <class Cfg>
int64_t gdn_fwd_workspace_bytes(int64_t T, int64_t N, int64_t max_segments) {
  return Workspace<Cfg>(T, N, max_segments).total;
}

}  // namespace fqt
