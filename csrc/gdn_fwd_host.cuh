// Host side of the GDN forward: workspace layout, TMA descriptors, launches. Never synchronises.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "gdn_abi.h"
#include "gdn_fwd_mainloop.cuh"
#include "gdn_prep.cuh"

namespace fqt {

inline int64_t align256(int64_t x) { return (x + 255) / 256 * 256; }

// Scratch: normalised q and k (token-indexed), then slot-indexed gamma, Aw and P.
template <class Cfg>
struct Workspace {
  int64_t qn, kn, gamma, aw, p, total;
  Workspace(int64_t T, int64_t N) {
    const int64_t slots = num_chunk_slots(T, N);
    const int64_t qk_bytes = align256(T * Cfg::Hqk * Cfg::HeadK * int64_t(sizeof(typename Cfg::Elem)));
    const int64_t mat_bytes = align256(int64_t(Cfg::Hv) * slots * kChunk * kChunk * int64_t(sizeof(typename Cfg::Elem)));
    qn = 0;
    kn = qn + qk_bytes;
    gamma = kn + qk_bytes;
    aw = gamma + align256(int64_t(Cfg::Hv) * slots * kChunk * int64_t(sizeof(float)));
    p = aw + mat_bytes;
    total = p + mat_bytes;
  }
};

template <class Cfg>
cudaError_t gdn_fwd_launch(const FqtGdnFwdArgs& a, cudaStream_t stream) {
  using Elem = typename Cfg::Elem;
  const int64_t T = a.total_tokens, N = a.num_seqs;
  if (N <= 0 || T < 0) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;  // nothing to compute; final states are handled by the caller
  const int64_t slots = num_chunk_slots(T, N);
  const Workspace<Cfg> ws(T, N);
  char* base = static_cast<char*>(a.workspace);

  static bool attributes_set = false;  // per process and plan: the attribute is a property of the function
  constexpr int prep_smem = PrepConfig<Elem, Cfg::HeadK>::SmemBytes;
  auto prep = gdn_prep_kernel<Elem, Cfg::Hqk, Cfg::Hv, Cfg::HeadK>;
  auto main_kernel = gdn_fwd_kernel<Cfg>;
  if (!attributes_set) {
    cudaError_t err = cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, prep_smem);
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(main_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SmemBytes);
    if (err != cudaSuccess) return err;
    attributes_set = true;
  }

  PrepArgs pa;
  pa.q = a.q;
  pa.k = a.k;
  pa.g = a.g;
  pa.beta = a.beta;
  pa.cu_seqlens = a.cu_seqlens;
  pa.q_normed = base + ws.qn;
  pa.k_normed = base + ws.kn;
  pa.gamma = reinterpret_cast<float*>(base + ws.gamma);
  pa.aw = base + ws.aw;
  pa.p = base + ws.p;
  pa.total_tokens = T;
  pa.num_seqs = N;
  pa.num_slots = slots;
  pa.scale = a.scale;
  pa.use_qk_l2norm = a.use_qk_l2norm;
  if (slots > 0x7fffffff) return cudaErrorInvalidValue;
  prep<<<dim3(unsigned(slots), Cfg::Hqk), kPrepThreads, prep_smem, stream>>>(pa);
  cudaError_t err = cudaGetLastError();
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
      a.cu_seqlens,
      a.initial_state,
      a.final_state,
      static_cast<Elem*>(a.o),
      T,
      N,
      slots,
      a.scale,
  };
  if (N > 65535) return cudaErrorInvalidValue;
  dim3 grid(Cfg::HeadV / Cfg::BlockV, Cfg::Hv, unsigned(N));
  main_kernel<<<grid, Cfg::Threads, Cfg::SmemBytes, stream>>>(fp);
  return cudaGetLastError();
}

template <class Cfg>
int64_t gdn_fwd_workspace_bytes(int64_t T, int64_t N) {
  return Workspace<Cfg>(T, N).total;
}

}  // namespace fqt
