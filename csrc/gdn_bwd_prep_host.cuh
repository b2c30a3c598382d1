// Host side of the backward's prep kernel (gdn_bwd_prep.cuh): the extern "C" argument struct that
// flashqla_tune/backward/prep_kernels.py mirrors with ctypes, the q/k TMA descriptors, the launch.
// Never synchronises; launches on the caller's stream.
#pragma once
#include "gdn_bwd_prep.cuh"
#include "gdn_kernel_setup.cuh"

#include <cuda_runtime.h>
#include <stdint.h>

#include <cmath>


// Bumped whenever FqtBwdPrepArgs, an exported function or what an output holds changes (the Python
// mirror checks it, so a library built for another meaning is refused, never read).
#define FQT_BWD_PREP_ABI_VERSION 4

extern "C" {
// Every tensor is on the device in the padded chunk layout of the batched backward ([chunks, H,
// 64, D], pad rows zero); q and k per q/k head, everything else per v-head. Contiguous but v and
// dout, whose last dim is contiguous and whose other strides (elements) are given, in the element
// type vd_dtype names (fqt::InputDtype: fp32, fp16 or bf16).
typedef struct FqtBwdPrepArgs {
  int32_t num_heads;          // Hv
  int32_t num_qk_heads;       // Hqk, dividing Hv
  int64_t num_chunks;
  float dout_scale;           // the op's scale: ptdo is dout_scale P^T dO
  float qd_scale;             // qd is qd_scale D Q (the backward passes the mantissa of dout_scale)
  int32_t add_block_v;        // the library's u / ptdo tile width (the chain kernels' block_v), checked
  const void* q;              // 16-bit [chunks, Hqk, 64, K]
  const void* k;              // 16-bit [chunks, Hqk, 64, K]
  const float* g;             // fp32 [chunks, Hv, 64]
  const float* beta;          // fp32 [chunks, Hv, 64]
  const void* v;              // [chunks, Hv, 64, V] of vd_dtype, strides v_stride
  const void* dout;           // dO, as v
  int64_t v_stride[3];        // chunk, head, row (16-byte multiples), in elements
  int64_t dout_stride[3];
  int32_t vd_dtype;           // fqt::InputDtype of v and dout
  void* w;                    // 16-bit [chunks, Hv, 64, K]: T D K
  void* kd;                   // 16-bit [chunks, Hv, 64, K]: diag(e^{gamma_C - gamma}) K
  void* qd;                   // 16-bit [chunks, Hv, 64, K]: qd_scale D Q
  float* u;                   // fp32 [chunks, Hv, V / add_block_v, 64, add_block_v]: T V
  float* ptdo;                // fp32, as u: dout_scale P^T dO
  float* decay;               // fp32 [chunks, Hv]: e^{gamma_C}
  float* gamma;               // fp32 [chunks, Hv, 64]
  float* a;                   // fp32 [chunks, Hv, 64, 64]: Gamma * A0; null: not written
  float* a0;                  // fp32 [chunks, Hv, 64, 64]: A0; null: not written
  float* dout_amax;           // fp32 [chunks, Hv]: the largest |dout| of each tile; null: not written
  float* u_amax;              // fp32 [chunks, Hv]: the largest |u| of each tile as stored; null: not written
} FqtBwdPrepArgs;
}

namespace fqt {

template <class Cfg>
cudaError_t bwd_prep_dispatch(const FqtBwdPrepArgs* a, cudaStream_t stream) {
  using Elem = typename Cfg::Elem;
  using Prep = typename Cfg::Prep;
  if (a == nullptr) return cudaErrorInvalidValue;
  if (a->num_heads <= 0 || a->num_qk_heads <= 0 || a->num_heads % a->num_qk_heads || a->num_chunks < 0 ||
      a->add_block_v != Cfg::AddBlockV || !std::isfinite(a->dout_scale) || !std::isfinite(a->qd_scale) ||
      !valid_input_dtype(a->vd_dtype))
    return cudaErrorInvalidValue;
  // TMA coordinates are int32 (the q/k rows), and so is the grid's x (chunks * Hv).
  if (a->num_chunks * a->num_qk_heads * kChunk >= (int64_t(1) << 31) || a->num_chunks * a->num_heads >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  if (a->num_chunks == 0) return cudaSuccess;
  const void* required[] = {a->q, a->k, a->g, a->beta, a->v, a->dout, a->w, a->kd, a->qd, a->u, a->ptdo,
                            a->decay, a->gamma};
  for (const void* ptr : required)
    if (ptr == nullptr) return cudaErrorInvalidValue;
  const int64_t piece = a->vd_dtype == kInputF32 ? 4 : 8;  // elements of a 16-byte piece
  for (int i = 0; i < 3; ++i)
    if (a->v_stride[i] % piece || a->dout_stride[i] % piece) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(a->v) % 16 || reinterpret_cast<uintptr_t>(a->dout) % 16)
    return cudaErrorMisalignedAddress;

  const cudaError_t setup = allow_dynamic_smem_once<gdn_bwd_prep_kernel<Cfg>>(Cfg::SmemBytes);
  if (setup != cudaSuccess) return setup;

  BwdPrepParams<Cfg> p{};
  // The chunk layout's q/k rows as the forward prep's one-head (token, K) view.
  const int64_t qk_rows = a->num_chunks * a->num_qk_heads * kChunk;
  p.prep.tma_q = Prep::tma_qk(static_cast<const Elem*>(a->q), qk_rows);
  p.prep.tma_k = Prep::tma_qk(static_cast<const Elem*>(a->k), qk_rows);
  p.prep.g = a->g;
  p.prep.beta = a->beta;
  p.q = static_cast<const Elem*>(a->q);
  p.v = a->v;
  p.dout = a->dout;
  p.vd_dtype = a->vd_dtype;
  for (int i = 0; i < 3; ++i) {
    p.v_stride[i] = a->v_stride[i];
    p.dout_stride[i] = a->dout_stride[i];
  }
  p.w = static_cast<Elem*>(a->w);
  p.kd = static_cast<Elem*>(a->kd);
  p.qd = static_cast<Elem*>(a->qd);
  p.u = a->u;
  p.ptdo = a->ptdo;
  p.decay = a->decay;
  p.gamma = a->gamma;
  p.a = a->a;
  p.a0 = a->a0;
  p.dout_amax = a->dout_amax;
  p.u_amax = a->u_amax;
  p.num_chunks = a->num_chunks;
  p.dout_scale = a->dout_scale;
  p.qd_scale = a->qd_scale;
  p.num_heads = a->num_heads;
  p.num_qk_heads = a->num_qk_heads;
  const dim3 grid(unsigned(a->num_chunks * a->num_heads));
  gdn_bwd_prep_kernel<Cfg><<<grid, Cfg::Threads, Cfg::SmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace fqt
