// Chunk preparation kernel: the parts of the chunked GDN forward that are parallel over chunks.
//
// One CTA per (chunk slot, q/k head); it serves the Hv / Hqk v-heads that read this q/k head.
// Per chunk and v-head it writes, slot-indexed (see gdn_sequences.cuh):
//   gamma[i]  in-chunk cumulative log-decay; padding rows repeat the last valid value
//   Aw[i][j]  = e^{gamma_i - gamma_j} A0[i][j] b_j  (j <= i), A0 = (I + strictly_lower(diag(b) K K^T))^{-1}
//   P[i][j]   = scale e^{gamma_i - gamma_j} (q_i . k_j)  (j <= i)
// Rows and columns past the sequence end are zero, so the sequential kernel needs no masks.
// K K^T and Q K^T run on the tensor cores (one warp group each); A0 is solved without
// exponentials (gate-free), one column per thread for up to kHeadBatch v-heads at once, then the
// decay mask is applied.
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <cuda_runtime.h>
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "gdn_sequences.cuh"
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

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
constexpr int kPrepPad = kChunk + 4;  // padded rows of 64x64 fp32 tiles (16-byte aligned rows)
constexpr int kHeadBatch = kPrepThreads / kChunk;  // v-heads solved at once: one A0 column per thread

template <class Elem, int HeadK>
struct PrepConfig {
  using LayoutQK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<kChunk>, Int<HeadK>>{}));
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kChunk>, Int<kChunk>, Int<HeadK>>,
                                                           GMMA::Major::K, GMMA::Major::K>()));
  struct alignas(1024) SharedStorage {
    cute::array_aligned<Elem, cosize_v<LayoutQK>, 1024> q;
    cute::array_aligned<Elem, cosize_v<LayoutQK>, 1024> k;
    float kk[kChunk * kPrepPad];
    float qk[kChunk * kPrepPad];
    float gamma[kHeadBatch][kChunk];
    float beta[kHeadBatch][kChunk];
  };
  static constexpr int SmemBytes = int(sizeof(SharedStorage));
};

template <class Elem, int Hqk, int Hv, int HeadK>
__global__ void __launch_bounds__(kPrepThreads) gdn_prep_kernel(const PrepArgs args) {
  constexpr int G = Hv / Hqk;
  using Cfg = PrepConfig<Elem, HeadK>;
  static_assert(HeadK == 128, "one lane holds four of the 128 columns");
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int tid = threadIdx.x;
  const int64_t slot = blockIdx.x;
  const int hqk = blockIdx.y;
  const int64_t T = args.total_tokens;
  const int64_t seq = sequence_of_slot(args.cu_seqlens, slot, args.num_seqs, T);
  const SeqRange range = sequence_range(args.cu_seqlens, seq, T);
  const int64_t chunk = slot - range.slot0;
  if (chunk < 0 || chunk >= range.num_chunks()) return;  // a slot no sequence uses
  const int64_t tok0 = range.start + chunk * kChunk;
  const int L = range.rows_in_chunk(chunk);

  // 1. q, k rows into the swizzled wgmma layout (zeros past the end), L2-normalised if asked;
  //    the normalised rows also go to global memory for the sequential kernel's TMA loads.
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Cfg::LayoutQK{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Cfg::LayoutQK{});
  {
    const int warp = tid / 32, lane = tid % 32, d0 = lane * 4;
    const Elem* q = static_cast<const Elem*>(args.q);
    const Elem* k = static_cast<const Elem*>(args.k);
    for (int r = warp; r < kChunk; r += kPrepThreads / 32) {
      float qv[4] = {0.f, 0.f, 0.f, 0.f}, kv[4] = {0.f, 0.f, 0.f, 0.f};
      const int64_t off = ((tok0 + r) * Hqk + hqk) * int64_t(HeadK) + d0;
      if (r < L) {
        Elem qe[4], ke[4];
        memcpy(qe, q + off, sizeof(qe));
        memcpy(ke, k + off, sizeof(ke));
        for (int i = 0; i < 4; ++i) { qv[i] = float(qe[i]); kv[i] = float(ke[i]); }
      }
      if (args.use_qk_l2norm) {
        float sq = 0.f, sk = 0.f;
        for (int i = 0; i < 4; ++i) { sq += qv[i] * qv[i]; sk += kv[i] * kv[i]; }
        for (int o = 16; o > 0; o >>= 1) {
          sq += __shfl_xor_sync(0xffffffffu, sq, o);
          sk += __shfl_xor_sync(0xffffffffu, sk, o);
        }
        const float rq = rsqrtf(sq + 1e-6f), rk = rsqrtf(sk + 1e-6f);
        Elem qe[4], ke[4];
        for (int i = 0; i < 4; ++i) { qv[i] *= rq; kv[i] *= rk; qe[i] = Elem(qv[i]); ke[i] = Elem(kv[i]); }
        if (r < L) {
          memcpy(static_cast<Elem*>(args.q_normed) + off, qe, sizeof(qe));
          memcpy(static_cast<Elem*>(args.k_normed) + off, ke, sizeof(ke));
        }
      }
      for (int i = 0; i < 4; ++i) {
        sQ(r, d0 + i) = Elem(qv[i]);
        sK(r, d0 + i) = Elem(kv[i]);
      }
    }
  }
  cutlass::arch::fence_view_async_shared();
  __syncthreads();

  // 2. K K^T (warp group 0) and Q K^T (warp group 1) on the tensor cores, into fp32 tiles.
  {
    typename Cfg::Mma mma;
    auto thr = mma.get_thread_slice(tid % 128);
    const bool kk_group = tid < 128;
    Tensor tA = thr.partition_fragment_A(kk_group ? sK : sQ);
    Tensor tB = thr.partition_fragment_B(sK);
    Tensor acc = partition_fragment_C(mma, Shape<Int<kChunk>, Int<kChunk>>{});
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    wgmma_gemm(mma, tA, tB, acc, true);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    Tensor crd = thr.partition_C(make_identity_tensor(Shape<Int<kChunk>, Int<kChunk>>{}));
    float* out = kk_group ? ss.kk : ss.qk;
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) out[get<0>(crd(e)) * kPrepPad + get<1>(crd(e))] = acc(e);
  }
  __syncthreads();

  for (int hb = 0; hb < G; hb += kHeadBatch) {
    const int nb = min(kHeadBatch, G - hb);
    // 3. gate cumsum and beta per head of the batch (padding rows: g = 0, b = 0).
    {
      const int warp = tid / 32, lane = tid % 32;
      if (warp < nb) {
        const int hv = hqk * G + hb + warp;
        const int i0 = 2 * lane, i1 = 2 * lane + 1;
        const float g0 = i0 < L ? args.g[(tok0 + i0) * Hv + hv] : 0.f;
        const float g1 = i1 < L ? args.g[(tok0 + i1) * Hv + hv] : 0.f;
        const float pair = g0 + g1;
        float incl = pair;
        for (int o = 1; o < 32; o <<= 1) {
          const float up = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += up;
        }
        const float excl = incl - pair;
        ss.gamma[warp][i0] = excl + g0;
        ss.gamma[warp][i1] = excl + g0 + g1;
        ss.beta[warp][i0] = i0 < L ? args.beta[(tok0 + i0) * Hv + hv] : 0.f;
        ss.beta[warp][i1] = i1 < L ? args.beta[(tok0 + i1) * Hv + hv] : 0.f;
      }
    }
    __syncthreads();

    // 4. A0 one column per thread (head h = tid / 64, column c = tid % 64), by forward
    //    substitution in registers: x_i = -b_i sum_{j < i} (k_i . k_j) x_j for i > c, x_c = 1.
    //    Columns are independent, so no barrier; the warp reads the same K K^T row (a broadcast).
    //    Then Aw[i][c] = e^{gamma_i - gamma_c} x_i b_c, each warp storing 32 adjacent columns of a row.
    {
      const int h = tid / kChunk, c = tid % kChunk;
      if (h < nb) {
        const float* bet = ss.beta[h];
        float x[kChunk];
        CUTE_UNROLL
        for (int i = 0; i < kChunk; ++i) {
          const float4* row = reinterpret_cast<const float4*>(ss.kk + i * kPrepPad);
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          CUTE_UNROLL
          for (int j4 = 0; j4 < i; j4 += 4) {
            const float4 kk = row[j4 / 4];
            const float kv[4] = {kk.x, kk.y, kk.z, kk.w};
            CUTE_UNROLL
            for (int t = 0; t < 4; ++t)
              if (j4 + t < i) part[t] = fmaf(kv[t], x[j4 + t], part[t]);
          }
          const float solved = -bet[i] * ((part[0] + part[1]) + (part[2] + part[3]));
          x[i] = i < c ? 0.f : (i == c ? 1.f : solved);
        }
        const int hv = hqk * G + hb + h;
        Elem* aw = static_cast<Elem*>(args.aw) + (int64_t(hv) * args.num_slots + slot) * kChunk * kChunk;
        const float gc = ss.gamma[h][c], bc = bet[c];
        CUTE_UNROLL
        for (int i = 0; i < kChunk; ++i) {
          const float a = (i < L && c <= i) ? __expf(ss.gamma[h][i] - gc) * x[i] * bc : 0.f;
          aw[i * kChunk + c] = Elem(a);
        }
      }
    }

    // 5. P with the decay mask (two columns per store), and the slot's gamma row.
    for (int h = 0; h < nb; ++h) {
      const int hv = hqk * G + hb + h;
      const int64_t base = (int64_t(hv) * args.num_slots + slot) * kChunk * kChunk;
      uint32_t* pm = reinterpret_cast<uint32_t*>(static_cast<Elem*>(args.p) + base);
      const float* gam = ss.gamma[h];
      for (int idx = tid; idx < kChunk * kChunk / 2; idx += kPrepThreads) {
        const int i = (2 * idx) / kChunk, j = (2 * idx) % kChunk;
        float pv[2] = {0.f, 0.f};
        for (int t = 0; t < 2; ++t) {
          if (i < L && j + t <= i) pv[t] = args.scale * __expf(gam[i] - gam[j + t]) * ss.qk[i * kPrepPad + j + t];
        }
        pm[idx] = pack2<Elem>(pv[0], pv[1]);
      }
      if (tid < kChunk) args.gamma[int64_t(hv) * args.num_slots * kChunk + slot * kChunk + tid] = gam[min(tid, L - 1)];
    }
    __syncthreads();
  }
}

}  // namespace fqt
