// Host side of the backward's per-chunk gradient kernel (gdn_bwd_chunk.cuh): the extern "C"
// argument struct that flashqla_tune/backward/chunk_kernels.py mirrors with ctypes, and the launch.
// Never synchronises; launches on the caller's stream.
#pragma once
#include "gdn_bwd_chunk.cuh"
#include "gdn_kernel_setup.cuh"

#include <cuda_runtime.h>
#include <stdint.h>

#include <cmath>


// Bumped whenever FqtBwdChunkArgs or an exported function changes (the Python mirror checks it).
#define FQT_BWD_CHUNK_ABI_VERSION 6

extern "C" {
// Every tensor is on the device, in the chunk layout of the batched backward ([chunks, H, 64, D],
// pad rows zero), fp32 but for the chains' 16-bit results and q, k, v and dout, whose element
// types qk_dtype and vd_dtype name (fqt::InputDtype: fp32, fp16 or bf16); q, k, dq and dk per q/k
// head (dq and dk summed over its v-heads), everything else per v-head. q, k, v, dout, beta and gamma are read and the five outputs written
// through their element strides (chunk, head, row; columns contiguous; for q, k, v, dout every
// stride whole 16-byte pieces and the base 16-byte aligned, for dq, dk, dv a multiple of 2 and
// 8 bytes), the rest is contiguous.
typedef struct FqtBwdChunkArgs {
  int32_t num_heads;      // Hv
  int32_t num_qk_heads;   // Hqk, dividing Hv
  int64_t num_chunks;
  float dout_scale;       // the op's scale: the kernel's dO is dout_scale times dout
  int32_t qk_dtype;       // fqt::InputDtype of q and k
  int32_t vd_dtype;       // fqt::InputDtype of v and dout
  const void* q;          // [chunks, Hqk, 64, K]
  const void* k;          // [chunks, Hqk, 64, K]
  const void* v;          // [chunks, Hv, 64, V]
  const void* dout;       // dO [chunks, Hv, 64, V]
  const float* beta;      // [chunks, Hv, 64]
  const float* gamma;     // [chunks, Hv, 64] in-chunk cumulative gate
  int64_t q_strides[3], k_strides[3], v_strides[3], dout_strides[3], beta_strides[3], gamma_strides[3];
  const float* a0;        // [chunks, Hv, 64, 64]
  const void* state;      // unit_u S_c [chunks, Hv, K, V], 16-bit (the operand type, as the chains store it)
  const void* dstate;     // unit_d dS_{c+1} [chunks, Hv, K, V], 16-bit
  const void* vn;         // unit_u Vn [chunks, Hv, 64, V], 16-bit
  const void* dvn;        // unit_d dVn [chunks, Hv, 64, V], 16-bit
  const float* unit_u;    // [chunks, Hv] powers of two
  const float* unit_d;    // [chunks, Hv]
  float* dq;              // [chunks, Hqk, 64, K], summed over the q/k head's v-heads
  float* dk;              // [chunks, Hqk, 64, K], summed so
  float* dv;              // [chunks, Hv, 64, V]
  float* dbeta;           // [chunks, Hv, 64]
  float* dg;              // [chunks, Hv, 64]
  int64_t dq_strides[3], dk_strides[3], dv_strides[3], dbeta_strides[3], dg_strides[3];
} FqtBwdChunkArgs;
}

namespace fqt {

// Checks what the kernel relies on, then launches one CTA per (chunk, q/k head), which computes
// its v-heads' tiles in order, or one per SM that walks them (Cfg::Walk).
template <class Cfg>
cudaError_t chunk_grad_launch(const FqtBwdChunkArgs* a, cudaStream_t stream) {
  using Elem = typename Cfg::Elem;
  static_assert(Cfg::SmemBytes <= 227 * 1024, "the CTA's tiles exceed the 227 KiB of shared memory a CTA can have");
  if (a == nullptr) return cudaErrorInvalidValue;
  if (a->num_heads <= 0 || a->num_qk_heads <= 0 || a->num_heads % a->num_qk_heads || a->num_chunks < 0 ||
      !std::isfinite(a->dout_scale) || !valid_input_dtype(a->qk_dtype) || !valid_input_dtype(a->vd_dtype))
    return cudaErrorInvalidValue;
  // the tiles chunks * Hv (and so the grid's x, chunks * Hqk) fewer than 2^31
  if (a->num_chunks * a->num_heads >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  if (a->num_chunks == 0) return cudaSuccess;
  const void* inputs[] = {a->q, a->k, a->v, a->dout, a->beta, a->gamma, a->a0, a->state,
                          a->dstate, a->vn, a->dvn, a->unit_u, a->unit_d};
  const void* outputs[] = {a->dq, a->dk, a->dv, a->dbeta, a->dg};
  for (const void* ptr : inputs)
    if (ptr == nullptr) return cudaErrorInvalidValue;
  for (const void* ptr : outputs)
    if (ptr == nullptr) return cudaErrorInvalidValue;
  // 16-byte loads of the tiles: 16-byte aligned bases, and the strided ones' strides of whole pieces
  const void* tiles[] = {a->q, a->k, a->v, a->dout, a->a0, a->state, a->dstate, a->vn, a->dvn};
  for (const void* ptr : tiles)
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return cudaErrorMisalignedAddress;
  auto piece_elems = [](int32_t dtype) { return dtype == kInputF32 ? 4 : 8; };
  const int64_t qk_piece = piece_elems(a->qk_dtype), vd_piece = piece_elems(a->vd_dtype);
  for (int i = 0; i < 3; ++i)
    if (a->q_strides[i] < 0 || a->q_strides[i] % qk_piece || a->k_strides[i] < 0 || a->k_strides[i] % qk_piece ||
        a->v_strides[i] < 0 || a->v_strides[i] % vd_piece || a->dout_strides[i] < 0 || a->dout_strides[i] % vd_piece)
      return cudaErrorMisalignedAddress;
  // float2 stores of the gradient tiles
  for (const void* ptr : {a->dq, a->dk, a->dv})
    if (reinterpret_cast<uintptr_t>(ptr) % 8) return cudaErrorMisalignedAddress;
  for (const int64_t* st : {a->dq_strides, a->dk_strides, a->dv_strides})
    for (int i = 0; i < 3; ++i)
      if (st[i] < 0 || st[i] % 2) return cudaErrorMisalignedAddress;
  for (const int64_t* st : {a->beta_strides, a->gamma_strides, a->dbeta_strides, a->dg_strides})
    for (int i = 0; i < 3; ++i)
      if (st[i] < 0) return cudaErrorInvalidValue;
  auto strides = [](const int64_t* st) { return ChunkStrides{st[0], st[1], st[2]}; };

  const cudaError_t setup = allow_dynamic_smem_once<gdn_bwd_chunk_kernel<Cfg>>(Cfg::SmemBytes);
  if (setup != cudaSuccess) return setup;

  ChunkGradParams<Cfg> p{a->q, a->k, a->v, a->dout, a->beta, a->gamma,
                         strides(a->q_strides), strides(a->k_strides), strides(a->v_strides),
                         strides(a->dout_strides), strides(a->beta_strides), strides(a->gamma_strides),
                         a->a0, static_cast<const Elem*>(a->state), static_cast<const Elem*>(a->dstate),
                         static_cast<const Elem*>(a->vn), static_cast<const Elem*>(a->dvn), a->unit_u, a->unit_d,
                         a->dq, a->dk, a->dv, a->dbeta, a->dg,
                         strides(a->dq_strides), strides(a->dk_strides), strides(a->dv_strides),
                         strides(a->dbeta_strides), strides(a->dg_strides),
                         a->num_chunks, a->dout_scale, a->num_heads, a->num_qk_heads, a->qk_dtype, a->vd_dtype};
  int64_t ctas = a->num_chunks * a->num_qk_heads;  // one an item, or one per SM walking them (Cfg::Walk)
  if constexpr (Cfg::Walk) {
    int device = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return e;
    ctas = ctas < sms ? ctas : sms;
  }
  gdn_bwd_chunk_kernel<Cfg><<<dim3(unsigned(ctas)), Cfg::Threads, Cfg::SmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fqt
