// Host side of the backward's chain kernels (gdn_bwd_chain.cuh): the extern "C" argument struct
// that flashqla_tune/backward/chain_kernels.py mirrors with ctypes, TMA descriptors, the launch.
// Never synchronises; launches on the caller's stream.
#pragma once
#include "gdn_bwd_chain.cuh"
#include "gdn_kernel_setup.cuh"

#include <cuda_runtime.h>
#include <stdint.h>


// Bumped whenever FqtBwdChainArgs or an exported function changes (the Python mirror checks it).
#define FQT_BWD_CHAIN_ABI_VERSION 4

extern "C" {
// Every tensor is contiguous, on the device, in the chunk layout of the batched backward
// ([chunks, Hv, 64, D], a sequence's chunks consecutive, pad rows zero).
typedef struct FqtBwdChainArgs {
  int32_t direction;            // 0: the states (kStates), 1: the gradients (kGradients)
  int32_t num_heads;            // Hv
  int64_t num_chunks;
  int64_t num_seqs;
  int64_t num_segments;
  float log_eps;                // the warm-up guard's bound, log(eps)
  int32_t reserved;             // zero
  const void* w;                // 16-bit [chunks, Hv, 64, K]
  const void* kd;               // 16-bit [chunks, Hv, 64, K]
  const void* qd;               // 16-bit [chunks, Hv, 64, K] (gradients)
  const void* dout;             // 16-bit [chunks, Hv, 64, V] (gradients); qd^T dout is (D Q)^T scale dO
  const float* add;             // fp32 [chunks, Hv, V / block_v, 64, block_v]: u, or scale P^T dO
  const float* add_scale;       // fp32 [chunks, Hv]: each chunk's add is read times this; null: 1
  const float* decay;           // fp32 [chunks, Hv]: e^{gamma_C}
  const int64_t* segments;      // int64 [num_segments, 5]: the sequence's first chunk, the segment's first
                                // and end chunks, the sequence's end chunk, the sequence (-1: unused)
  const int32_t* warmup;        // int32 [Hv]: warm-up window per v-head in chunks (<= 0 exact); null: exact
  const float* window_log_decay;  // fp32 [chunks, Hv]: gamma_C, +inf where a token has b |k|^2 outside [0, 2]
  const float* state_in;        // fp32 [num_seqs, Hv, K, V] h0 or dht; null: zeros
  float* state_out;             // fp32 [num_seqs, Hv, K, V] final state or dh0; null: not written
  void* chunk_states;           // 16-bit [chunks, Hv, K, V]: S_c or dS_{c+1}
  void* chunk_values;           // 16-bit [chunks, Hv, 64, V]: Vn or dVn; null: not written
} FqtBwdChainArgs;
}

namespace fqt {

template <class Cfg>
cudaError_t chain_launch(const FqtBwdChainArgs& a, cudaStream_t stream) {
  using Elem = typename Cfg::Elem;
  const cudaError_t setup = allow_dynamic_smem_once<gdn_bwd_chain_kernel<Cfg>>(Cfg::SmemBytes);
  if (setup != cudaSuccess) return setup;

  const int64_t rows = a.num_chunks * a.num_heads * kChunk;
  ChainParams<Cfg> p{
      Cfg::tma_tk(static_cast<const Elem*>(a.w), rows),
      Cfg::tma_tk(static_cast<const Elem*>(a.kd), rows),
      Cfg::tma_tk(static_cast<const Elem*>(Cfg::Gradients ? a.qd : a.w), rows),
      Cfg::tma_vt(static_cast<const Elem*>(Cfg::Gradients ? a.dout : a.w), Cfg::Gradients ? rows : 64),
      a.add,
      a.add_scale,
      a.decay,
      a.segments,
      a.warmup,
      a.window_log_decay,
      a.state_in,
      a.state_out,
      static_cast<Elem*>(a.chunk_states),
      static_cast<Elem*>(a.chunk_values),
      a.num_chunks,
      a.num_seqs,
      a.log_eps,
      a.num_heads,
      a.num_segments,
  };
  const dim3 grid(unsigned(a.num_segments * (Cfg::HeadV / Cfg::BlockV)), unsigned(a.num_heads));
  gdn_bwd_chain_kernel<Cfg><<<grid, Cfg::Threads, Cfg::SmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Checks what the kernels rely on, then launches the direction asked for.
template <class States, class Gradients>
cudaError_t chain_dispatch(const FqtBwdChainArgs* a, cudaStream_t stream) {
  if (a == nullptr) return cudaErrorInvalidValue;
  const bool gradients = a->direction == int32_t(ChainDirection::kGradients);
  if (!gradients && a->direction != int32_t(ChainDirection::kStates)) return cudaErrorInvalidValue;
  if (a->num_heads <= 0 || a->num_chunks < 0 || a->num_seqs < 0 || a->num_segments < a->num_seqs || a->reserved != 0)
    return cudaErrorInvalidValue;
  // TMA coordinates are int32 (chunk rows of all heads), and so is the grid's x; its y (the
  // v-heads) has 16 bits.
  if (a->num_chunks * a->num_heads * kChunk >= (int64_t(1) << 31) || a->num_heads >= (1 << 16) ||
      a->num_segments * (States::HeadV / States::BlockV) >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  if (a->num_seqs == 0) return cudaSuccess;
  // A warm-up needs its guard's inputs; a log(eps) of 0 or more would let any window pass.
  if ((a->warmup == nullptr) != (a->window_log_decay == nullptr) || (a->warmup != nullptr && !(a->log_eps < 0.f)))
    return cudaErrorInvalidValue;
  if (a->segments == nullptr || (a->num_chunks > 0 && (a->w == nullptr || a->kd == nullptr || a->add == nullptr ||
                                                       a->decay == nullptr || a->chunk_states == nullptr)))
    return cudaErrorInvalidValue;
  if (gradients && a->num_chunks > 0 && (a->qd == nullptr || a->dout == nullptr)) return cudaErrorInvalidValue;
  if (a->num_chunks == 0) {
    // No chunk to walk: every sequence is empty and the end state is the start state.
    if (a->state_out == nullptr) return cudaSuccess;
    const size_t bytes = size_t(a->num_seqs) * a->num_heads * States::HeadK * States::HeadV * sizeof(float);
    return a->state_in ? cudaMemcpyAsync(a->state_out, a->state_in, bytes, cudaMemcpyDeviceToDevice, stream)
                       : cudaMemsetAsync(a->state_out, 0, bytes, stream);
  }
  return gradients ? chain_launch<Gradients>(*a, stream) : chain_launch<States>(*a, stream);
}

}  // namespace fqt
