// Step 3 of the GDN backward on Hopper: the per-chunk gradients, once the chains
// (gdn_bwd_chain.cuh) have given every chunk's incoming state S_c and outgoing state gradient
// dS_{c+1}. A CTA computes one (chunk, v-head) tile at a time, no loop over a sequence's chunks:
// the tiles of one (chunk, q/k head), its v-heads in order, by one CTA, which sums their dq and dk
// into the q/k head's (the first v-head's stored, each later one's added to them: the same
// threads write and read the same elements, in a fixed order, so the sums are deterministic); one
// CTA per (chunk, q/k head), or one per SM walking them (ChunkGradConfig::Walk). It is one or two warp
// groups (ChunkGradConfig::Groups): two split the columns of every GEMM's output between them, so
// each SM scheduler has two warps to switch between and the two halves' GEMMs and epilogues overlap.
//
// Per chunk of 64 tokens and v-head (docs/backward.md "What the backward computes"; the torch code
// of flashqla_tune/backward/chunked_torch.py step 3, per_chunk_gradients, is the specification),
// with A0 = (I + L)^{-1},
// Gamma the decay mask, A = Gamma * A0, T = A diag(b), d = e^{gamma}, f = e^{gamma_C - gamma}:
//
//   dP  = dO Vn^T          dQK = dP * Gamma       QK = Q K^T     KK = K K^T
//   dQd = dO S^T           dw  = -dVn S^T         dKd = Vn dS'^T
//   dT  = dVn V^T + (dw K^T) diag(d)              dA  = dT diag(b)
//   dv  = T^T dVn          dKdd = T^T dw
//   dL  = strictly_lower(-A0^T (dA * Gamma) A0^T),  dLb = diag(b) dL
//   dq  = dQK K + diag(d) dQd
//   dk  = diag(f) dKd + diag(d) dKdd + dLb K + dLb^T K + dQK^T Q
//   dbeta = colsum(dT * A) + rowsum(dL * KK)
//   E = (dA * A0 + dP * QK) * Gamma
//   dgamma = d * (rowsum(dQd * Q) + rowsum(dKdd * K)) + rowsum(E) - colsum(E) - df,
//            df = f * rowsum(dKd * K);  dgamma_C += sum(df) + e^{gamma_C} <dS', S>
//   dg = the reverse cumulative sum of dgamma over the chunk
//
// Operands: every GEMM runs on wgmma with 16-bit operands (Elem) and fp32 accumulation. fp16 is
// the default: three more mantissa bits than bf16. Rounding every operand to fp16 costs the outputs
// about 4e-4 of relative L2 against float64 (an fp16-rounding emulation of this kernel's sequence
// over the GPU tests' cases); bf16 would cost about eight times that, on top of the chains' error
// and the bf16 rounding of the returned gradients, close to the op's 8e-3 bar on dq, dk, dv.
// fp16's range is made to hold in two ways, both exact (powers of two):
//  - the chains' quantities come scaled per (sequence, v-head) as the chains ran on them
//    (chunked_torch._chain_units): S_c and Vn by unit_u, dS_{c+1} and dVn by unit_d, and dO is
//    scaled by unit_d (and the op's scale) here. Every output but dv is bilinear in the d side and the u side, so the
//    accumulators hold unit_d * unit_u times the true values (dv: unit_d times), whatever the
//    loss scale, and are divided back only when stored;
//  - the tiles the chains do not see (Q, K and V, which without the in-kernel l2norm are the raw
//    inputs, and A0) are each brought to a largest magnitude in [1, 2) by a power of two of their
//    own (exponent clamped to [-64, 64]); the GEMMs that use them are corrected on the fp32
//    accumulator, between GEMMs where one accumulator sums terms of different scales.
// The operands made from accumulators (dQK, dw, X = dA * Gamma, A0^T X, dLb: registers or tiles)
// are in those units, products of operands of magnitude near 1, as the chains' own register
// operands are (below 4 in the emulation above, fp16 holds 65504). Whatever exceeds fp16 anyway
// rounds to infinity and shows in the outputs as non-finite, never as a finite wrong value.
//
// Shared memory holds every operand as a 16-bit tile in one physical form, row-major with the
// 128-byte swizzle (GMMA K-major atoms: rows x columns, columns contiguous); the transposed uses
// (A^T as an A operand, an MN-major B operand) are views of the same bytes, and a warp group's B
// operand is a block of whole swizzle atoms of them (8 rows of a K-major B, 64 columns of an
// MN-major one). An operand that a GEMM needs whole but two warp groups computed in halves (dQK,
// dw, Y, dLb) goes through its tile, made visible by a CTA barrier. The other inputs are read once
// from global memory by all threads, in their own dtype (q, k, v and dO as the call holds them:
// fp32, fp16 or bf16, gdn_bwd_inputs.cuh; A0 fp32), scaled, rounded and stored into their tile;
// the chains' results arrive 16-bit (Elem, as the chains rounded them for their own wgmmas) and
// are copied as they are; per-row sums stay in the registers of the quad that owns the row (one
// partial per warp group, added in group order at the end), per-column sums go to one row of
// shared memory per warp, added in a fixed order: no
// atomics, so a chunk's gradients are the same bits from run to run and however the batch around
// it is made.
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "gdn_bwd_inputs.cuh"
#include "gdn_sequences.cuh"  // kChunk
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

template <class Cfg>
struct ChunkGradSharedStorage;

template <class Elem_, int HeadK_, int HeadV_, int Groups_, bool Walk_ = false>
struct ChunkGradConfig {
  using Elem = Elem_;
  static constexpr int HeadK = HeadK_, HeadV = HeadV_, Groups = Groups_;
  // Walk: one CTA per SM walks the items ((chunk, q/k head): its v-heads' tiles in order; item,
  // item + grid, ...) and asks L2 for its next tile's inputs once its current tile's are in shared
  // memory, so the next tile's DRAM reads overlap this tile's GEMMs; else one CTA per item, whose
  // first tile's inputs are asked for when it starts.
  static constexpr bool Walk = Walk_;
  static_assert(sizeof(Elem) == 2, "the wgmma operands are 16-bit (fp16 or bf16)");
  static_assert(HeadK % 64 == 0 && HeadK <= 128 && HeadV % 64 == 0 && HeadV <= 128,
                "K and V are 64 or 128: whole swizzle atoms, and 64 x K and 64 x V fp32 accumulators "
                "in one warp group's registers");
  static_assert(Groups == 1 || Groups == 2, "one or two warp groups");
  static_assert(Groups == 1 || (HeadK == 128 && HeadV == 128),
                "two warp groups take 64 of the K and V columns each: an MN-major B operand's block is "
                "whole 64-column swizzle atoms, so K = V = 128");
  static constexpr int Threads = 128 * Groups;  // a warp group: wgmma M = 64 = the chunk's tokens
  static constexpr int Warps = 4 * Groups;
  // The output columns each warp group computes: of a (64, 64) token x token output, of a
  // (64, K) and of a (64, V) one.
  static constexpr int NC = kChunk / Groups, NK = HeadK / Groups, NV = HeadV / Groups;

  using C64 = Int<kChunk>;

  // A physical (rows, cols) tile, cols contiguous, and its transposed (cols, rows) view.
  template <int R, int C>
  using Tile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<R>, Int<C>>{}));
  template <int R, int C>
  using TileT = decltype(composition(Tile<R, C>{}, make_layout(Shape<Int<C>, Int<R>>{}, GenRowMajor{})));
  // The first NB rows of a Tile<R, C> (a K-major B operand's block; NB % 8 == 0), and the first NB
  // rows of a TileT<R, C> (NB of the physical columns: an MN-major B operand's block; NB % 64 == 0).
  // A later block is the same layout from a later address (row_block, col_block).
  template <int R, int C, int NB>
  using TileRows = decltype(composition(Tile<R, C>{}, Layout<Shape<Int<NB>, Int<C>>, Stride<_1, Int<R>>>{}));
  template <int R, int C, int NB>
  using TileTRows = decltype(composition(TileT<R, C>{}, Layout<Shape<Int<NB>, Int<R>>, Stride<_1, Int<C>>>{}));

  // (64, N) += (64, Kd) (N, Kd)^T, both operands in shared memory.
  template <int N, int Kd, GMMA::Major MA, GMMA::Major MB>
  using MmaSS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Elem, Elem, float, Shape<C64, Int<N>, Int<Kd>>, MA, MB>()));

  static constexpr auto KM = GMMA::Major::K;
  static constexpr auto MN = GMMA::Major::MN;
  using MmaTokTokV = MmaSS<NC, HeadV, KM, KM>;    // dO Vn^T, dVn V^T: (t, s) over v
  using MmaTokTokK = MmaSS<NC, HeadK, KM, KM>;    // Q K^T, K K^T, dw K^T: (t, s) over k
  using MmaTokKV = MmaSS<NK, HeadV, KM, KM>;      // dO S^T, dVn S^T, Vn dS'^T: (t, k) over v
  using MmaTokKTok = MmaSS<NK, kChunk, KM, MN>;   // dQK K, dLb K: (t, k) over s
  using MmaTokKTokT = MmaSS<NK, kChunk, MN, MN>;  // T^T dw, dLb^T K, dQK^T Q: (s, k) over t
  using MmaTokVTokT = MmaSS<NV, kChunk, MN, MN>;  // T^T dVn: (s, v) over t
  using MmaTokTokTokT = MmaSS<NC, kChunk, MN, KM>;  // A0^T X: (i, m) over l, X^T's rows the B
  using MmaTokTokTok = MmaSS<NC, kChunk, KM, KM>;   // Y A0^T: (i, j) over m

  using SharedStorage = ChunkGradSharedStorage<ChunkGradConfig>;
  static constexpr int SmemBytes = int(sizeof(SharedStorage));
};

// Where block `b` of NB rows (row_block) or of NB physical columns (col_block, a TileT's rows)
// starts in a tile of R rows, in elements.
__host__ __device__ __forceinline__ int row_block(int b, int nb) { return b * nb * 64; }
template <int R>
__host__ __device__ __forceinline__ int col_block(int b, int nb) { return b * (nb / 64) * R * 64; }

// Where a strided per-chunk input keeps (chunk, head, row): element strides, columns contiguous.
// The batched backward's inputs are views of token rows ([chunks, 64, H, D] in memory), read in
// place.
struct ChunkStrides {
  int64_t chunk, head, row;
  __device__ __forceinline__ int64_t at(int64_t c, int64_t h) const { return c * chunk + h * head; }
};

// The kernel's parameters: per-chunk tensors in the batched backward's chunk layout, fp32 but for
// the chains' 16-bit results and the inputs q, k, v and dO, which are in the call's dtype
// (qk_dtype, vd_dtype: InputDtype); the chains' results and A0 contiguous, indexed by tile =
// chunk * Hv + v-head; q, k (per q/k head), v, dO, beta and gamma through their strides.
template <class Cfg>
struct ChunkGradParams {
  const void* q;        // [chunks, Hqk, 64, K] (after the l2norm when the op applies it), qk_dtype
  const void* k;        // [chunks, Hqk, 64, K], qk_dtype
  const void* v;        // [chunks, Hv, 64, V], vd_dtype
  const void* dout;     // dO [chunks, Hv, 64, V], taken times dout_scale, vd_dtype
  const float* beta;    // [chunks, Hv, 64]
  const float* gamma;   // in-chunk cumulative gate [chunks, Hv, 64]
  ChunkStrides q_strides, k_strides, v_strides, dout_strides, beta_strides, gamma_strides;
  const float* a0;      // (I + strictly_lower(diag(b) K K^T))^{-1} [chunks, Hv, 64, 64]
  const typename Cfg::Elem* state;   // unit_u S_c [chunks, Hv, K, V]
  const typename Cfg::Elem* dstate;  // unit_d dS_{c+1} [chunks, Hv, K, V]
  const typename Cfg::Elem* vn;      // unit_u Vn [chunks, Hv, 64, V]
  const typename Cfg::Elem* dvn;     // unit_d dVn [chunks, Hv, 64, V]
  const float* unit_u;  // [chunks, Hv]
  const float* unit_d;  // [chunks, Hv]
  float* dq;            // [chunks, Hqk, 64, K], summed over the q/k head's v-heads
  float* dk;            // [chunks, Hqk, 64, K], summed so
  float* dv;            // [chunks, Hv, 64, V]
  float* dbeta;         // [chunks, Hv, 64]
  float* dg;            // [chunks, Hv, 64], the reverse cumulative sum applied
  // the outputs through their strides too: the backward writes them token-major within each chunk
  // ([chunks, 64, H, D] in memory), so that one row gather takes them back to token rows
  ChunkStrides dq_strides, dk_strides, dv_strides, dbeta_strides, dg_strides;
  int64_t num_chunks;
  float dout_scale;      // the op's scale
  int32_t num_heads;     // Hv
  int32_t num_qk_heads;  // Hqk, dividing Hv
  int32_t qk_dtype;      // InputDtype of q and k
  int32_t vd_dtype;      // InputDtype of v and dO
};

template <class Cfg>
struct alignas(1024) ChunkGradSharedStorage {
  using Elem = typename Cfg::Elem;
  static constexpr int K = Cfg::HeadK, V = Cfg::HeadV, C = kChunk, W = Cfg::Warps;
  cute::array_aligned<Elem, C * K, 1024> q, k, dw;
  cute::array_aligned<Elem, C * V, 1024> v, dout, vn, dvn;
  // S_c; once dw is computed (its last reader), X^T, Y = A0^T X and dLb in its first 3 x 64 x 64
  // where they fit (not at K = V = 64: there they have their own)
  cute::array_aligned<Elem, K * V, 1024> state;
  cute::array_aligned<Elem, K * V, 1024> dstate;
  cute::array_aligned<Elem, C * C, 1024> a0, t, td, dqk;  // A0, T, T diag(d), dQK (all (t, s))
  float gamma[C], beta[C];
  // per warp (summed in a fixed order at the end, so the gradients are deterministic): sums over
  // rows of the terms of dgamma that are column sums, and of dbeta
  float col_gamma[W][C];
  float col_beta[W][C];
  // per warp group: its columns' share of each row's sums
  float row_gamma[Cfg::Groups][C], row_beta[Cfg::Groups][C];
  float reduce[W];
  float tail;          // sum(df) + e^{gamma_C} <dS', S>, added to dgamma of the chunk's last slot
  static constexpr bool kScratchInState = 3 * C * C <= K * V;
  cute::array_aligned<Elem, kScratchInState ? 8 : 3 * C * C, 1024> scratch_own;
  __device__ __forceinline__ Elem* scratch() { return kScratchInState ? state.data() : scratch_own.data(); }
  __device__ __forceinline__ Elem* xt() { return scratch(); }           // X^T (m, l)
  __device__ __forceinline__ Elem* y() { return scratch() + C * C; }    // Y (i, m)
  __device__ __forceinline__ Elem* dlb() { return scratch() + 2 * C * C; }  // dLb (i, j)
};

// ---------------------------------------------------------------- CTA-wide helpers

// The largest |x| (op = max) or the sum (op = sum) of every thread's `x` over the CTA's Warps
// warps, returned to all threads, in a fixed order.
template <bool Max, int Warps>
__device__ __forceinline__ float cta_reduce(float x, float* scratch) {
  static_assert(Warps == 4 || Warps == 8, "a fixed pairwise order over 4 or 8 warps");
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = Max ? fmaxf(x, y) : x + y;
  }
  __syncthreads();  // the previous reduction's readers are done with scratch
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  auto both = [](float a, float b) { return Max ? fmaxf(a, b) : a + b; };
  float r = both(both(scratch[0], scratch[1]), both(scratch[2], scratch[3]));
  if constexpr (Warps == 8) r = both(r, both(both(scratch[4], scratch[5]), both(scratch[6], scratch[7])));
  return r;
}

// The power of two that takes `amax` into [1, 2) (exponent clamped to [-64, 64]); 1 where amax is
// zero or not finite (a non-finite element then stays non-finite in its products).
__device__ __forceinline__ float unit_scale(float amax) {
  if (!(amax > 0.f) || !isfinite(amax)) return 1.f;
  const int e = min(max(ilogbf(amax), -64), 64);
  return ldexpf(1.f, -e);
}

// Element (r, c) of a Cfg::Tile<R, C> at `base` (1024-byte aligned), as CuTe's swizzled layout
// places it: 64-column atoms of R rows, 64 elements a row, and the 128-byte swizzle XORs the
// 16-byte piece's index within the row with the row's index mod 8. Written out so that the address
// of a thread's accumulator elements costs a few integer operations on 32-bit offsets
// (tests/test_backward_chunk_kernels.py checks it against the CuTe layout).
template <int R>
__host__ __device__ __forceinline__ int tile_offset(int r, int c) {
  static_assert(R % 8 == 0, "whole swizzle atoms of 8 rows");
  return ((c >> 6) * (R * 64) + r * 64 + (c & 63)) ^ ((r & 7) << 3);
}

// The offsets in a Tile<R, .> of one thread's accumulator elements. The wgmma accumulator puts a
// thread's elements at rows r0 + 8 i (see below), so every element has the swizzle's row term
// r0 mod 8 of the thread's first element, which only the 16-byte piece index (bits 3-5 of the
// column within its atom) sees.
template <int R>
struct AccTileOffsets {
  int x8;
  template <class Crd>
  __host__ __device__ __forceinline__ explicit AccTileOffsets(const Crd& crd) : x8((get<0>(crd(0)) & 7) << 3) {}
  // tile_offset<R>(r, c) for a row r of the thread's
  __host__ __device__ __forceinline__ int operator()(int r, int c) const {
    return (c >> 6) * (R * 64) + r * 64 + ((c & 63) ^ x8);
  }
};

// Four fp32 values times `scale` into elements (r, c..c+3) of a 16-bit tile (c % 4 == 0: one
// 8-byte piece of a 16-byte swizzle unit).
template <class STile>
__device__ __forceinline__ void store4(STile& s, int r, int c, float4 x, float scale) {
  using Elem = typename STile::value_type;
  uint2 word{pack2<Elem>(scale * x.x, scale * x.y), pack2<Elem>(scale * x.z, scale * x.w)};
  *reinterpret_cast<uint2*>(&s(r, c)) = word;
}

// Ask L2 for the CTA's inputs ahead of the loads that read them, all at once instead of tile after
// tile: a contiguous range (`bytes` a multiple of 16, 16-byte aligned; one thread, a uniform
// address), or what holds a thread's own address.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void prefetch_at_l2(const void* src) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(src) : "memory");
}

// A strided [64, D] tile of In (rows `row_stride` elements apart), one prefetch per 32-byte sector
// (whether a prefetch brings more is not specified), spread over the CTA's threads.
template <int D, int Threads, class In>
__device__ __forceinline__ void prefetch_rows_l2(const In* g, int64_t row_stride) {
  constexpr int kRowBytes = D * int(sizeof(In)), kSectorsPerRow = kRowBytes / 32, kSectorElems = 32 / int(sizeof(In));
  static_assert(kSectorsPerRow * 32 == kRowBytes && kChunk * kSectorsPerRow % Threads == 0,
                "rows of whole sectors, as many for every thread");
  CUTE_UNROLL
  for (int j = 0; j < kChunk * kSectorsPerRow / Threads; ++j) {
    const int i = threadIdx.x + Threads * j;
    prefetch_at_l2(g + (i / kSectorsPerRow) * row_stride + (i % kSectorsPerRow) * kSectorElems);
  }
}

// Elements (r, c..c+7) of a 16-bit tile (c % 8 == 0: one whole 16-byte swizzle unit) from eight
// 16-bit values as they are.
template <class STile>
__device__ __forceinline__ void store8(STile& s, int r, int c, uint4 word) {
  *reinterpret_cast<uint4*>(&s(r, c)) = word;
}

// A contiguous 16-bit [R, C] tile (rows of C elements) from global memory into its shared tile,
// in 16-byte pieces.
template <int R, int C, int Threads, class STile>
__device__ __forceinline__ void stage_copy(STile s, const typename STile::value_type* g) {
  constexpr int kPerThread = R * C / 8 / Threads;
  static_assert(kPerThread * 8 * Threads == R * C, "a tile is whole 16-byte pieces of the threads");
  const uint4* g16 = reinterpret_cast<const uint4*>(g);
#pragma unroll 8
  for (int j = 0; j < kPerThread; ++j) {
    const int idx = threadIdx.x + Threads * j;
    store8(s, idx / (C / 8), idx % (C / 8) * 8, __ldg(g16 + idx));
  }
}

// The inner product of two pieces of eight 16-bit values, in fp32.
template <class Elem>
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  Elem x[8], y[8];
  memcpy(x, &a, sizeof(a));
  memcpy(y, &b, sizeof(b));
  float sum = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < 8; ++i) sum += float(x[i]) * float(y[i]);
  return sum;
}

// ---------------------------------------------------------------- accumulator helpers
//
// The SM90 wgmma accumulator of a (64, N) tile: warp w of the warp group holds rows 16 w .. 16 w +
// 15, the quad of lanes 4 i .. 4 i + 3 rows 16 w + i and 16 w + i + 8, each lane of the quad its
// own columns. So a row's sum over the warp group's columns is the quad's (two lane shuffles) and
// a column's sum the eight quads' of every warp of the group.

// Adds each of this thread's two rows' sums of value(e) over its elements e into row[2] (row 0:
// the thread's first row, row 1: eight below), summed over the quad.
template <class Crd, class F>
__device__ __forceinline__ void add_row_sums(const Crd& crd, F value, float (&row)[2]) {
  float part[2] = {0.f, 0.f};
  const int r0 = get<0>(crd(0));
  CUTE_UNROLL
  for (int e = 0; e < size(crd); ++e) part[get<0>(crd(e)) == r0 ? 0 : 1] += value(e);
  CUTE_UNROLL
  for (int s = 0; s < 2; ++s) {
    part[s] += __shfl_xor_sync(0xffffffffu, part[s], 1);
    part[s] += __shfl_xor_sync(0xffffffffu, part[s], 2);
    row[s] += part[s];
  }
}

// Adds the column sums over this warp's rows of value(e) into its own col[warp][64] in shared
// memory (lanes 0..3 hold distinct columns, so plain adds: no atomics, whose order would vary).
template <class Crd, class F>
__device__ __forceinline__ void add_col_sums(const Crd& crd, F value, float (*col)[kChunk]) {
  const int r0 = get<0>(crd(0));
  // an element and the one eight rows below it share the column: summed in the thread first
  CUTE_UNROLL
  for (int e = 0; e < size(crd); ++e) {
    if (get<0>(crd(e)) != r0) continue;
    float x = value(e);
    CUTE_UNROLL
    for (int e2 = 0; e2 < size(crd); ++e2)
      if (get<0>(crd(e2)) != r0 && get<1>(crd(e2)) == get<1>(crd(e))) x += value(e2);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    x += __shfl_xor_sync(0xffffffffu, x, 16);
    if (threadIdx.x % 32 < 4) col[threadIdx.x / 32][get<1>(crd(e))] += x;
  }
}

// An accumulator into a 16-bit Tile<R, .> of the same (rows, cols) at `base` (pairs of
// neighbouring columns), or into the transposed tile (cols, rows): element (r, c) at (c, r).
template <int R, class Acc, class Crd, class Elem>
__device__ __forceinline__ void store_tile(const Acc& acc, const Crd& crd, Elem* base) {
  const AccTileOffsets<R> at(crd);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2)
    *reinterpret_cast<uint32_t*>(base + at(get<0>(crd(e)), get<1>(crd(e)))) =
        pack2<Elem>(acc(e), acc(e + 1));
}
template <int R, class Acc, class Crd, class Elem>
__device__ __forceinline__ void store_tile_transposed(const Acc& acc, const Crd& crd, Elem* base) {
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) base[tile_offset<R>(get<1>(crd(e)), get<0>(crd(e)))] = Elem(acc(e));
}

// An accumulator times `scale` into fp32 rows `row_stride` elements apart at out (pairs of
// neighbouring columns; the host checks the stride and base allow float2 stores).
template <class Acc, class Crd>
__device__ __forceinline__ void store_global(const Acc& acc, const Crd& crd, float* out, int64_t row_stride,
                                             float scale, bool add = false) {
  const int r0 = get<0>(crd(0)), c0 = get<1>(crd(0));
  float* base = out + r0 * row_stride + c0;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) {
    float2* at = reinterpret_cast<float2*>(base + (get<0>(crd(e)) - r0) * row_stride + (get<1>(crd(e)) - c0));
    // each product rounded as a stored value is, then the sum rounded (no fused multiply-add), so
    // the sum over the v-heads is the sum of their values as each alone would store them
    float2 x = make_float2(__fmul_rn(scale, acc(e)), __fmul_rn(scale, acc(e + 1)));
    if (add) {  // onto what this thread stored there for the earlier v-heads
      const float2 before = *at;
      x = make_float2(__fadd_rn(before.x, x.x), __fadd_rn(before.y, x.y));
    }
    *at = x;
  }
}

template <class Acc>
__device__ __forceinline__ void scale_acc(Acc& acc, float s) {
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) acc(e) *= s;
}

// This thread's index in its warp group: the wgmma partitions' thread.
__device__ __forceinline__ int group_thread() { return threadIdx.x % 128; }

// acc (+)= A B with both operands in shared memory (A: (64, Kd) view, B: (N, Kd) view); waits.
template <class Mma, class SA, class SB, class Acc>
__device__ __forceinline__ void gemm_ss(const SA& sA, const SB& sB, Acc& acc, bool zero_init) {
  Mma mma;
  auto thr = mma.get_thread_slice(group_thread());
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  wgmma_gemm(mma, thr.partition_fragment_A(sA), thr.partition_fragment_B(sB), acc, zero_init);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

template <class Mma, int N>
__device__ __forceinline__ auto make_acc() {
  return partition_fragment_C(Mma{}, Shape<Int<kChunk>, Int<N>>{});
}
// The (row, column) of each of this thread's elements of a (64, N) accumulator whose column 0 is
// the output's column col0 (the warp group's block).
template <class Mma, int N>
__device__ __forceinline__ auto acc_coords(int col0) {
  return Mma{}.get_thread_slice(group_thread()).partition_C(
      domain_offset(make_coord(0, col0), make_identity_tensor(Shape<Int<kChunk>, Int<N>>{})));
}

// After the threads' generic-proxy stores into operand tiles: visible to the next wgmma.
__device__ __forceinline__ void operands_ready() {
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
}

// Asks L2 for every input tile of `tile` (chunk * Hv + v-head) at once, instead of tile after tile
// as the staging reads them: the strided ones line by line, the contiguous ones whole.
template <class Cfg>
__device__ __forceinline__ void prefetch_tile(const ChunkGradParams<Cfg>& p, int64_t tile) {
  using Elem = typename Cfg::Elem;
  constexpr int K = Cfg::HeadK, V = Cfg::HeadV, C = kChunk, T = Cfg::Threads;
  const int hv = int(tile % p.num_heads);
  const int64_t chunk = tile / p.num_heads;
  const int hq = hv / (p.num_heads / p.num_qk_heads);
  if (threadIdx.x == 0) {
    prefetch_l2(p.a0 + tile * C * C, C * C * sizeof(float));
    prefetch_l2(p.vn + tile * C * V, C * V * sizeof(Elem));
    prefetch_l2(p.dvn + tile * C * V, C * V * sizeof(Elem));
    prefetch_l2(p.state + tile * K * V, K * V * sizeof(Elem));
    prefetch_l2(p.dstate + tile * K * V, K * V * sizeof(Elem));
  }
  with_input_type(p.qk_dtype, [&](auto in) {
    using In = decltype(in);
    prefetch_rows_l2<K, T>(static_cast<const In*>(p.q) + p.q_strides.at(chunk, hq), p.q_strides.row);
    prefetch_rows_l2<K, T>(static_cast<const In*>(p.k) + p.k_strides.at(chunk, hq), p.k_strides.row);
  });
  with_input_type(p.vd_dtype, [&](auto in) {
    using In = decltype(in);
    prefetch_rows_l2<V, T>(static_cast<const In*>(p.v) + p.v_strides.at(chunk, hv), p.v_strides.row);
    prefetch_rows_l2<V, T>(static_cast<const In*>(p.dout) + p.dout_strides.at(chunk, hv), p.dout_strides.row);
  });
}

// ---------------------------------------------------------------- the kernel

// One tile (chunk * Hv + v-head): its inputs staged, then its gradients. `next` >= 0: the tile
// this CTA takes after this one, whose inputs L2 is asked for once this tile's are staged.
template <class Cfg>
__device__ __forceinline__ void chunk_tile(const ChunkGradParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                           const int64_t tile, const int64_t next) {
  using Elem = typename Cfg::Elem;
  constexpr int K = Cfg::HeadK, V = Cfg::HeadV, C = kChunk, T = Cfg::Threads, W = Cfg::Warps;
  constexpr int NC = Cfg::NC, NK = Cfg::NK, NV = Cfg::NV;
  const int hv = int(tile % p.num_heads);
  const int64_t chunk = tile / p.num_heads;
  const int hq = hv / (p.num_heads / p.num_qk_heads);  // the v-head's q/k head
  const bool later_head = hv % (p.num_heads / p.num_qk_heads) != 0;  // dq, dk add to the earlier v-heads'
  const int tid = threadIdx.x;
  const int group = tid / 128;  // this warp group's block of every output's columns
  const int cc0 = group * NC, ck0 = group * NK, cv0 = group * NV;

  using TileCK = typename Cfg::template Tile<C, K>;
  using TileCV = typename Cfg::template Tile<C, V>;
  using TileKV = typename Cfg::template Tile<K, V>;
  using TileCC = typename Cfg::template Tile<C, C>;
  using TileCCt = typename Cfg::template TileT<C, C>;
  auto tile_of = [](Elem* ptr, auto layout) { return make_tensor(make_smem_ptr(ptr), layout); };
  // whole operands
  Tensor sQ = tile_of(ss.q.data(), TileCK{});
  Tensor sK = tile_of(ss.k.data(), TileCK{});
  Tensor sDW = tile_of(ss.dw.data(), TileCK{});
  Tensor sV = tile_of(ss.v.data(), TileCV{});
  Tensor sDO = tile_of(ss.dout.data(), TileCV{});
  Tensor sVn = tile_of(ss.vn.data(), TileCV{});
  Tensor sDVn = tile_of(ss.dvn.data(), TileCV{});
  Tensor sS = tile_of(ss.state.data(), TileKV{});
  Tensor sDS = tile_of(ss.dstate.data(), TileKV{});
  Tensor sA0 = tile_of(ss.a0.data(), TileCC{});
  Tensor sT = tile_of(ss.t.data(), TileCC{});
  Tensor sTd = tile_of(ss.td.data(), TileCC{});
  Tensor sDQK = tile_of(ss.dqk.data(), TileCC{});
  Tensor sY = tile_of(ss.y(), TileCC{});
  Tensor sDLb = tile_of(ss.dlb(), TileCC{});
  Tensor sA0t = tile_of(ss.a0.data(), TileCCt{});
  Tensor sTt = tile_of(ss.t.data(), TileCCt{});
  Tensor sTdt = tile_of(ss.td.data(), TileCCt{});
  Tensor sDQKt = tile_of(ss.dqk.data(), TileCCt{});
  Tensor sDLbt = tile_of(ss.dlb(), TileCCt{});
  // this warp group's B operands: rows [cc0, cc0 + NC) of the (s, .) tiles, rows [ck0, ck0 + NK) of
  // the (k, v) states, and columns [ck0, ck0 + NK) or [cv0, cv0 + NV) of the (t, k), (t, v) tiles
  Tensor sVnB = tile_of(ss.vn.data() + row_block(group, NC), typename Cfg::template TileRows<C, V, NC>{});
  Tensor sVB = tile_of(ss.v.data() + row_block(group, NC), typename Cfg::template TileRows<C, V, NC>{});
  Tensor sKB = tile_of(ss.k.data() + row_block(group, NC), typename Cfg::template TileRows<C, K, NC>{});
  Tensor sXtB = tile_of(ss.xt() + row_block(group, NC), typename Cfg::template TileRows<C, C, NC>{});
  Tensor sA0B = tile_of(ss.a0.data() + row_block(group, NC), typename Cfg::template TileRows<C, C, NC>{});
  Tensor sSB = tile_of(ss.state.data() + row_block(group, NK), typename Cfg::template TileRows<K, V, NK>{});
  Tensor sDSB = tile_of(ss.dstate.data() + row_block(group, NK), typename Cfg::template TileRows<K, V, NK>{});
  Tensor sKtB = tile_of(ss.k.data() + col_block<C>(group, NK), typename Cfg::template TileTRows<C, K, NK>{});
  Tensor sQtB = tile_of(ss.q.data() + col_block<C>(group, NK), typename Cfg::template TileTRows<C, K, NK>{});
  Tensor sDWtB = tile_of(ss.dw.data() + col_block<C>(group, NK), typename Cfg::template TileTRows<C, K, NK>{});
  Tensor sDVntB = tile_of(ss.dvn.data() + col_block<C>(group, NV), typename Cfg::template TileTRows<C, V, NV>{});

  const float* gam = ss.gamma;
  const float* bet = ss.beta;
  // Gamma_ij = e^{gamma_i - gamma_j} for i >= j, else 0
  auto decay = [&](int i, int j) { return i >= j ? __expf(gam[i] - gam[j]) : 0.f; };
  const float unit_u = p.unit_u[tile], unit_d = p.unit_d[tile];
  const float inv_du = 1.f / (unit_u * unit_d);  // accumulators of d x u products -> true values
  float s_a0, s_q, s_k, s_v;                      // A0's, q's, k's and v's own tile scales
  with_input_type(p.qk_dtype, [&](auto qk_in) {
    with_input_type(p.vd_dtype, [&](auto vd_in) {
      using QkIn = decltype(qk_in);
      using VdIn = decltype(vd_in);
      // q, k, v and dO are read as raw 16-byte pieces (TilePieces), as many tiles at once as fit
      // kRawRegs registers a thread (32 per warp group; at least one tile), the first group before
      // the gates load: their DRAM reads are in flight together and beside the gates' (at two warp
      // groups and 16-bit inputs, all four tiles at once)
      TilePieces<C, K, T, QkIn> tq, tk;
      TilePieces<C, V, T, VdIn> tv, tdo;
      constexpr int kRawRegs = 32 * Cfg::Groups, kQk = 4 * decltype(tq)::kPieces, kVd = 4 * decltype(tv)::kPieces;
      constexpr int kGroup = 2 * (kQk + kVd) <= kRawRegs ? 4 : (2 * kQk <= kRawRegs && 2 * kVd <= kRawRegs ? 2 : 1);
      auto load = [&](int i) {  // tile i of q, k, v, dO
        if (i == 0) tq.load(static_cast<const QkIn*>(p.q) + p.q_strides.at(chunk, hq), p.q_strides.row);
        if (i == 1) tk.load(static_cast<const QkIn*>(p.k) + p.k_strides.at(chunk, hq), p.k_strides.row);
        if (i == 2) tv.load(static_cast<const VdIn*>(p.v) + p.v_strides.at(chunk, hv), p.v_strides.row);
        if (i == 3) tdo.load(static_cast<const VdIn*>(p.dout) + p.dout_strides.at(chunk, hv), p.dout_strides.row);
      };
      // q, k and v each scaled by a power of two of their own, dO by unit_d and the op's scale
      auto store = [&](int i) {
        if (i == 0) {
          s_q = unit_scale(cta_reduce<true, W>(tq.amax(), ss.reduce));
          tq.for_each([&](int r, int c, const auto& x) { store_scaled_piece<Elem>(&sQ(r, c), x, s_q); });
        }
        if (i == 1) {
          s_k = unit_scale(cta_reduce<true, W>(tk.amax(), ss.reduce));
          tk.for_each([&](int r, int c, const auto& x) { store_scaled_piece<Elem>(&sK(r, c), x, s_k); });
        }
        if (i == 2) {
          s_v = unit_scale(cta_reduce<true, W>(tv.amax(), ss.reduce));
          tv.for_each([&](int r, int c, const auto& x) { store_scaled_piece<Elem>(&sV(r, c), x, s_v); });
        }
        if (i == 3) {
          const float s_do = unit_d * p.dout_scale;
          tdo.for_each([&](int r, int c, const auto& x) { store_scaled_piece<Elem>(&sDO(r, c), x, s_do); });
        }
      };
      CUTE_UNROLL
      for (int i = 0; i < kGroup; ++i) load(i);

      // ---- gates, beta and the per-column sums
      if (tid < C) {
        ss.gamma[tid] = p.gamma[p.gamma_strides.at(chunk, hv) + tid * p.gamma_strides.row];
        CUTE_UNROLL
        for (int w = 0; w < W; ++w) ss.col_gamma[w][tid] = ss.col_beta[w][tid] = 0.f;
      } else if (tid < 2 * C) {
        ss.beta[tid - C] = p.beta[p.beta_strides.at(chunk, hv) + (tid - C) * p.beta_strides.row];
      }
      __syncthreads();

      // ---- the operand tiles: q, k, v and dO group by group; then (below) A0, its tile already
      // asked of L2 (prefetch_tile)
      CUTE_UNROLL
      for (int first = 0; first < 4; first += kGroup) {
        if (first > 0) {
          CUTE_UNROLL
          for (int i = first; i < first + kGroup; ++i) load(i);
        }
        CUTE_UNROLL
        for (int i = first; i < first + kGroup; ++i) store(i);
      }
    });
  });
  {
    // A0, T = Gamma A0 diag(b) and T diag(d), all scaled by s_a0
    constexpr int kPerThread = C * C / 4 / T;
    const float4* g4 = reinterpret_cast<const float4*>(p.a0 + tile * C * C);
    float4 x[kPerThread];
    float amax = 0.f;
    CUTE_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      x[j] = __ldg(g4 + tid + T * j);
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(x[j].x), fabsf(x[j].y)), fmaxf(fabsf(x[j].z), fabsf(x[j].w))));
    }
    s_a0 = unit_scale(cta_reduce<true, W>(amax, ss.reduce));
    CUTE_UNROLL
    for (int j = 0; j < kPerThread; ++j) {
      const int idx = tid + T * j, r = idx / (C / 4), c = idx % (C / 4) * 4;
      store4(sA0, r, c, x[j], s_a0);
      const float4 tm = make_float4(decay(r, c) * x[j].x * bet[c], decay(r, c + 1) * x[j].y * bet[c + 1],
                                    decay(r, c + 2) * x[j].z * bet[c + 2], decay(r, c + 3) * x[j].w * bet[c + 3]);
      store4(sT, r, c, tm, s_a0);
      store4(sTd, r, c,
             make_float4(tm.x * __expf(gam[c]), tm.y * __expf(gam[c + 1]), tm.z * __expf(gam[c + 2]),
                         tm.w * __expf(gam[c + 3])),
             s_a0);
    }
  }
  const float gamma_last = gam[C - 1];
  stage_copy<C, V, T>(sVn, p.vn + tile * C * V);
  stage_copy<C, V, T>(sDVn, p.dvn + tile * C * V);
  {
    // S_c and dS_{c+1}, and their inner product (d x u units) for the gradient of e^{gamma_C}
    constexpr int kPerThread = K * V / 8 / T;
    const uint4* s16 = reinterpret_cast<const uint4*>(p.state + tile * K * V);
    const uint4* d16 = reinterpret_cast<const uint4*>(p.dstate + tile * K * V);
    float dot = 0.f;
    // eight iterations unrolled: sixteen 16-byte loads a thread issued before the first is used
#pragma unroll 8
    for (int j = 0; j < kPerThread; ++j) {
      const int idx = tid + T * j, r = idx / (V / 8), c = idx % (V / 8) * 8;
      const uint4 a = __ldg(s16 + idx), b = __ldg(d16 + idx);
      dot += dot8<Elem>(a, b);
      store8(sS, r, c, a);
      store8(sDS, r, c, b);
    }
    dot = cta_reduce<false, W>(dot, ss.reduce);
    if (tid == 0) ss.tail = __expf(gamma_last) * dot;  // the df terms are added in step 7
  }
  operands_ready();
  if (next >= 0) prefetch_tile(p, next);

  float row_g[2] = {0.f, 0.f}, row_b[2] = {0.f, 0.f};  // this thread's two rows' sums, its columns'
  // every (64, NC) accumulator's coordinates are the same, so are every (64, NK) one's
  Tensor crdC = acc_coords<typename Cfg::MmaTokTokV, NC>(cc0);
  Tensor crdK = acc_coords<typename Cfg::MmaTokKV, NK>(ck0);
  const AccTileOffsets<C> atC(crdC);
  const AccTileOffsets<C> atK(crdK);

  // ---- 1. dP = dO Vn^T, dQK = dP * Gamma; QK; E's dP * QK * Gamma terms
  {
    auto accP = make_acc<typename Cfg::MmaTokTokV, NC>();
    gemm_ss<typename Cfg::MmaTokTokV>(sDO, sVnB, accP, true);
    CUTE_UNROLL
    for (int e = 0; e < size(accP); ++e) accP(e) *= decay(get<0>(crdC(e)), get<1>(crdC(e)));
    auto accQK = make_acc<typename Cfg::MmaTokTokK, NC>();
    gemm_ss<typename Cfg::MmaTokTokK>(sQ, sKB, accQK, true);
    const float inv_qk = 1.f / (s_q * s_k);
    auto e1 = [&](int e) { return accP(e) * accQK(e) * inv_qk; };
    add_row_sums(crdC, e1, row_g);
    add_col_sums(crdC, e1, ss.col_gamma);
    store_tile<C>(accP, crdC, ss.dqk.data());
  }

  // ---- 2. dq = diag(d) dO S^T + dQK K, and d * rowsum(dQd * Q); 3. dw = -dVn S^T (the state's
  // last readers, before the barrier that makes dQK and dw whole)
  auto accQ = make_acc<typename Cfg::MmaTokKV, NK>();
  gemm_ss<typename Cfg::MmaTokKV>(sDO, sSB, accQ, true);
  {
    const float inv_q = 1.f / s_q;
    add_row_sums(crdK, [&](int e) {
      const int r = get<0>(crdK(e));
      return __expf(gam[r]) * accQ(e) * (float(ss.q[atK(r, get<1>(crdK(e)))]) * inv_q);
    }, row_g);
    CUTE_UNROLL
    for (int e = 0; e < size(accQ); ++e) accQ(e) *= __expf(gam[get<0>(crdK(e))]) * s_k;
  }
  {
    auto accW = make_acc<typename Cfg::MmaTokKV, NK>();
    gemm_ss<typename Cfg::MmaTokKV>(sDVn, sSB, accW, true);
    scale_acc(accW, -1.f);
    store_tile<C>(accW, crdK, ss.dw.data());
  }
  operands_ready();  // dQK, dw
  gemm_ss<typename Cfg::MmaTokKTok>(sDQK, sKtB, accQ, false);
  store_global(accQ, crdK, p.dq + p.dq_strides.at(chunk, hq), p.dq_strides.row, inv_du / s_k, later_head);

  // ---- 4. dT = (dw K^T) diag(d) + dVn V^T; dA = dT diag(b); dbeta's and E's dA terms; X = dA * Gamma
  {
    auto accT = make_acc<typename Cfg::MmaTokTokK, NC>();
    gemm_ss<typename Cfg::MmaTokTokK>(sDW, sKB, accT, true);
    // to the scale of dVn (s_v V)^T, which is s_v / unit_u times the d x u units
    const float to_v = s_v / (unit_u * s_k);
    CUTE_UNROLL
    for (int e = 0; e < size(accT); ++e) accT(e) *= __expf(gam[get<1>(crdC(e))]) * to_v;
    gemm_ss<typename Cfg::MmaTokTokV>(sDVn, sVB, accT, false);
    scale_acc(accT, unit_u / s_v);
    const float inv_a0 = 1.f / s_a0;
    // A = Gamma * A0 at each element; E's term dA * A0 * Gamma = dA * A
    auto a_at = [&](int e) {
      const int r = get<0>(crdC(e)), c = get<1>(crdC(e));
      return decay(r, c) * float(ss.a0[atC(r, c)]) * inv_a0;
    };
    add_col_sums(crdC, [&](int e) { return accT(e) * a_at(e); }, ss.col_beta);
    auto e2 = [&](int e) { return accT(e) * bet[get<1>(crdC(e))] * a_at(e); };
    add_row_sums(crdC, e2, row_g);
    add_col_sums(crdC, e2, ss.col_gamma);
    CUTE_UNROLL
    for (int e = 0; e < size(accT); ++e) {
      const int r = get<0>(crdC(e)), c = get<1>(crdC(e));
      accT(e) *= bet[c] * decay(r, c);
    }
    // X^T into the state's tile: every thread's dw GEMM read the state before the barrier above
    store_tile_transposed<C>(accT, crdC, ss.xt());
  }

  // ---- 5. dv = T^T dVn
  {
    Tensor crdV = acc_coords<typename Cfg::MmaTokVTokT, NV>(cv0);
    auto accV = make_acc<typename Cfg::MmaTokVTokT, NV>();
    gemm_ss<typename Cfg::MmaTokVTokT>(sTt, sDVntB, accV, true);
    store_global(accV, crdV, p.dv + p.dv_strides.at(chunk, hv), p.dv_strides.row, 1.f / (s_a0 * unit_d));
  }
  // K K^T for dbeta's rowsum(dL * KK) in step 6
  auto accKK = make_acc<typename Cfg::MmaTokTokK, NC>();
  gemm_ss<typename Cfg::MmaTokTokK>(sK, sKB, accKK, true);
  operands_ready();  // X^T

  // ---- 6. dL = strictly_lower(-A0^T X A0^T), dbeta's rowsum(dL * KK), dLb = diag(b) dL
  {
    auto accY = make_acc<typename Cfg::MmaTokTokTokT, NC>();
    gemm_ss<typename Cfg::MmaTokTokTokT>(sA0t, sXtB, accY, true);
    scale_acc(accY, 1.f / s_a0);
    store_tile<C>(accY, crdC, ss.y());
  }
  operands_ready();  // Y
  {
    auto accL = make_acc<typename Cfg::MmaTokTokTok, NC>();
    gemm_ss<typename Cfg::MmaTokTokTok>(sY, sA0B, accL, true);
    const float neg_inv_a0 = -1.f / s_a0;
    CUTE_UNROLL
    for (int e = 0; e < size(accL); ++e)
      accL(e) = get<0>(crdC(e)) > get<1>(crdC(e)) ? neg_inv_a0 * accL(e) : 0.f;
    const float inv_kk = 1.f / (s_k * s_k);
    add_row_sums(crdC, [&](int e) { return accL(e) * accKK(e) * inv_kk; }, row_b);
    CUTE_UNROLL
    for (int e = 0; e < size(accL); ++e) accL(e) *= bet[get<0>(crdC(e))];
    store_tile<C>(accL, crdC, ss.dlb());
  }

  // ---- 7. dk = diag(f) dKd + diag(d) dKdd + dLb K + dLb^T K + dQK^T Q; the dgamma terms of dKd, dKdd
  {
    auto accK = make_acc<typename Cfg::MmaTokKV, NK>();
    gemm_ss<typename Cfg::MmaTokKV>(sVn, sDSB, accK, true);
    CUTE_UNROLL
    for (int e = 0; e < size(accK); ++e) accK(e) *= __expf(gamma_last - gam[get<0>(crdK(e))]);
    const float inv_k = 1.f / s_k;
    auto times_k = [&](int e) { return accK(e) * (float(ss.k[atK(get<0>(crdK(e)), get<1>(crdK(e)))]) * inv_k); };
    float df[2] = {0.f, 0.f};
    add_row_sums(crdK, times_k, df);
    scale_acc(accK, s_a0);
    gemm_ss<typename Cfg::MmaTokKTokT>(sTdt, sDWtB, accK, false);
    scale_acc(accK, 1.f / s_a0);
    // rowsum(acc * K) is now df + d * rowsum(dKdd * K); dgamma takes d * rowsum(dKdd * K) - df
    float both[2] = {0.f, 0.f};
    add_row_sums(crdK, times_k, both);
    CUTE_UNROLL
    for (int s = 0; s < 2; ++s) row_g[s] += both[s] - 2.f * df[s];
    // every lane of a quad holds its rows' df over the group's columns: one lane a quad counts them
    const float df_sum = cta_reduce<false, W>(tid % 4 == 0 ? df[0] + df[1] : 0.f, ss.reduce);
    if (tid == 0) ss.tail += df_sum;
    scale_acc(accK, s_k);
    operands_ready();  // dLb
    gemm_ss<typename Cfg::MmaTokKTok>(sDLb, sKtB, accK, false);
    gemm_ss<typename Cfg::MmaTokKTokT>(sDLbt, sKtB, accK, false);
    scale_acc(accK, s_q / s_k);
    gemm_ss<typename Cfg::MmaTokKTokT>(sDQKt, sQtB, accK, false);
    store_global(accK, crdK, p.dk + p.dk_strides.at(chunk, hq), p.dk_strides.row, inv_du / s_q, later_head);
  }

  // ---- 8. dbeta, and dg: the reverse cumulative sum of dgamma
  if (tid % 4 == 0) {
    const int r0 = get<0>(crdC(0));
    ss.row_gamma[group][r0] = row_g[0];
    ss.row_gamma[group][r0 + 8] = row_g[1];
    ss.row_beta[group][r0] = row_b[0];
    ss.row_beta[group][r0 + 8] = row_b[1];
  }
  __syncthreads();
  auto col_sum = [](const float (*col)[kChunk], int c) {
    float x = (col[0][c] + col[1][c]) + (col[2][c] + col[3][c]);
    if constexpr (W == 8) x += (col[4][c] + col[5][c]) + (col[6][c] + col[7][c]);
    return x;
  };
  auto row_sum = [](const float (*row)[kChunk], int r) {
    float x = row[0][r];
    CUTE_UNROLL
    for (int g = 1; g < Cfg::Groups; ++g) x += row[g][r];
    return x;
  };
  if (tid < C) p.dbeta[p.dbeta_strides.at(chunk, hv) + tid * p.dbeta_strides.row] = (row_sum(ss.row_beta, tid) + col_sum(ss.col_beta, tid)) * inv_du;
  if (tid == 0) {
    float run = 0.f;
    for (int i = C - 1; i >= 0; --i) {
      run += row_sum(ss.row_gamma, i) - col_sum(ss.col_gamma, i) + (i == C - 1 ? ss.tail : 0.f);
      p.dg[p.dg_strides.at(chunk, hv) + i * p.dg_strides.row] = run * inv_du;
    }
  }
}

// Grid: x = chunk * Hqk + q/k head (one CTA an item: its v-heads' tiles, chunk * Hv + v-head, in
// order), or with Cfg::Walk at most one CTA per SM, each walking items blockIdx.x, blockIdx.x +
// gridDim.x, ... Block: Cfg::Threads threads.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::Threads, 1)
    gdn_bwd_chunk_kernel(CUTE_GRID_CONSTANT const ChunkGradParams<Cfg> p) {
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const int group = p.num_heads / p.num_qk_heads;
  const int64_t items = p.num_chunks * p.num_qk_heads;
  const int64_t step = Cfg::Walk ? int64_t(gridDim.x) : items;  // without Walk: one item a CTA
  int64_t item = blockIdx.x;
  if (item < items) prefetch_tile(p, item * group);
  for (; item < items; item += step) {
    for (int j = 0; j < group; ++j) {
      const int64_t tile = item * group + j;
      const int64_t next = j + 1 < group ? tile + 1 : (item + step < items ? (item + step) * group : -1);
      chunk_tile(p, ss, tile, next);
      __syncthreads();  // the tile's last shared-memory readers, before the next tile's writers
    }
  }
}

}  // namespace fqt
