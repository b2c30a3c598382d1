// Chunk preparation kernel: the parts of the chunked GDN forward that are parallel over chunks.
//
// One CTA per (chunk slot, q/k head); it serves the Hv / Hqk v-heads that read this q/k head.
// Per chunk and v-head it writes, slot-indexed (see gdn_sequences.cuh):
//   gamma[i]  in-chunk cumulative log-decay; padding rows repeat the last valid value
//   Aw[i][j]  = e^{gamma_i - gamma_j} A0[i][j] b_j  (j <= i), A0 = (I + strictly_lower(diag(b) K K^T))^{-1}
//   P[i][j]   = scale e^{gamma_i - gamma_j} (q_i . k_j)  (j <= i)
// Rows and columns past the sequence end are zero, so the sequential kernel needs no masks.
// A0 is solved without exponentials (gate-free); the decay mask is applied afterwards.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "gdn_sequences.cuh"

namespace fqt {

struct PrepArgs {
  const void* q;          // [T, Hqk, K]
  const void* k;
  const float* g;         // [T, Hv]
  const float* beta;      // [T, Hv]
  const int64_t* cu_seqlens;
  void* q_normed;         // [T, Hqk, K] written when l2norm (else unused)
  void* k_normed;
  float* gamma;           // [Hv, slots * 64]
  void* aw;               // [Hv, slots * 64, 64]
  void* p;                // [Hv, slots * 64, 64]
  int64_t total_tokens;
  int64_t num_seqs;
  int64_t num_slots;
  float scale;
  int use_qk_l2norm;
};

constexpr int kPrepThreads = 256;
constexpr int kPrepPad = kChunk + 1;  // padded rows of 64x64 fp32 tiles (no bank conflicts)

template <int HeadK>
constexpr int prep_smem_bytes() {
  return (2 * kChunk * (HeadK + 1) + 3 * kChunk * kPrepPad + 2 * kChunk) * int(sizeof(float));
}

template <class Elem, int Hqk, int Hv, int HeadK>
__global__ void __launch_bounds__(kPrepThreads) gdn_prep_kernel(const PrepArgs args) {
  constexpr int G = Hv / Hqk;
  constexpr int KP = HeadK + 1;
  extern __shared__ float smem[];
  float* sQ = smem;                       // [64][KP]
  float* sK = sQ + kChunk * KP;           // [64][KP]
  float* sKK = sK + kChunk * KP;          // [64][65]  k_i . k_j
  float* sQK = sKK + kChunk * kPrepPad;   // [64][65]  q_i . k_j
  float* sA = sQK + kChunk * kPrepPad;    // [64][65]  A0
  float* sGamma = sA + kChunk * kPrepPad; // [64]
  float* sBeta = sGamma + kChunk;         // [64]

  const int tid = threadIdx.x;
  const int64_t slot = blockIdx.x;
  const int hqk = blockIdx.y;
  const int64_t T = args.total_tokens;
  const int64_t seq = sequence_of_slot(args.cu_seqlens, slot, args.num_seqs, T);
  const SeqRange range = sequence_range(args.cu_seqlens, seq, T);
  const int64_t chunk = slot - range.slot0;
  if (chunk < 0 || chunk >= range.num_chunks()) return;  // a slot no sequence uses
  const int64_t tok0 = range.start + chunk * kChunk;
  const int L = int(min<int64_t>(kChunk, range.len - chunk * kChunk));

  // 1. q and k rows of this chunk into fp32 shared memory (zeros past the end).
  const Elem* q = static_cast<const Elem*>(args.q);
  const Elem* k = static_cast<const Elem*>(args.k);
  for (int idx = tid; idx < kChunk * HeadK; idx += kPrepThreads) {
    int r = idx / HeadK, d = idx % HeadK;
    float qv = 0.f, kv = 0.f;
    if (r < L) {
      int64_t off = ((tok0 + r) * Hqk + hqk) * int64_t(HeadK) + d;
      qv = float(q[off]);
      kv = float(k[off]);
    }
    sQ[r * KP + d] = qv;
    sK[r * KP + d] = kv;
  }
  __syncthreads();

  // 2. Optional in-kernel L2 norm (x / sqrt(sum x^2 + 1e-6)); the normalised rows also go to
  //    global memory because the sequential kernel loads q and k from there by TMA.
  if (args.use_qk_l2norm) {
    const int warp = tid / 32, lane = tid % 32;
    for (int r = warp; r < kChunk; r += kPrepThreads / 32) {
      float sq = 0.f, sk = 0.f;
      for (int d = lane; d < HeadK; d += 32) {
        sq += sQ[r * KP + d] * sQ[r * KP + d];
        sk += sK[r * KP + d] * sK[r * KP + d];
      }
      for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      const float rq = rsqrtf(sq + 1e-6f), rk = rsqrtf(sk + 1e-6f);
      for (int d = lane; d < HeadK; d += 32) {
        float qv = sQ[r * KP + d] * rq, kv = sK[r * KP + d] * rk;
        sQ[r * KP + d] = qv;
        sK[r * KP + d] = kv;
        if (r < L) {
          int64_t off = ((tok0 + r) * Hqk + hqk) * int64_t(HeadK) + d;
          static_cast<Elem*>(args.q_normed)[off] = Elem(qv);
          static_cast<Elem*>(args.k_normed)[off] = Elem(kv);
        }
      }
    }
    __syncthreads();
  }

  // 3. K K^T and Q K^T; thread (ti, tj) owns rows ti + 16a and columns tj + 16b.
  {
    const int ti = tid / 16, tj = tid % 16;
    float kk[4][4] = {}, qk[4][4] = {};
    for (int d = 0; d < HeadK; ++d) {
      float ki[4], qi[4], kj[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        ki[a] = sK[(ti + 16 * a) * KP + d];
        qi[a] = sQ[(ti + 16 * a) * KP + d];
        kj[a] = sK[(tj + 16 * a) * KP + d];
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          kk[a][b] = fmaf(ki[a], kj[b], kk[a][b]);
          qk[a][b] = fmaf(qi[a], kj[b], qk[a][b]);
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        sKK[(ti + 16 * a) * kPrepPad + tj + 16 * b] = kk[a][b];
        sQK[(ti + 16 * a) * kPrepPad + tj + 16 * b] = qk[a][b];
      }
  }
  __syncthreads();

  for (int gi = 0; gi < G; ++gi) {
    const int hv = hqk * G + gi;
    // 4. gate cumsum and beta (padding rows: g = 0, b = 0).
    if (tid < 32) {
      const int i0 = 2 * tid, i1 = 2 * tid + 1;
      float g0 = i0 < L ? args.g[(tok0 + i0) * Hv + hv] : 0.f;
      float g1 = i1 < L ? args.g[(tok0 + i1) * Hv + hv] : 0.f;
      float pair = g0 + g1, incl = pair;
      for (int o = 1; o < 32; o <<= 1) {
        float up = __shfl_up_sync(0xffffffffu, incl, o);
        if (tid >= o) incl += up;
      }
      const float excl = incl - pair;
      sGamma[i0] = excl + g0;
      sGamma[i1] = excl + g0 + g1;
      sBeta[i0] = i0 < L ? args.beta[(tok0 + i0) * Hv + hv] : 0.f;
      sBeta[i1] = i1 < L ? args.beta[(tok0 + i1) * Hv + hv] : 0.f;
    }
    for (int idx = tid; idx < kChunk * kChunk; idx += kPrepThreads)
      sA[(idx / kChunk) * kPrepPad + idx % kChunk] = (idx / kChunk == idx % kChunk) ? 1.f : 0.f;
    __syncthreads();

    // 5. A0 by forward substitution: A0[i][c] = -b_i sum_{c <= j < i} (k_i . k_j) A0[j][c].
    {
      const int c = tid / 4, part = tid % 4;
      for (int i = 1; i < kChunk; ++i) {
        float acc = 0.f;
        if (c < i)
          for (int j = c + part; j < i; j += 4) acc = fmaf(sKK[i * kPrepPad + j], sA[j * kPrepPad + c], acc);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (c < i && part == 0) sA[i * kPrepPad + c] = -sBeta[i] * acc;
        __syncthreads();
      }
    }

    // 6. Apply the decay mask and write the slot's rows.
    Elem* aw = static_cast<Elem*>(args.aw) + (int64_t(hv) * args.num_slots + slot) * kChunk * kChunk;
    Elem* pm = static_cast<Elem*>(args.p) + (int64_t(hv) * args.num_slots + slot) * kChunk * kChunk;
    for (int idx = tid; idx < kChunk * kChunk; idx += kPrepThreads) {
      const int i = idx / kChunk, j = idx % kChunk;
      float a = 0.f, pv = 0.f;
      if (i < L && j <= i) {
        const float decay = __expf(sGamma[i] - sGamma[j]);
        a = decay * sA[i * kPrepPad + j] * sBeta[j];
        pv = args.scale * decay * sQK[i * kPrepPad + j];
      }
      aw[idx] = Elem(a);
      pm[idx] = Elem(pv);
    }
    if (tid < kChunk)
      args.gamma[int64_t(hv) * args.num_slots * kChunk + slot * kChunk + tid] = sGamma[min(tid, L - 1)];
    __syncthreads();
  }
}

}  // namespace fqt
