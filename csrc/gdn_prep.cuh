// Chunk preparation kernel: the parts of the chunked GDN forward that are parallel over chunks.
//
// Work item: one (chunk, q/k head); it serves the Hv / Hqk v-heads that read this q/k head.
// Persistent CTAs walk the items (PrepOrder); the next item's k tile loads by TMA as soon as this
// item's GEMMs have read it, and its q tile once P is written (with 128 threads Q K^T's fp32 tile
// reuses the q tile), so the loads hide behind the solve. Per chunk and v-head an item writes,
// slot-indexed (see gdn_sequences.cuh):
//   gamma[i]  in-chunk cumulative log-decay; padding rows repeat the last valid value
//   Aw[i][j]  = e^{gamma_i - gamma_j} A0[i][j] b_j  (j <= i), A0 = (I + strictly_lower(diag(b) K K^T))^{-1}
//   P[i][j]   = scale e^{gamma_i - gamma_j} (q_i . k_j)  (j <= i)
// Rows and columns past the sequence end are zero, so the sequential kernel needs no masks.
// K K^T and Q K^T run on the tensor cores (one warp group each); A0 is solved without
// exponentials (gate-free), then the decay mask is applied. With one v-head per q/k head (G = 1)
// 64 threads solve it by 16 x 16 blocks, the off-diagonal ones on the tensor cores
// (gdn_prep_solve_mma.cuh). With several v-heads, 128 threads run that solve for each head in
// turn on threads 0..63 while the others write P; with one or two v-heads all 128 then write the
// head's Aw. 256 threads solve up to four v-heads at once, a warp pair each on the tensor cores
// (more, a column per thread). Threads is a plan parameter (prep_threads): 128 fits four CTAs per
// SM and is the default up to three v-heads per q/k head (plan.default_tiles). With ready flags,
// each finished item is published so the sequential kernel can run beside this one
// (gdn_fwd_host.cuh). In a context-parallel call the CTAs then plan the call's jobs (gdn_cp.cuh).
//
// The kernel body walks the items and composes the steps of one: PrepGates (the gates and betas,
// with FLA's in-kernel gate and beta options applied (gdn_gate_options.cuh), scanned per v-head),
// prepare_qk_rows (tail rows, in-kernel l2norm), qk_products (K K^T and Q K^T) and solve_head_batch
// (the solve for A0, then Aw and P); the shared memory is composed of their storage, the q/k tiles'
// and the item decoder's (PrepSharedStorage, gdn_prep_storage.cuh).
// PrepConfig takes the head dim K as a template parameter (64, 128 or 256; the 128-thread form
// needs K >= 128).
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <cuda_runtime.h>
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "gdn_cp.cuh"
#include "gdn_gate_options.cuh"
#include "gdn_grid_sync.cuh"
#include "gdn_pipeline.cuh"
#include "gdn_prep_solve_mma.cuh"
#include "gdn_prep_storage.cuh"
#include "gdn_sequences.cuh"
#include "gdn_tma_producer.cuh"
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

// How the prep kernel's persistent CTAs walk the (chunk, q/k head) work items.
enum PrepOrder : int {
  kSlotMajor = 0,    // slot by slot: every sequence's chunks in storage order (the prep runs alone)
  kChunkMajor = 1,   // chunk c of every sequence before chunk c + 1 of any: the order in which the
                     // sequential kernel, running beside the prep, consumes them
};

// P's octets and the normalised q/k rows leave by one 16-, 8- or 4-byte store each: written as
// uint4 / uint2 assignments, nvcc 13.0 splits them into 4-byte stores (excess global sectors); the
// inline PTX below is STG.E.128 / STG.E.64 / STG.E in the SASS (measured: docs/kernel-notes.md).

__device__ __forceinline__ void store_global_16(void* dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void store_global_8(void* dst, uint32_t a, uint32_t b) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void store_global_4(void* dst, uint32_t a) {
  asm volatile("st.global.b32 [%0], %1;" ::"l"(dst), "r"(a) : "memory");
}

// Offset of Q K^T[i][j] in its fp32 tile: padded rows in a tile of its own (256 threads), or, with
// 128 threads (PrepConfig::QkInQ), in the q tile's 16 KB once the GEMMs have read q: unpadded rows
// whose 16-byte pieces are XOR-swizzled by row, so the accumulator stores and the row reads stay
// within two-way bank conflicts as with the padding.
template <bool InQ>
__device__ __forceinline__ int qk_offset(int i, int j) {
  if constexpr (InQ) return i * kChunk + (((j >> 2) ^ (i & 7)) << 2) + (j & 3);
  else return i * kPrepPad + j;
}

// e^x for the decay masks as one MUFU.EX2. Without -ftz, nvcc wraps each __expf in a fix-up for
// subnormal results (a predicated halving before and a squaring after, behind a branch); those
// make up most of the FMULs and branches among the prep's hottest instructions otherwise
// (docs/kernel-notes.md). A decay below 2^-126 becomes 0, which no bf16 tile or fp32 sum of them
// notices.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// P[i][j0 .. j0 + 8) as one 16-byte store: scale e^{gamma_i - gamma_j} (q_i . k_j) where
// j <= i < L, else 0. Eight consecutive threads write one 128-byte row.
template <class Elem, bool QkInQ>
__device__ __forceinline__ void store_p_octet(Elem* p, const float* qk, const float* gam, int i, int j0, int L,
                                              float scale) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
  if (i < L && j0 <= i) {
    const float4 q0 = *reinterpret_cast<const float4*>(qk + qk_offset<QkInQ>(i, j0));
    const float4 q1 = *reinterpret_cast<const float4*>(qk + qk_offset<QkInQ>(i, j0 + 4));
    const float4 g0 = *reinterpret_cast<const float4*>(gam + j0);
    const float4 g1 = *reinterpret_cast<const float4*>(gam + j0 + 4);
    const float qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    const float gi = gam[i];
    float pv[8];
    CUTE_UNROLL
    for (int u = 0; u < 8; ++u) pv[u] = scale * exp_ftz(j0 + u <= i ? gi - gv[u] : -INFINITY) * qv[u];  // see Aw
    CUTE_UNROLL
    for (int u = 0; u < 4; ++u) w[u] = pack2<Elem>(pv[2 * u], pv[2 * u + 1]);
  }
  store_global_16(p + i * kChunk + j0, w[0], w[1], w[2], w[3]);
}

// Column c of X = (I + L)^-1 as the tensor-core solve leaves it (row c of K K^T's upper triangle,
// gdn_prep_solve_mma.cuh), element by element: out(i, x_i) with x_c = 1 and 0 above the diagonal.
// 16-byte loads, conflict-free within each quarter warp.
// With Rows < kChunk, only rows [Rows * part, Rows * (part + 1)) of it.
template <int Pad, int Rows = kChunk, class Out>
__device__ __forceinline__ void for_each_in_x_column(const float* kk, int c, Out&& out, int part = 0) {
  static_assert(Rows % 4 == 0 && kChunk % Rows == 0, "whole 16-byte pieces of the column");
  const float4* col = reinterpret_cast<const float4*>(kk + c * Pad);
  CUTE_UNROLL
  for (int i4 = part * (Rows / 4); i4 < (part + 1) * (Rows / 4); ++i4) {
    const float4 v = col[i4];
    const float vv[4] = {v.x, v.y, v.z, v.w};
    CUTE_UNROLL
    for (int u = 0; u < 4; ++u) {
      const int i = 4 * i4 + u;
      out(i, i > c ? vv[u] : (i == c ? 1.f : 0.f));
    }
  }
}

template <class Elem, int Hqk, int HeadK, int Threads_>
struct PrepConfig {
  static constexpr int Threads = Threads_;
  static_assert(Threads == 128 || Threads == 256, "the prep kernel runs one or two warp groups");
  static constexpr int HeadBatch = Threads / kChunk;  // v-heads per batch of gates (solved at once with 256
                                                      // threads, a warp pair per head; in turn with 128)
  // With 128 threads, Q K^T lives in the q tile and the next item's q load waits until P has been
  // written: without its own 17 KB tile the prep fits four CTAs per SM instead of three
  // (measured: docs/kernel-notes.md).
  static constexpr bool QkInQ = Threads == 128;
  static constexpr int CtasPerSm = Threads == 256 ? 2 : (QkInQ ? 4 : 3);
  using C64 = Int<kChunk>;
  using CK = Int<HeadK>;
  using LayoutQK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, CK>{}));
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<C64, C64, CK>,
                                                           GMMA::Major::K, GMMA::Major::K>()));
  // q/k: (token, Hqk*K) row-major, the same boxes as the sequential kernel's.
  static auto tma_qk(const Elem* ptr, int64_t T) {
    auto g = make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(T), int32_t(Hqk * HeadK)),
                         make_stride(int64_t(Hqk * HeadK), _1{}));
    return make_tma_atom(SM90_TMA_LOAD{}, g, LayoutQK{}, Shape<C64, CK>{});
  }
  using TmaQK = decltype(tma_qk(nullptr, 1));
  // An item's q and k tiles: one buffer, its bulk copies completing on the full barrier; the CTA-wide
  // barrier after the GEMMs (or, for q with QkInQ, after P) frees it for the next item's loads.
  using LoadPipeline = MbarrierPipeline<1, /*Transactions=*/true, ConsumerRelease::kCtaBarrier>;
  // With 256 threads, two more X tiles: heads 2 and 3 of a batch solved at once (step 4).
  static constexpr int ExtraXTiles = Threads == 256 ? 2 : 0;
  // The kernel's shared memory, composed of its collectives' storage (gdn_prep_storage.cuh).
  using SharedStorage =
      PrepSharedStorage<Elem, LayoutQK, typename LoadPipeline::Storage, HeadBatch, QkInQ, ExtraXTiles>;
  // With 256 threads the extra X tiles end the storage (108.8 KB: two CTAs still fit an SM), with
  // 128 the item slots.
  static constexpr int SmemBytes = Threads == 256
                                       ? int(offsetof(SharedStorage, extra_x) + sizeof(SharedStorage::extra_x))
                                       : int(offsetof(SharedStorage, items) + sizeof(PrepItemStorage));
  // The layout: each part where the one before ends, at the part's alignment (1024 bytes for the
  // swizzled tiles and for the item block, 8 for the barrier, 128 for the extra X tiles).
  static constexpr size_t TileBytes = sizeof(Elem) * cosize_v<LayoutQK>;
  static_assert(offsetof(SharedStorage, tiles) == 0 && alignof(SharedStorage) == 1024,
                "the q/k tiles open the storage");
  static_assert(offsetof(SharedStorage, tiles.k) == TileBytes &&
                    offsetof(SharedStorage, products) == 2 * TileBytes,
                "q, k, then the products' tiles");
  static_assert(offsetof(SharedStorage, gates) ==
                    offsetof(SharedStorage, products) + sizeof(typename SharedStorage::Products),
                "the gates after the products' tiles");
  static_assert(offsetof(SharedStorage, loaded) ==
                    (offsetof(SharedStorage, gates) + sizeof(typename SharedStorage::Gates) + 7) / 8 * 8,
                "the barrier after the gates");
  static_assert(offsetof(SharedStorage, items) ==
                    (offsetof(SharedStorage, loaded) + sizeof(typename LoadPipeline::Storage) + 1023) / 1024 * 1024,
                "the item block on the next 1024 bytes");
  static_assert(offsetof(SharedStorage, items.slots) == offsetof(SharedStorage, items) + PrepItemStorage::SeqBytes,
                "the item slots after cu_seqlens' copy");
  static_assert(Threads == 128 || offsetof(SharedStorage, extra_x) ==
                    (offsetof(SharedStorage, items) + sizeof(PrepItemStorage) + 127) / 128 * 128,
                "the extra X tiles after the item block");
  static constexpr uint32_t TileTxBytes = uint32_t(2 * TileBytes);  // an item's q and k tiles
};

template <class Cfg>
struct PrepArgs {
  typename Cfg::TmaQK tma_q;
  typename Cfg::TmaQK tma_k;
  const float* g;         // [T, Hv]
  const float* beta;      // [T, Hv]
  const int64_t* cu_seqlens;
  void* q_normed;         // [T, Hqk, K] written when l2norm (else unused)
  void* k_normed;
  float* gamma;           // [Hv, slots * 64]
  void* aw;               // [Hv, slots * 64, 64]
  void* p;                // [Hv, slots * 64, 64]
  uint32_t* ready;        // [Hqk, slots]: set to 1 (release) once an item is written; null: no flags
  int64_t total_tokens;
  int64_t num_seqs;
  int64_t num_slots;
  int64_t num_items;
  float scale;
  int use_qk_l2norm;
  int order;              // PrepOrder
  CpPlanArgs cp;          // a context-parallel call's plan (num_segments > 0): its job rows after the items
  GateInputs gates;       // A_log and dt_bias of an in-kernel gate (unread with precomputed gates)
};

// cu is where the kernel keeps the call's offsets: shared memory for calls of up to
// kPrepSeqCache sequences, else cu_seqlens itself.
template <int Hqk, class Args>
__device__ __forceinline__ PrepItem prep_item(const Args& a, int64_t item, const int64_t* cu) {
  PrepItem it;
  it.hqk = int(item % Hqk);
  const int64_t rest = item / Hqk;
  if (a.order == kChunkMajor) {
    const int64_t seq = rest % a.num_seqs;
    it.range = sequence_range(cu, seq, a.total_tokens);
    it.chunk = rest / a.num_seqs;
  } else {
    const int64_t seq = sequence_of_slot(cu, rest, a.num_seqs, a.total_tokens);
    it.range = sequence_range(cu, seq, a.total_tokens);
    it.chunk = rest - it.range.slot0;
  }
  it.valid = it.chunk >= 0 && it.chunk < it.range.num_chunks();
  it.slot = it.range.slot0 + it.chunk;
  return it;
}

// This CTA's next work item with something to do, at or after `item` (num_items when none is
// left); thread 0 decodes it again with prep_item into an item slot.
template <int Hqk, class Args>
__device__ __forceinline__ int64_t next_valid_item(const Args& a, int64_t item, const int64_t* cu) {
  for (; item < a.num_items; item += gridDim.x)
    if (prep_item<Hqk>(a, item, cu).valid) break;
  return item < a.num_items ? item : a.num_items;
}

// Step 1 of an item: rows past the sequence end (another sequence's tokens) become zeros; with
// l2norm, rows are normalised in place and also written out for the sequential kernel's TMA loads.
// By all Threads threads, a warp per row, each lane kLaneCols = K / 32 of its columns.
template <class Elem, int Hqk, int HeadK, int Threads, class Args, class SQ, class SK>
__device__ __forceinline__ void prepare_qk_rows(const Args& args, SQ& sQ, SK& sK, int tid, int L, int64_t tok0, int hqk) {
  constexpr int kLaneCols = HeadK / 32;
  if (args.use_qk_l2norm || L < kChunk) {
    const int warp = tid / 32, lane = tid % 32, d0 = lane * kLaneCols;
    for (int r = warp; r < kChunk; r += Threads / 32) {
      if (r >= L) {
        for (int i = 0; i < kLaneCols; ++i) sQ(r, d0 + i) = sK(r, d0 + i) = Elem(0.f);
        continue;
      }
      if (!args.use_qk_l2norm) continue;
      float qv[kLaneCols], kv[kLaneCols], sq = 0.f, sk = 0.f;
      for (int i = 0; i < kLaneCols; ++i) {
        qv[i] = float(sQ(r, d0 + i));
        kv[i] = float(sK(r, d0 + i));
        sq += qv[i] * qv[i];
        sk += kv[i] * kv[i];
      }
      for (int o = 16; o > 0; o >>= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      const float rq = rsqrtf(sq + 1e-6f), rk = rsqrtf(sk + 1e-6f);
      for (int i = 0; i < kLaneCols; ++i) {
        qv[i] *= rq;
        kv[i] *= rk;
        sQ(r, d0 + i) = Elem(qv[i]);
        sK(r, d0 + i) = Elem(kv[i]);
      }
      // Packed stores of a lane's columns: nvcc 13.0 lowered a byte-wise memcpy of these 16-bit
      // elements into float-to-integer conversions (F2I.U8.F16 in the SASS), corrupting the copy.
      const int64_t off = ((tok0 + r) * Hqk + hqk) * int64_t(HeadK) + d0;
      if constexpr (kLaneCols == 2) {
        store_global_4(static_cast<Elem*>(args.q_normed) + off, pack2<Elem>(qv[0], qv[1]));
        store_global_4(static_cast<Elem*>(args.k_normed) + off, pack2<Elem>(kv[0], kv[1]));
      } else {
        for (int i = 0; i < kLaneCols; i += 4) {
          store_global_8(static_cast<Elem*>(args.q_normed) + off + i, pack2<Elem>(qv[i], qv[i + 1]),
                         pack2<Elem>(qv[i + 2], qv[i + 3]));
          store_global_8(static_cast<Elem*>(args.k_normed) + off + i, pack2<Elem>(kv[i], kv[i + 1]),
                         pack2<Elem>(kv[i + 2], kv[i + 3]));
        }
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic stores, read by wgmma (async proxy)
  }
}

// Step 2 of an item: K K^T and Q K^T on the tensor cores, into fp32 tiles: one per warp group with
// two; with one, both products in flight at once (one wait).
template <class Cfg, class SQ, class SK>
__device__ __forceinline__ void qk_products(typename Cfg::SharedStorage& ss, SQ& sQ, SK& sK, int tid) {
  constexpr int Threads = Cfg::Threads;
  typename Cfg::Mma mma;
  auto thr = mma.get_thread_slice(tid % 128);
  Tensor tB = thr.partition_fragment_B(sK);
  Tensor crd = thr.partition_C(make_identity_tensor(Shape<Int<kChunk>, Int<kChunk>>{}));
  auto store_tile = [&](auto& acc, float* out, auto in_q) {
    // accumulator values e, e + 1 are neighbouring columns (tests/test_fragment_layout.py):
    // one 8-byte store per pair
    CUTE_UNROLL
    for (int e = 0; e < size(acc); e += 2)
      *reinterpret_cast<float2*>(out + qk_offset<decltype(in_q)::value>(get<0>(crd(e)), get<1>(crd(e)))) =
          make_float2(acc(e), acc(e + 1));
  };
  if constexpr (Threads == 128) {
    Tensor tAk = thr.partition_fragment_A(sK);
    Tensor tAq = thr.partition_fragment_A(sQ);
    Tensor acc_k = partition_fragment_C(mma, Shape<Int<kChunk>, Int<kChunk>>{});
    Tensor acc_q = partition_fragment_C(mma, Shape<Int<kChunk>, Int<kChunk>>{});
    warpgroup_fence_operand(acc_k);
    warpgroup_fence_operand(acc_q);
    warpgroup_arrive();
    wgmma_gemm(mma, tAk, tB, acc_k, true);
    wgmma_gemm(mma, tAq, tB, acc_q, true);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_k);
    warpgroup_fence_operand(acc_q);
    store_tile(acc_k, ss.products.kk, false_type{});
    if constexpr (Cfg::QkInQ) __syncthreads();  // every warp's GEMMs have read q
    store_tile(acc_q, ss.qk_tile(), bool_constant<Cfg::QkInQ>{});
  } else {  // 256 threads: warp group 0 K K^T, warp group 1 Q K^T
    const bool kk_gemm = tid < 128;
    {
      Tensor tA = thr.partition_fragment_A(kk_gemm ? sK : sQ);
      Tensor acc = partition_fragment_C(mma, Shape<Int<kChunk>, Int<kChunk>>{});
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      wgmma_gemm(mma, tA, tB, acc, true);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      store_tile(acc, kk_gemm ? ss.products.kk : ss.qk_tile(), false_type{});
    }
  }
}

// Steps 4 and 5 of an item for v-heads [hb, hb + nb) of q/k head hqk (one head batch, its gates in
// ss.gamma() / ss.beta()): the solve for A0, Aw stored as X's columns are ready, and P with the
// slot's gamma row. issue_next_q_load: the next item's q tile load (Cfg::QkInQ: once P has read
// Q K^T).
template <class Elem, int Hqk, int Hv, int HeadK, int Threads, class Args, class IssueNextQ>
__device__ __forceinline__ void solve_head_batch(const Args& args, typename PrepConfig<Elem, Hqk, HeadK, Threads>::SharedStorage& ss,
                                                 int tid, int hqk, int hb, int nb, int64_t slot, int L,
                                                 int64_t next, IssueNextQ&& issue_next_q_load) {
  using Cfg = PrepConfig<Elem, Hqk, HeadK, Threads>;
  constexpr int G = Hv / Hqk;
  constexpr int HeadBatch = Cfg::HeadBatch;
  // 4. A0 for each head of the batch. On the tensor cores (gdn_prep_solve_mma.cuh) with one
  //    v-head per q/k head, and with several when the CTA has 128 threads: threads 0..63 solve
  //    the batch's heads one after another by 16 x 16 blocks while threads 64.. write P. X lands
  //    in K K^T's upper triangle, column c of X in row c of the tile (16-byte loads,
  //    conflict-free within each quarter warp), streamed to Aw without holding the column in
  //    registers (with one or two heads, by all 128 threads after the solve: kAwByAll); K K^T's
  //    lower triangle stays, so each head's X overwrites the previous one's once every column
  //    of it has been stored. With several heads and 128 threads this beats a column per
  //    thread and head, and 256 threads (docs/kernel-notes.md).
  //    With 256 threads and more than four v-heads per q/k head (several head batches, whose
  //    K K^T and Q K^T tiles the solve at once below would overwrite), one column per thread
  //    (head h = tid / 64, column c = tid % 64), by forward substitution in registers:
  //    x_i = -b_i sum_{j < i} (k_i . k_j) x_j for i > c, x_c = 1. Columns are independent, so
  //    no barrier; the warp reads the same K K^T row (a broadcast). Then
  //    Aw[i][c] = e^{gamma_i - gamma_c} x_i b_c, each warp storing 32 adjacent columns of a row.
  constexpr bool kTensorCoreSolve = G == 1 || Threads == 128;
  // With one or two v-heads per q/k head, all 128 threads write Aw once a head's solve is done
  // (two per column, 32 rows each) instead of the 64 solving ones while the other 64, done with
  // P, wait; with two, one head per round (threads 0..63 solve head h while 64..127 write its
  // P, then all write its Aw). With three (8/24) the rounds lose (docs/kernel-notes.md).
  constexpr bool kAwByAll = kTensorCoreSolve && Threads == 128 && G <= 2;
  // With 256 threads and two to four v-heads per q/k head (one head batch: 2/8, 4/16, 8/32), the
  // four warp pairs solve their heads at once on the tensor cores, each into an X tile of its
  // own: head 0's in K K^T's upper triangle, head 1's in the Q K^T tile (P is written first, by
  // all threads), heads 2 and 3 in the storage's extra X tiles. It is faster than a column per
  // thread in registers (forward substitution, below, whose FFMAs dominate that prep's SASS);
  // against 128 threads, which solve the heads one after another, it wins on short sequences and
  // loses a little on long ones (docs/kernel-notes.md).
  constexpr bool kSolveHeadsAtOnce = Threads == 256 && G > 1 && G <= HeadBatch;
  // Aw[i][c] = e^{gamma_i - gamma_c} x_i b_c for head h of the batch and column c, as a store of
  // (i, x_i). The mask selects the exponent (e^-inf = 0), not the result: nvcc puts each
  // exponential of a selected result behind its own branch, so the steps run one after another
  // (docs/kernel-notes.md).
  auto aw_column_store = [&](int h, int c) {
    const int hv = hqk * G + hb + h;
    Elem* aw = static_cast<Elem*>(args.aw) + (int64_t(hv) * args.num_slots + slot) * kChunk * kChunk;
    const float* gam = ss.gamma()[h];
    const float gc = gam[c], bc = ss.beta()[h][c];
    return [=](int i, float xi) {
      const float d = i < L && c <= i ? gam[i] - gc : -INFINITY;
      aw[i * kChunk + c] = Elem(exp_ftz(d) * xi * bc);
    };
  };
  // 5. P with the decay mask (store_p_octet), and the slot's gamma row, for heads [h_lo, h_hi)
  //    of the batch by threads p_first.. of the CTA. P reads only the Q K^T tile and the gates.
  auto write_p = [&](int h_lo, int h_hi, int p_first) {
    const int p_threads = Threads - p_first, ptid = tid - p_first;
    for (int h = h_lo; h < (ptid >= 0 ? h_hi : h_lo); ++h) {
      const int hv = hqk * G + hb + h;
      const int64_t base = (int64_t(hv) * args.num_slots + slot) * kChunk * kChunk;
      const float* gam = ss.gamma()[h];
      Elem* pm = static_cast<Elem*>(args.p) + base;
      for (int u = ptid; u < kChunk * kChunk / 8; u += p_threads)
        store_p_octet<Elem, Cfg::QkInQ>(pm, ss.qk_tile(), gam, u / 8, 8 * (u % 8), L, args.scale);
      if (ptid < kChunk)
        args.gamma[int64_t(hv) * args.num_slots * kChunk + slot * kChunk + ptid] = gam[min(ptid, L - 1)];
    }
  };
  // kAwByAll: one round per head of the batch (the solve, P and Aw of head h); otherwise one
  // round for the whole batch.
  for (int round = 0; round < (kAwByAll ? nb : 1); ++round) {
    const int h_lo = kAwByAll ? round : 0, h_hi = kAwByAll ? round + 1 : nb;
    if constexpr (kSolveHeadsAtOnce) {
      // P first, by every thread: head 1's X takes the Q K^T tile. Then warp pair h solves
      // head h with named barrier 1 + h (barrier 0 is __syncthreads) and streams its Aw.
      write_p(h_lo, h_hi, 0);
      __syncthreads();
      const int h = tid / kChunk, c = tid % kChunk;
      if (h < nb) {
        float* xt = h == 0 ? ss.products.kk : (h == 1 ? ss.qk_tile() : ss.extra_x.x[h - 2]);
        solve_mma::solve_into<kPrepPad>(ss.products.kk, xt, ss.beta()[h], c, 1 + h);
        for_each_in_x_column<kPrepPad>(xt, c, aw_column_store(h, c));
      }
    } else if constexpr (kTensorCoreSolve) {
      // Exactly threads 0..63 get here: the 64 threads that named barrier 1 inside the solve
      // waits for. No other thread of the CTA may use barrier 1.
      static_assert(kChunk == 64 && Threads >= 128, "the blocked solve runs on the CTA's first 64 threads");
      if (tid < kChunk) {
        const int c = tid;
        for (int h = h_lo; h < h_hi; ++h) {
          if (h > h_lo) solve_mma::sync64();
          solve_mma::solve<kPrepPad>(ss.products.kk, ss.beta()[h], tid);
          if constexpr (!kAwByAll) for_each_in_x_column<kPrepPad>(ss.products.kk, c, aw_column_store(h, c));
        }
      }
    } else {
      const int h = tid / kChunk, c = tid % kChunk;
      if (h < nb) {
        const float* bet = ss.beta()[h];
        float x[kChunk];
        // x_i = 0 for i < c, so a warp whose columns all lie in the upper half (c >= 32, a
        // warp-uniform test) solves only rows and terms from 32 on: a quarter of the work.
        auto solve_from = [&](auto first_row) {
          constexpr int I0 = decltype(first_row)::value;
          CUTE_UNROLL
          for (int i = 0; i < I0; ++i) x[i] = 0.f;
          CUTE_UNROLL
          for (int i = I0; i < kChunk; ++i) {
            const float4* row = reinterpret_cast<const float4*>(ss.products.kk + i * kPrepPad);
            float part[4] = {0.f, 0.f, 0.f, 0.f};
            CUTE_UNROLL
            for (int j4 = I0; j4 < i; j4 += 4) {
              const float4 kk = row[j4 / 4];
              const float kv[4] = {kk.x, kk.y, kk.z, kk.w};
              CUTE_UNROLL
              for (int t = 0; t < 4; ++t)
                if (j4 + t < i) part[t] = fmaf(kv[t], x[j4 + t], part[t]);
            }
            const float solved = -bet[i] * ((part[0] + part[1]) + (part[2] + part[3]));
            x[i] = i < c ? 0.f : (i == c ? 1.f : solved);
          }
        };
        if (c >= kChunk / 2) {
          solve_from(Int<kChunk / 2>{});
        } else {
          solve_from(Int<0>{});
        }
        const auto store_aw = aw_column_store(h, c);
        CUTE_UNROLL
        for (int i = 0; i < kChunk; ++i) store_aw(i, x[i]);
      }
    }

    // 5. P (above). When the solve leaves threads idle (fewer v-heads than a batch holds: one
    //    per q/k head on 16/16 with 128 threads, two on 16/32 with 256), those threads write
    //    all of P while the others solve, which takes P off the item's critical path;
    //    otherwise every thread writes its share after its column.
    const int p_first = kTensorCoreSolve ? kChunk : (nb * kChunk < Threads ? nb * kChunk : 0);
    const int p_threads = Threads - p_first, ptid = tid - p_first;
    if constexpr (!kSolveHeadsAtOnce) write_p(h_lo, h_hi, p_first);
    if constexpr (Cfg::QkInQ) {
      // The last batch's P has read Q K^T: once every P thread is past it, the q tile is free
      // for the next item (the proxy fence orders these generic reads before the TMA's writes).
      if (hb + HeadBatch >= G && h_hi == nb && ptid >= 0) {
        cutlass::arch::fence_view_async_shared();
        asm volatile("bar.sync 2, %0;" ::"r"(p_threads) : "memory");
        if (ptid == 0 && next < args.num_items) issue_next_q_load();
      }
    }
    if constexpr (kAwByAll) {
      __syncthreads();  // X is complete in K K^T's upper triangle
      const int c = tid % kChunk;
      for_each_in_x_column<kPrepPad, kChunk / 2>(ss.products.kk, c, aw_column_store(h_lo, c), tid / kChunk);
      if (h_hi < nb) __syncthreads();  // X read before the next head's solve overwrites it
    }
  }  // round
}

// The prep's gates: per item and v-head, the gates and betas of its 64 rows, in-chunk scanned into
// ss.gamma() / ss.beta() by one warp per v-head of a head batch (the first batch's copied ahead,
// during the previous item). Gates (gdn_gate_options.cuh) turns the caller's g and beta into the
// values the chunks use (FLA's in-kernel gate and beta sigmoid) before the scan, on valid rows
// only: padding rows keep g = 0, b = 0, which the rows past the sequence end rely on.
template <class Cfg, int Hv, int G, class Gates>
struct PrepGates {
  // Its part of the storage, reached through the kernel's (PrepSharedStorage::gamma() and the like).
  using SharedStorage = typename Cfg::SharedStorage::Gates;
  static constexpr int HeadBatch = Cfg::HeadBatch;
  const PrepArgs<Cfg>& args;
  typename Cfg::SharedStorage& ss;
  int tid;
  // Gates of rows [2 lane, 2 lane + 1] of v-head (hb + warp) of an item: padding rows get g = 0, b = 0.
  __device__ __forceinline__ const float* gate_source(const PrepItem& it, int hb, int t, const float* base) const {
    const int warp = tid / 32, lane = tid % 32, i = 2 * lane + t;
    const int64_t tok = it.range.start + it.chunk * kChunk + i;
    return i < it.range.rows_in_chunk(it.chunk) ? base + tok * Hv + it.hqk * G + hb + warp : nullptr;
  }
  // The next item's first-batch gates, copied to shared memory without stalling this thread.
  __device__ __forceinline__ void prefetch_gates(const PrepItem& it) const {
    const int warp = tid / 32, lane = tid % 32;
    if (warp < min(HeadBatch, G)) {
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        // A padding row's copy reads nothing (zero-fill) from a valid stand-in address.
        const float* g = gate_source(it, 0, t, args.g);
        const float* b = gate_source(it, 0, t, args.beta);
        SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(g ? *g : *args.g, ss.g_next()[warp][2 * lane + t], g != nullptr);
        SM80_CP_ASYNC_CACHEALWAYS_ZFILL<float>::copy(b ? *b : *args.beta, ss.beta_next()[warp][2 * lane + t],
                                                     b != nullptr);
      }
    }
    cute::cp_async_fence();
  }
  // Rows [2 lane, 2 lane + 1] of v-head (hb + warp), read as the caller passed them, as the chunks
  // use them: the in-kernel gate and beta options applied to the rows inside the sequence. By warps
  // of the head batch only (the others have no v-head to read A_log and dt_bias of).
  __device__ __forceinline__ void apply_options(const PrepItem& it, int hb, float (&g)[2], float (&b)[2]) const {
    if constexpr (!Gates::Precomputed) {
      const int warp = tid / 32, lane = tid % 32, hv = it.hqk * G + hb + warp;
      const int rows = it.range.rows_in_chunk(it.chunk);
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        if (2 * lane + t < rows) {
          g[t] = Gates::gate(g[t], args.gates, hv);
          b[t] = Gates::beta(b[t]);
        }
      }
    }
  }
  // In-chunk cumulative log-decay and beta of head batch hb into shared memory (warps < nb).
  __device__ __forceinline__ void scan_gates(int nb, const float (&g)[2], const float (&b)[2]) const {
    const int warp = tid / 32, lane = tid % 32;
    if (warp < nb) {
      const float pair = g[0] + g[1];
      float incl = pair;
      for (int o = 1; o < 32; o <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      const float excl = incl - pair;
      ss.gamma()[warp][2 * lane] = excl + g[0];
      ss.gamma()[warp][2 * lane + 1] = excl + g[0] + g[1];
      ss.beta()[warp][2 * lane] = b[0];
      ss.beta()[warp][2 * lane + 1] = b[1];
    }
  }
  // Step 0: the first head batch's gates, copied during the previous item, scanned. Each thread
  // reads only what it copied itself, so waiting for its own copies is enough.
  __device__ __forceinline__ void scan_prefetched(const PrepItem& it) const {
    cp_async_wait_all_then_access();
    const int warp = tid / 32, lane = tid % 32;
    float g[2] = {0.f, 0.f}, b[2] = {0.f, 0.f};
    if (warp < min(HeadBatch, G)) {
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        g[t] = ss.g_next()[warp][2 * lane + t];
        b[t] = ss.beta_next()[warp][2 * lane + t];
      }
      apply_options(it, 0, g, b);
    }
    scan_gates(min(HeadBatch, G), g, b);
  }
  // Step 3: a later head batch's gates (more than Threads / 64 v-heads per q/k head), loaded and scanned.
  __device__ __forceinline__ void load_and_scan(const PrepItem& it, int hb, int nb) const {
    float g[2] = {0.f, 0.f}, b[2] = {0.f, 0.f};
    if (tid / 32 < nb) {
      CUTE_UNROLL
      for (int t = 0; t < 2; ++t) {
        const float* gs = gate_source(it, hb, t, args.g);
        const float* bs = gate_source(it, hb, t, args.beta);
        g[t] = gs ? *gs : 0.f;
        b[t] = bs ? *bs : 0.f;
      }
      apply_options(it, hb, g, b);
    }
    scan_gates(nb, g, b);
  }
};

// Gates: how the caller's g and beta become the chunks' (gdn_gate_options.cuh; PrecomputedGates:
// as given).
template <class Elem, int Hqk, int Hv, int HeadK, int Threads, class Gates = PrecomputedGates>
__global__ void __launch_bounds__(Threads, (PrepConfig<Elem, Hqk, HeadK, Threads>::CtasPerSm))
    gdn_prep_kernel(CUTE_GRID_CONSTANT const PrepArgs<PrepConfig<Elem, Hqk, HeadK, Threads>> args) {
  constexpr int G = Hv / Hqk;
  using Cfg = PrepConfig<Elem, Hqk, HeadK, Threads>;
  constexpr int HeadBatch = Cfg::HeadBatch;
  using C64 = typename Cfg::C64;
  using CK = typename Cfg::CK;
  static_assert(HeadK % 64 == 0 && HeadK <= 256, "q/k tile rows are whole 128-byte swizzle atoms (K = 64, 128 or 256)");
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  // The sequential kernel may launch now (programmatic dependent launch): every CTA of this grid
  // is resident before it starts, so its waits on the ready flags always end.
  allow_dependent_launch();

  const int tid = threadIdx.x;
  const int64_t T = args.total_tokens;
  using Load = TmaProducer<typename Cfg::LoadPipeline>;
  if (tid == 0) {
    Cfg::LoadPipeline::init(ss.loaded, 1);
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
  }
  const int64_t* cu = args.cu_seqlens;  // where items are decoded from
  PrepItemSlot* item_slots = ss.items.slots;
  if (args.num_seqs <= kPrepSeqCache) {
    int64_t* offsets = ss.items.offsets;
    for (int64_t s = tid; s <= args.num_seqs; s += Threads) offsets[s] = args.cu_seqlens[s];
    cu = offsets;
  }
  __syncthreads();

  Tensor mQ = args.tma_q.get_tma_tensor(make_shape(int32_t(T), int32_t(Hqk * HeadK)));
  Tensor mK = args.tma_k.get_tma_tensor(make_shape(int32_t(T), int32_t(Hqk * HeadK)));
  // One thread loads an item's q and k tiles (rows past T arrive as zeros). Without q_too, the q
  // tile comes later from issue_q_load (Cfg::QkInQ: Q K^T occupies it until P is written); the
  // barrier's expected bytes count both tiles either way.
  const Load load(ss.loaded);
  const typename Cfg::LoadPipeline tiles(ss.loaded);
  auto issue_q_load = [&](const PrepItem& it) {
    const int32_t tok0 = int32_t(it.range.start + it.chunk * kChunk);
    Tensor gQ = local_tile(domain_offset(make_coord(tok0, 0), mQ), Shape<C64, CK>{}, make_coord(0, it.hqk));
    Tensor sQ = make_tensor(make_smem_ptr(ss.tiles.q.data()), typename Cfg::LayoutQK{});
    load.tile(SingleState{0u}, args.tma_q, gQ, sQ);
  };
  auto issue_loads = [&](const PrepItem& it, bool q_too) {
    const int32_t tok0 = int32_t(it.range.start + it.chunk * kChunk);
    Tensor gK = local_tile(domain_offset(make_coord(tok0, 0), mK), Shape<C64, CK>{}, make_coord(0, it.hqk));
    Tensor sK = make_tensor(make_smem_ptr(ss.tiles.k.data()), typename Cfg::LayoutQK{});
    load.expect(SingleState{0u}, Cfg::TileTxBytes);
    if (q_too) issue_q_load(it);
    load.tile(SingleState{0u}, args.tma_k, gK, sK);
  };
  const PrepGates<Cfg, Hv, G, Gates> gates{args, ss, tid};


  int64_t item = next_valid_item<Hqk>(args, blockIdx.x, cu);
  if (item < args.num_items) {
    const PrepItem first = prep_item<Hqk>(args, item, cu);
    if (tid == 0) issue_loads(first, true);
    gates.prefetch_gates(first);
    if (tid == 0) item_slots[0].it = first;
  }
  __syncthreads();  // slot 0 holds the first item
  for (uint32_t phase = 0u; item < args.num_items; phase ^= 1u) {
    // Slot `phase` holds this item (written by thread 0 during the previous item, or before the
    // loop); thread 0 fills the other slot with the next one, which the others read after the
    // barriers below. Each slot is rewritten only an item later, after every thread's read.
    const PrepItem it = item_slots[phase].it;
    if (tid == 0) {
      const int64_t found = next_valid_item<Hqk>(args, item + gridDim.x, cu);
      if (found < args.num_items) item_slots[phase ^ 1u].it = prep_item<Hqk>(args, found, cu);
      item_slots[phase ^ 1u].next = found;
    }
    const int64_t slot = it.slot;
    const int hqk = it.hqk;
    const int64_t tok0 = it.range.start + it.chunk * kChunk;
    const int L = it.range.rows_in_chunk(it.chunk);

    // 0. The first head batch's gates (copied during the previous item) -> gamma, beta. Each
    //    thread reads only what it copied itself, so waiting for its own copies is enough.
    gates.scan_prefetched(it);

    tiles.consumer_wait(SingleState{phase});

    // 1. Tail rows to zeros, in-kernel l2norm; 2. K K^T and Q K^T.
    Tensor sQ = make_tensor(make_smem_ptr(ss.tiles.q.data()), typename Cfg::LayoutQK{});
    Tensor sK = make_tensor(make_smem_ptr(ss.tiles.k.data()), typename Cfg::LayoutQK{});
    prepare_qk_rows<Elem, Hqk, HeadK, Threads>(args, sQ, sK, tid, L, tok0, hqk);
    __syncthreads();
    qk_products<Cfg>(ss, sQ, sK, tid);
    __syncthreads();
    // The tiles and the gate buffers are free now (the GEMMs and step 0 were their last readers):
    // the next item's loads run during the solve.
    const int64_t next = item_slots[phase ^ 1u].next;
    if (next < args.num_items) {
      const PrepItem upcoming = item_slots[phase ^ 1u].it;
      if (tid == 0) issue_loads(upcoming, !Cfg::QkInQ);
      gates.prefetch_gates(upcoming);
    }

    for (int hb = 0; hb < G; hb += HeadBatch) {
      const int nb = min(HeadBatch, G - hb);
      // 3. Later head batches (more than Threads / 64 v-heads per q/k head) load their gates here.
      if (hb > 0) {
        gates.load_and_scan(it, hb, nb);
        __syncthreads();
      }

      solve_head_batch<Elem, Hqk, Hv, HeadK, Threads>(args, ss, tid, hqk, hb, nb, slot, L, next,
                                                      [&] { issue_q_load(item_slots[phase ^ 1u].it); });
      __syncthreads();
    }

    // Publish the item: every thread's stores come before the barrier above.
    if (args.ready != nullptr && tid == 0) publish_ready(args.ready + int64_t(hqk) * args.num_slots + slot);
    item = next;
  }

  // 6. A context-parallel call's job rows (plan_cp_jobs), which read only the call's inputs: this
  //    saves the launch of a kernel of their own (its host time: docs/kernel-notes.md). CpScheduler
  //    deals them to the CTAs.
  CpScheduler<Hv>::for_each_job_row(
      args.cp, [&](int64_t row) { plan_cp_jobs<Elem, Hqk, Hv, HeadK, HeadK, Threads, Gates>(args.cp, row); });
}

}  // namespace fqt
