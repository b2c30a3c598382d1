// The GDN backward's state-independent pieces on Hopper: everything the two chains
// (gdn_bwd_chain.cuh) and the per-chunk gradients take that does not depend on the state, for
// every chunk at once. One CTA of one warp group per (chunk, v-head), no loop over chunks.
//
// Per chunk of 64 tokens and v-head (docs/backward.md; the torch code of
// flashqla_tune/backward/chunked_torch.py before its chains is the specification), with
// gamma the in-chunk cumulative gate, Gamma_ij = e^{gamma_i - gamma_j} (j <= i, else 0),
// X = A0 = (I + strictly_lower(diag(b) K K^T))^{-1}, d = e^{gamma}, f = e^{gamma_C - gamma}:
//
//   A    = Gamma * X                       fp32 [64, 64] (and X itself, for the step after the chains)
//   u    = (A diag(b)) V                   fp32 [64, V]   (stored as the chain's add tiles)
//   w    = diag(d) (X diag(b)) K           16-bit [64, K]  (= (A diag(b)) diag(d) K: the gate cancels)
//   Kd   = diag(f) K                       16-bit [64, K]
//   m D Q = m diag(d) Q                    16-bit [64, K]  (m: qd_scale, the mantissa of the op's
//                                                          scale m 2^e; the chains take 2^e dO
//                                                          times a power of two: exact, then
//                                                          rounded once)
//   P^T dO = scale (Gamma * Q K^T)^T dO    fp32 [64, V]   (the add tiles too; scale: dout_scale)
//   gamma fp32 [64], e^{gamma_C} fp32
//
// Its steps are the forward prep's (gdn_prep.cuh), composed for one row block of the chunk
// layout: the q/k tiles by TMA through the prep's load ring, the gates scanned by PrepGates (the
// default gate options: the backward's g and beta are final), K K^T and Q K^T by qk_products
// (Q K^T lands in the q tile), the tensor-core solve for X (gdn_prep_solve_mma.cuh) on threads
// 0..63, while threads 64..127 write Kd, D Q and the gates. Then this kernel's own step: X and
// Q K^T become A (stored), the operand tiles A diag(b), X diag(b) and P, and three wgmma GEMMs of
// N = 128 give u, w and P^T dO. u and P^T dO are stored as the chain kernels read their fp32
// term (gdn_bwd_chain.cuh): per (chunk, v-head) V / AddBlockV tiles of (64 tokens, AddBlockV
// values), row-major, so no re-layout runs between this kernel and the chains.
//
// Inputs are in the padded chunk layout of the batched backward (chunked_torch.to_chunks): a
// chunk's 64 rows of a head, pad rows zero, so a tail or a chunk of no sequence needs no mask and
// no offsets are read: q, k [chunks, Hqk, 64, K] 16-bit, contiguous (the TMA boxes); g, beta fp32
// [chunks, Hv, 64] contiguous (PrepGates reads each (chunk, v-head) as a 64-row block of one head);
// v and dO [chunks, Hv, 64, V] in the call's dtype (fp32, fp16 or bf16: gdn_bwd_inputs.cuh) with
// any chunk, head and row strides of whole 16-byte pieces (the call's token rows are such a view).
// GVA: v-head h reads q/k head h / (Hv / Hqk).
//
// Range: the 16-bit operand tiles built from wider values (V, dO, A diag(b), X diag(b), P) are each
// scaled by a power of two that takes their largest magnitude into [1, 2) (exact; a training
// step's tiny dO neither underflows nor loses its mantissa), and the fp32 accumulators are scaled
// back when stored. q and k arrive 16-bit (normalised rows, or the op's own 16-bit inputs).
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "gdn_bwd_inputs.cuh"
#include "gdn_gate_options.cuh"
#include "gdn_pipeline.cuh"
#include "gdn_prep.cuh"
#include "gdn_prep_solve_mma.cuh"
#include "gdn_prep_storage.cuh"
#include "gdn_sequences.cuh"
#include "gdn_tma_producer.cuh"
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

template <class Cfg>
struct BwdPrepSharedStorage;

template <class Elem_, int HeadK_, int HeadV_, int AddBlockV_>
struct BwdPrepConfig {
  using Elem = Elem_;
  static constexpr int HeadK = HeadK_, HeadV = HeadV_;
  static constexpr int AddBlockV = AddBlockV_;  // the chain kernels' V tile (their BlockV)
  static_assert(AddBlockV % 2 == 0 && HeadV % AddBlockV == 0, "u and P^T dO are whole add tiles of float2 pairs");
  static_assert(sizeof(Elem) == 2, "the wgmma operands are 16-bit (fp16 or bf16)");
  static_assert(HeadK == 128, "Q K^T's fp32 tile lives in the q tile (K >= 128), a lane covers 4 of K's columns");
  static_assert(HeadV % 64 == 0 && HeadV <= 128, "V is whole swizzle atoms, its accumulators 64 x V in one warp group");
  static constexpr int Threads = 128;  // one warp group: wgmma M = 64 = the chunk's rows
  static constexpr int Warps = Threads / 32;
  static constexpr int CtasPerSm = 2;
  // The forward prep's configuration for one row block: q/k tiles of one head (Hqk = 1 over the
  // chunk layout's rows [chunks * Hqk * 64, K]), 128 threads (Q K^T in the q tile).
  using Prep = PrepConfig<Elem, 1, HeadK, Threads>;
  using Gates = PrepGates<Prep, /*Hv=*/1, /*G=*/1, PrecomputedGates>;
  using C64 = Int<kChunk>;
  using CK = Int<HeadK>;
  using CV = Int<HeadV>;

  // (row, j) tiles with j contiguous: the K-major A operands A diag(b) and X diag(b).
  using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, C64>{}));
  // (j, i) with j contiguous: P (i, j) read as the MN-major A operand P^T.
  using LayoutAt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<C64, C64>{}));
  // (v, t) with v contiguous: V and dO as MN-major B operands.
  using LayoutVT = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<CV, C64>{}));
  // The prep's k tile (t, k) viewed as (k, t): K as the MN-major B operand of w.
  using LayoutKT = decltype(composition(typename Prep::LayoutQK{}, make_layout(Shape<CK, C64>{}, GenRowMajor{})));

  // (row, v) += (row, t) (t, v): u = (A diag(b)) V and P^T dO; w = (X diag(b)) K.
  using MmaU = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<C64, CV, C64>,
                                                            GMMA::Major::K, GMMA::Major::MN>()));
  using MmaP = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<C64, CV, C64>,
                                                            GMMA::Major::MN, GMMA::Major::MN>()));
  using MmaW = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<C64, CK, C64>,
                                                            GMMA::Major::K, GMMA::Major::MN>()));
  using SharedStorage = BwdPrepSharedStorage<BwdPrepConfig>;
  static constexpr int SmemBytes = int(sizeof(SharedStorage));
  static_assert(CtasPerSm * (SmemBytes + 1024) <= 228 * 1024, "two CTAs per SM");
};

// This kernel's tiles, after the prep's storage.
template <class Cfg>
struct BwdPrepTiles {
  using Elem = typename Cfg::Elem;
  cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutA>, 1024> tm;    // A diag(b), scaled
  cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutA>, 1024> xb;    // X diag(b), scaled
  cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutAt>, 1024> pt;   // P, scaled
  cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutVT>, 1024> v;    // V, scaled
  cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutVT>, 1024> dout; // dO, scaled
};

// The operand tiles' scales: kUnitV, kUnitDo, kUnitTm, kUnitXb, kUnitP; and the slot of u's largest
// magnitude (u_amax), which scales nothing here.
enum : int { kUnitV = 0, kUnitDo = 1, kUnitTm = 2, kUnitXb = 3, kUnitP = 4, kUnitU = 5, kUnits = 6 };

template <class Cfg>
struct alignas(1024) BwdPrepSharedStorage {
  typename Cfg::Prep::SharedStorage prep;  // the forward prep's: q/k tiles, K K^T (then X), gates, load barrier
  BwdPrepTiles<Cfg> tiles;
  float amax[Cfg::Warps][kUnits];          // per-warp partial maxima of the operand tiles
  float inverse[kUnits];                   // 2^e of each tile's scale 2^-e
  float d[kChunk];                         // e^{gamma}: w's row factors
};

template <class Cfg>
struct BwdPrepParams {
  // The prep's part: tma_q, tma_k over the chunk layout's rows, g and beta [chunks, Hv, 64]
  // (nothing else of it is read: default gate options, no l2norm, no CP plan).
  PrepArgs<typename Cfg::Prep> prep;
  const typename Cfg::Elem* q;  // [chunks, Hqk, 64, K]: tma_q's tensor, read again for D Q
  const void* v;                // [chunks, Hv, 64, V] of vd_dtype with the strides below (elements)
  const void* dout;             // dO, as v
  int64_t v_stride[3];          // chunk, head, row
  int64_t dout_stride[3];
  int32_t vd_dtype;             // InputDtype of v and dO
  typename Cfg::Elem* w;        // [chunks, Hv, 64, K]
  typename Cfg::Elem* kd;
  typename Cfg::Elem* qd;
  float* u;                     // [chunks, Hv, V / AddBlockV, 64, AddBlockV]
  float* ptdo;                  // scale P^T dO, as u
  float* decay;                 // [chunks, Hv]
  float* gamma;                 // [chunks, Hv, 64]
  float* a;                     // [chunks, Hv, 64, 64] Gamma * A0; null: not written
  float* a0;                    // [chunks, Hv, 64, 64] A0; null: not written
  // the largest |dO| (without dout_scale) of the tile, [chunks, Hv] (cta_amax: a NaN is not seen,
  // it is in the tile itself); null: not written
  float* dout_amax;
  // the largest |u| of the tile as stored, [chunks, Hv] (as dout_amax: a NaN is not seen); null: not
  // written
  float* u_amax;
  int64_t num_chunks;
  float dout_scale;             // the op's scale, folded into P^T dO
  float qd_scale;               // the mantissa m of the op's scale m 2^e, folded into D Q
  int32_t num_heads;            // Hv
  int32_t num_qk_heads;         // Hqk
};

// A power of two 2^-e that takes `amax` into [1, 2) (into [2, 4) for the largest exponent, so
// that 2^-e stays a normal fp32), and 2^e: scaling by them is exact. 1 and 1 where amax is zero,
// subnormal, infinite or NaN (a non-finite tile stays non-finite).
struct Pow2Unit {
  float unit, inverse;
};
__device__ __forceinline__ Pow2Unit pow2_unit(float amax) {
  uint32_t e = (__float_as_uint(amax) >> 23) & 0xffu;
  if (e == 0u || e == 255u) return Pow2Unit{1.f, 1.f};
  e = e < 253u ? e : 253u;
  return Pow2Unit{__uint_as_float((254u - e) << 23), __uint_as_float(e << 23)};
}

// The CTA's largest value of each m[n] (non-negative; fmaxf, so a NaN is not seen: it flows on in
// the values themselves), returned to every thread; writes ss.amax, so the caller must not call
// it again before another barrier has passed.
template <class Cfg, int N>
__device__ __forceinline__ void cta_amax(typename Cfg::SharedStorage& ss, float (&m)[N], int first, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  CUTE_UNROLL
  for (int n = 0; n < N; ++n) {
    CUTE_UNROLL
    for (int o = 16; o > 0; o >>= 1) m[n] = fmaxf(m[n], __shfl_xor_sync(0xffffffffu, m[n], o));
    if (lane == 0) ss.amax[warp][first + n] = m[n];
  }
  __syncthreads();
  CUTE_UNROLL
  for (int n = 0; n < N; ++n) {
    m[n] = ss.amax[0][first + n];
    CUTE_UNROLL
    for (int w = 1; w < Cfg::Warps; ++w) m[n] = fmaxf(m[n], ss.amax[w][first + n]);
  }
}

// Step A: V and dO of the item, rows of In from global memory, into their (v, t) operand tiles,
// each scaled by its own power of two. By all 128 threads, both tiles' reads in flight at once
// (TilePieces: a thread holds 1/128 of each tile's 16-byte pieces, loaded coalesced, a row's
// pieces by consecutive threads).
template <class Cfg, class In>
__device__ __forceinline__ void load_value_tiles(const BwdPrepParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                                 int64_t item, int64_t chunk, int hv, int tid) {
  using Elem = typename Cfg::Elem;
  TilePieces<kChunk, Cfg::HeadV, Cfg::Threads, In> tiles[2];
  tiles[0].load(static_cast<const In*>(p.v) + chunk * p.v_stride[0] + hv * p.v_stride[1], p.v_stride[2]);
  tiles[1].load(static_cast<const In*>(p.dout) + chunk * p.dout_stride[0] + hv * p.dout_stride[1], p.dout_stride[2]);
  Elem* dst_tile[2] = {ss.tiles.v.data(), ss.tiles.dout.data()};
  float m[2] = {tiles[0].amax(), tiles[1].amax()};
  cta_amax<Cfg>(ss, m, kUnitV, tid);
  if (tid == 0 && p.dout_amax) p.dout_amax[item] = m[1];   // the chains' unit for dO is taken from it
  CUTE_UNROLL
  for (int s = 0; s < 2; ++s) {
    const Pow2Unit unit = pow2_unit(m[s]);
    if (tid == 0) ss.inverse[kUnitV + s] = unit.inverse;
    Tensor sT = make_tensor(make_smem_ptr(dst_tile[s]), typename Cfg::LayoutVT{});
    // N consecutive v of one t (c % N == 0): inside one 16-byte piece of the swizzled tile
    tiles[s].for_each([&](int t, int c, const auto& x) { store_scaled_piece<Elem>(&sT(c, t), x, unit.unit); });
  }
}

// Step B, beside the solve, by threads 64..127 (ptid = tid - 64, two warps, a warp per row, a
// lane per four of K's columns): Kd = diag(f) K from the k tile, D Q = diag(d) Q from global
// memory (the q tile holds Q K^T by now), gamma, e^{gamma_C} and the rows' d for w.
template <class Cfg, class SK>
__device__ __forceinline__ void store_scaled_rows(const BwdPrepParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                                  const SK& sK, int64_t qrow0, int64_t vrow0, int64_t item, int ptid) {
  using Elem = typename Cfg::Elem;
  constexpr int K = Cfg::HeadK;
  const float* gam = ss.prep.gamma()[0];
  const float gc = gam[kChunk - 1];
  const int warp = ptid / 32, lane = ptid % 32, c = 4 * lane;
  for (int r = warp; r < kChunk; r += 2) {
    const float d = expf(gam[r]), f = expf(gc - gam[r]);
    const uint2 kw = *reinterpret_cast<const uint2*>(&sK(r, c));
    const uint2 qw = __ldg(reinterpret_cast<const uint2*>(p.q + (qrow0 + r) * K + c));
    Elem kv[4], qv[4];
    memcpy(kv, &kw, sizeof(kw));
    memcpy(qv, &qw, sizeof(qw));
    const int64_t off = (vrow0 + r) * K + c;
    store_global_8(p.kd + off, pack2<Elem>(f * float(kv[0]), f * float(kv[1])),
                   pack2<Elem>(f * float(kv[2]), f * float(kv[3])));
    const float ds = d * p.qd_scale;
    store_global_8(p.qd + off, pack2<Elem>(ds * float(qv[0]), ds * float(qv[1])),
                   pack2<Elem>(ds * float(qv[2]), ds * float(qv[3])));
  }
  p.gamma[vrow0 + ptid] = gam[ptid];
  ss.d[ptid] = expf(gam[ptid]);
  if (ptid == 0) p.decay[item] = expf(gc);
}

// Step C, after the solve, by all 128 threads: column c = tid % 64, rows [32 h, 32 h + 32) with
// h = tid / 64, of X (in K K^T's upper triangle) and of Q K^T (in the q tile) become A (stored,
// fp32, and X too when asked for) and the operand tiles A diag(b), X diag(b) and P, each scaled by
// its power of two. The decay mask is e^{gamma_i - gamma_c} for c <= i and e^{-inf} = 0 above
// (selecting the exponent, as the forward prep does); pad rows keep X's identity (x_c = 1).
template <class Cfg>
__device__ __forceinline__ void build_operand_tiles(const BwdPrepParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                                    int64_t vrow0, int tid) {
  using Elem = typename Cfg::Elem;
  constexpr int kRows = kChunk / 2;
  const int c = tid % kChunk, half = tid / kChunk, i0 = kRows * half;
  const float* gam = ss.prep.gamma()[0];
  const float gc = gam[c], bc = ss.prep.beta()[0][c];
  const float* qk = ss.prep.qk_tile();
  float* a = p.a ? p.a + (vrow0 + i0) * kChunk + c : nullptr;
  float* a0 = p.a0 ? p.a0 + (vrow0 + i0) * kChunk + c : nullptr;
  float tm[kRows], xb[kRows], pv[kRows];
  float m[3] = {0.f, 0.f, 0.f};
  // part is a literal at each call, so that the rows' registers are indexed by constants
  auto column = [&](const int part) {
    const int first = kRows * part;
    for_each_in_x_column<kPrepPad, kRows>(ss.prep.products.kk, c, [&](int i, float xi) {
      const float mask = exp_ftz(c <= i ? gam[i] - gc : -INFINITY);
      const float ai = mask * xi;
      const int r = i - first;
      if (a) a[r * kChunk] = ai;
      if (a0) a0[r * kChunk] = xi;
      tm[r] = ai * bc;
      xb[r] = xi * bc;
      pv[r] = mask * qk[qk_offset<Cfg::Prep::QkInQ>(i, c)];
      m[0] = fmaxf(m[0], fabsf(tm[r]));
      m[1] = fmaxf(m[1], fabsf(xb[r]));
      m[2] = fmaxf(m[2], fabsf(pv[r]));
    }, part);
  };
  if (half == 0) column(0);
  else column(1);
  cta_amax<Cfg>(ss, m, kUnitTm, tid);
  const Pow2Unit ut = pow2_unit(m[0]), ux = pow2_unit(m[1]), up = pow2_unit(m[2]);
  if (tid == 0) {
    ss.inverse[kUnitTm] = ut.inverse;
    ss.inverse[kUnitXb] = ux.inverse;
    ss.inverse[kUnitP] = up.inverse;
  }
  Tensor sTm = make_tensor(make_smem_ptr(ss.tiles.tm.data()), typename Cfg::LayoutA{});
  Tensor sXb = make_tensor(make_smem_ptr(ss.tiles.xb.data()), typename Cfg::LayoutA{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.tiles.pt.data()), typename Cfg::LayoutAt{});
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    sTm(i0 + r, c) = Elem(ut.unit * tm[r]);
    sXb(i0 + r, c) = Elem(ux.unit * xb[r]);
    sPt(c, i0 + r) = Elem(up.unit * pv[r]);
  }
}

// An accumulator tile (rows, N) of one warp group into global memory, row-major with N columns,
// each value times factor(row): fp32 as float2 pairs, 16-bit as packed pairs (values e, e + 1 are
// neighbouring columns of one row, tests/test_fragment_layout.py).
template <class Out, class Acc, class Crd, class Factor>
__device__ __forceinline__ void store_rows(Out* out, int n_cols, const Acc& acc, const Crd& crd, Factor&& factor) {
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) {
    const int r = get<0>(crd(e)), col = get<1>(crd(e));
    const float s = factor(r);
    if constexpr (sizeof(Out) == 4) {
      *reinterpret_cast<float2*>(out + int64_t(r) * n_cols + col) = make_float2(s * acc(e), s * acc(e + 1));
    } else {
      store_global_4(out + int64_t(r) * n_cols + col, pack2<Out>(s * acc(e), s * acc(e + 1)));
    }
  }
}

// The same tile of fp32 values as row blocks of BlockV columns: column c of row r at
// out[(c / BlockV) * rows * BlockV + r * BlockV + c % BlockV] (the chain kernels' add tiles).
// Returns the largest magnitude this thread stored, exactly where factor is a power of two.
template <int BlockV, class Acc, class Crd>
__device__ __forceinline__ float store_column_tiles(float* out, const Acc& acc, const Crd& crd, float factor) {
  float amax = 0.f;  // of the accumulator, fmaxf: a NaN is not seen
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) {
    const int r = get<0>(crd(e)), col = get<1>(crd(e));
    *reinterpret_cast<float2*>(out + int64_t(col / BlockV) * kChunk * BlockV + r * BlockV + col % BlockV) =
        make_float2(factor * acc(e), factor * acc(e + 1));
    amax = fmaxf(amax, fmaxf(fabsf(acc(e)), fabsf(acc(e + 1))));
  }
  // a power-of-two factor scales every value exactly, so the largest stored is factor times it
  return fabsf(factor) * amax;
}

// One wgmma GEMM (64, N) = sA sB over the chunk's 64 rows, waited for, then stored by `store`
// (acc, its coordinates).
template <class Mma, int N, class SA, class SB, class Store>
__device__ __forceinline__ void gemm_and_store(const SA& sA, const SB& sB, int tid, Store&& store) {
  using Tile = Shape<Int<kChunk>, Int<N>>;
  Mma mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor acc = partition_fragment_C(mma, Tile{});
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  wgmma_gemm(mma, thr.partition_fragment_A(sA), thr.partition_fragment_B(sB), acc, true);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  store(acc, thr.partition_C(make_identity_tensor(Tile{})));
}

// Step D: u = (A diag(b)) V, P^T dO and w = diag(d) (X diag(b)) K on wgmma from the operand
// tiles, one accumulator tile at a time (64 x 128 fp32 is 64 registers per thread), each scaled
// back by its operands' inverses when stored.
template <class Cfg>
__device__ __forceinline__ void operand_gemms(const BwdPrepParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                              int64_t vrow0, int tid) {
  constexpr int K = Cfg::HeadK, V = Cfg::HeadV;
  Tensor sTm = make_tensor(make_smem_ptr(ss.tiles.tm.data()), typename Cfg::LayoutA{});
  Tensor sXb = make_tensor(make_smem_ptr(ss.tiles.xb.data()), typename Cfg::LayoutA{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.tiles.pt.data()), typename Cfg::LayoutAt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.tiles.v.data()), typename Cfg::LayoutVT{});
  Tensor sDo = make_tensor(make_smem_ptr(ss.tiles.dout.data()), typename Cfg::LayoutVT{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.prep.tiles.k.data()), typename Cfg::LayoutKT{});
  const float inv_u = ss.inverse[kUnitTm] * ss.inverse[kUnitV];
  const float inv_p = ss.inverse[kUnitP] * ss.inverse[kUnitDo] * p.dout_scale;
  const float inv_w = ss.inverse[kUnitXb];
  float u_max[1];  // this thread's largest |u|
  gemm_and_store<typename Cfg::MmaU, V>(sTm, sV, tid, [&](const auto& acc, const auto& crd) {
    u_max[0] = store_column_tiles<Cfg::AddBlockV>(p.u + vrow0 * V, acc, crd, inv_u);
  });
  gemm_and_store<typename Cfg::MmaP, V>(sPt, sDo, tid, [&](const auto& acc, const auto& crd) {
    store_column_tiles<Cfg::AddBlockV>(p.ptdo + vrow0 * V, acc, crd, inv_p);
  });
  gemm_and_store<typename Cfg::MmaW, K>(sXb, sKt, tid, [&](const auto& acc, const auto& crd) {
    store_rows(p.w + vrow0 * K, K, acc, crd, [&](int r) { return ss.d[r] * inv_w; });
  });
  if (p.u_amax) {   // the chains' unit for u is taken from it: of the values as stored
    cta_amax<Cfg>(ss, u_max, kUnitU, tid);
    if (tid == 0) p.u_amax[vrow0 / kChunk] = u_max[0];
  }
}

// Grid: x = chunk * Hv + v-head. Block: 128 threads.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::Threads, Cfg::CtasPerSm)
    gdn_bwd_prep_kernel(CUTE_GRID_CONSTANT const BwdPrepParams<Cfg> p) {
  using Prep = typename Cfg::Prep;
  using C64 = typename Cfg::C64;
  using CK = typename Cfg::CK;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const int tid = threadIdx.x;
  const int64_t item = blockIdx.x;  // chunk * Hv + v-head: the row block of every per-v-head tensor
  const int64_t chunk = item / p.num_heads;
  const int hv = int(item % p.num_heads);
  const int hqk = hv / (p.num_heads / p.num_qk_heads);
  const int64_t vrow0 = item * kChunk, qrow0 = (chunk * p.num_qk_heads + hqk) * kChunk;

  using Load = TmaProducer<typename Prep::LoadPipeline>;
  if (tid == 0) {
    Prep::LoadPipeline::init(ss.prep.loaded, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  Tensor sQ = make_tensor(make_smem_ptr(ss.prep.tiles.q.data()), typename Prep::LayoutQK{});
  Tensor sK = make_tensor(make_smem_ptr(ss.prep.tiles.k.data()), typename Prep::LayoutQK{});
  if (tid == 0) {
    // The item's q and k tiles: rows qrow0.. of the chunk layout (< 2^31: the launch checks).
    const int32_t rows = int32_t(p.num_chunks * p.num_qk_heads * kChunk);
    Tensor mQ = p.prep.tma_q.get_tma_tensor(make_shape(rows, int32_t(Cfg::HeadK)));
    Tensor mK = p.prep.tma_k.get_tma_tensor(make_shape(rows, int32_t(Cfg::HeadK)));
    const auto box = make_coord(int32_t(qrow0), 0);
    const Load load(ss.prep.loaded);
    load.expect(SingleState{0u}, Prep::TileTxBytes);
    load.tile(SingleState{0u}, p.prep.tma_q, local_tile(domain_offset(box, mQ), Shape<C64, CK>{}, make_coord(0, 0)), sQ);
    load.tile(SingleState{0u}, p.prep.tma_k, local_tile(domain_offset(box, mK), Shape<C64, CK>{}, make_coord(0, 0)), sK);
  }
  // The gates of the item's 64 rows: one 64-row block of a one-head gate array.
  PrepItem it;
  it.slot = 0;
  it.chunk = 0;
  it.range = SeqRange{vrow0, kChunk, 0};
  it.hqk = 0;
  it.valid = true;
  const typename Cfg::Gates gates{p.prep, ss.prep, tid};
  gates.prefetch_gates(it);
  gates.scan_prefetched(it);

  // A. V and dO into their operand tiles while the q/k tiles load (its barrier also publishes
  //    the scanned gates).
  with_input_type(p.vd_dtype, [&](auto in) { load_value_tiles<Cfg, decltype(in)>(p, ss, item, chunk, hv, tid); });

  // K K^T and Q K^T (the prep's step 2; pad rows are already zero in the chunk layout).
  const typename Prep::LoadPipeline tiles(ss.prep.loaded);
  tiles.consumer_wait(SingleState{0u});
  qk_products<Prep>(ss.prep, sQ, sK, tid);
  __syncthreads();

  // X by threads 0..63 (named barrier 1 inside); B beside it on the others.
  if (tid < kChunk) solve_mma::solve<kPrepPad>(ss.prep.products.kk, ss.prep.beta()[0], tid);
  else store_scaled_rows<Cfg>(p, ss, sK, qrow0, vrow0, item, tid - kChunk);
  __syncthreads();

  // C. A and the operand tiles; the generic stores are fenced before wgmma reads them.
  build_operand_tiles<Cfg>(p, ss, vrow0, tid);
  cutlass::arch::fence_view_async_shared();
  __syncthreads();

  // D. u, P^T dO and w.
  operand_gemms<Cfg>(p, ss, vrow0, tid);
}

}  // namespace fqt
