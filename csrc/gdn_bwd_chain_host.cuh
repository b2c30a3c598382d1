// Host side of the backward's chain kernels (gdn_bwd_chain.cuh): the extern "C" argument struct
// that flashqla_tune/backward/chain_kernels.py mirrors with ctypes, TMA descriptors, the launch.
// Never synchronises; launches on the caller's stream.
#pragma once
#include "gdn_bwd_chain.cuh"

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

// Bumped whenever FqtBwdChainArgs or an exported function changes (the Python mirror checks it).
#define FQT_BWD_CHAIN_ABI_VERSION 1

extern "C" {
// Every tensor is contiguous, on the device, in the chunk layout of the batched backward
// ([chunks, Hv, 64, D], a sequence's chunks consecutive, pad rows zero).
typedef struct FqtBwdChainArgs {
  int32_t direction;            // 0: the states (kStates), 1: the gradients (kGradients)
  int32_t num_heads;            // Hv
  int64_t num_chunks;
  int64_t num_seqs;
  const void* w;                // 16-bit [chunks, Hv, 64, K]
  const void* kd;               // 16-bit [chunks, Hv, 64, K]
  const void* qd;               // 16-bit [chunks, Hv, 64, K] (gradients)
  const void* dout;             // 16-bit [chunks, Hv, 64, V], the scale folded in (gradients)
  const float* add;             // fp32 [chunks, Hv, V / block_v, 64, block_v]: u, or scale P^T dO
  const float* decay;           // fp32 [chunks, Hv]: e^{gamma_C}
  const int64_t* chunk_offsets; // int64 [num_seqs + 1]: each sequence's first chunk, then the total
  const float* state_in;        // fp32 [num_seqs, Hv, K, V] h0 or dht; null: zeros
  float* state_out;             // fp32 [num_seqs, Hv, K, V] final state or dh0; null: not written
  float* chunk_states;          // fp32 [chunks, Hv, K, V]: S_c or dS_{c+1}
  float* chunk_values;          // fp32 [chunks, Hv, 64, V]: Vn or dVn; null: not written
} FqtBwdChainArgs;
}

namespace fqt {

template <class Cfg>
cudaError_t chain_launch(const FqtBwdChainArgs& a, cudaStream_t stream) {
  using Elem = typename Cfg::Elem;
  constexpr int kMaxDevices = 64;
  struct Setup {
    std::once_flag once;
    cudaError_t error = cudaSuccess;
  };
  static Setup setups[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  Setup& setup = setups[device];
  std::call_once(setup.once, [&] {
    setup.error = cudaFuncSetAttribute(gdn_bwd_chain_kernel<Cfg>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Cfg::SmemBytes);
  });
  if (setup.error != cudaSuccess) return setup.error;

  const int64_t rows = a.num_chunks * a.num_heads * kChunk;
  ChainParams<Cfg> p{
      Cfg::tma_tk(static_cast<const Elem*>(a.w), rows),
      Cfg::tma_tk(static_cast<const Elem*>(a.kd), rows),
      Cfg::tma_tk(static_cast<const Elem*>(Cfg::Gradients ? a.qd : a.w), rows),
      Cfg::tma_vt(static_cast<const Elem*>(Cfg::Gradients ? a.dout : a.w), Cfg::Gradients ? rows : 64),
      a.add,
      a.decay,
      a.chunk_offsets,
      a.state_in,
      a.state_out,
      a.chunk_states,
      a.chunk_values,
      a.num_chunks,
      a.num_heads,
  };
  const dim3 grid(unsigned(a.num_seqs * (Cfg::HeadV / Cfg::BlockV)), unsigned(a.num_heads));
  gdn_bwd_chain_kernel<Cfg><<<grid, Cfg::Threads, Cfg::SmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Checks what the kernels rely on, then launches the direction asked for.
template <class States, class Gradients>
cudaError_t chain_dispatch(const FqtBwdChainArgs* a, cudaStream_t stream) {
  if (a == nullptr) return cudaErrorInvalidValue;
  const bool gradients = a->direction == int32_t(ChainDirection::kGradients);
  if (!gradients && a->direction != int32_t(ChainDirection::kStates)) return cudaErrorInvalidValue;
  if (a->num_heads <= 0 || a->num_chunks < 0 || a->num_seqs < 0) return cudaErrorInvalidValue;
  // TMA coordinates are int32 (chunk rows of all heads), and so is the grid's x; its y (the
  // v-heads) has 16 bits.
  if (a->num_chunks * a->num_heads * kChunk >= (int64_t(1) << 31) || a->num_heads >= (1 << 16) ||
      a->num_seqs * (States::HeadV / States::BlockV) >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  if (a->num_seqs == 0) return cudaSuccess;
  if (a->chunk_offsets == nullptr || (a->num_chunks > 0 && (a->w == nullptr || a->kd == nullptr || a->add == nullptr ||
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
