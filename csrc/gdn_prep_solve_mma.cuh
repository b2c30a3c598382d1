// The prep's A0 solve for one v-head on 64 threads (with several v-heads per item, the 128-thread
// prep runs it for each in turn), by 16 x 16 blocks:
//   M = I + L, L[i][j] = b_i (k_i . k_j) for i > j (K K^T's lower triangle, scaled per row), X = M^-1.
//   stage 0  the four diagonal blocks X_aa by substitution, one column per thread (16 steps);
//   stage 1  X_10 = -X_11 (L_10 X_00) and X_32 = -X_33 (L_32 X_22), one warp each;
//   stage 2  X_HL = -X_HH (L_HL X_LL) for the 32 x 32 halves, one warp per 16 rows.
// Stages 1 and 2 run on the tensor cores (mma.sync m16n8k8 TF32), each product as three TF32
// products of high and low parts, so X keeps nearly fp32 accuracy. They are computed transposed
// (X_ab^T = -(X_bb^T L_ab^T) X_aa^T): X^T is what shared memory holds row-major, and the first
// product's accumulators serve as the second's A operand without shuffles, by taking the k index
// in the order the accumulator fragment holds it (a product does not depend on the order of k).
// X (unit lower triangular) goes into K K^T's upper triangle, X[i][j] at kk[j * Pad + i], or with
// solve_into into a tile of its own at the same positions; L reads only K K^T's lower triangle.
// Each stage writes blocks that no thread of the same stage reads.
#pragma once
#include <stdint.h>

namespace fqt {
namespace solve_mma {

// A TF32 operand by truncation: x with its low 13 mantissa bits cleared is a valid tf32, one LOP3.
// Rounding with cvt.rna.tf32.f32 instead costs about five SASS instructions each on sm_90a (a
// range test, an add, a mask and selects). Truncating both 3xTF32 parts leaves the products about
// 3 * 2^-20 relative error instead of about 3 * 2^-22, far below Aw's bf16 rounding; the oracle's
// error is unchanged (measurements: docs/kernel-notes.md).
__device__ __forceinline__ uint32_t tf32(float x) { return __float_as_uint(x) & 0xffffe000u; }

// d += a b for one m16n8k8 tile. Fragments (PTX ISA, lane = 4 g + q):
//   a: (g, q), (g + 8, q), (g, q + 4), (g + 8, q + 4);  b: (q, g), (q + 4, g)
//   d: (g, 2q), (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1)
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b in 3xTF32: a_lo b_hi + a_hi b_lo + a_hi b_hi (the small terms first).
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    ah[e] = tf32(a[e]);
    al[e] = tf32(a[e] - __uint_as_float(ah[e]));
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    bh[e] = tf32(b[e]);
    bl[e] = tf32(b[e] - __uint_as_float(bh[e]));
  }
  mma_tf32(d, al, bh);
  mma_tf32(d, ah, bl);
  mma_tf32(d, ah, bh);
}

template <int Pad>
struct Tiles {
  const float* kk;    // K K^T, fp32, rows of Pad floats; the solve reads its lower triangle
  float* xt;          // where X goes: X[i][j] at xt[j * Pad + i] for i > j. K K^T's own upper
                      // triangle (xt == kk), or a tile of its own when several heads solve at once
  const float* beta;  // b of the v-head, 64 rows (0 past the sequence end)
  // L[i][j], i > j
  __device__ __forceinline__ float l(int i, int j) const { return beta[i] * kk[i * Pad + j]; }
  // X[i][j]: stored below the diagonal, 1 on it, 0 above
  __device__ __forceinline__ float x(int i, int j) const {
    return i > j ? xt[j * Pad + i] : (i == j ? 1.f : 0.f);
  }
  __device__ __forceinline__ void set_x(int i, int j, float v) const { xt[j * Pad + i] = v; }
};

// Stage 0: thread t (0..63) solves column c = t % 16 of diagonal block a = t / 16.
template <int Pad>
__device__ __forceinline__ void diagonal_blocks(const Tiles<Pad>& s, int t) {
  const int a0 = (t / 16) * 16, c = t % 16;
  float x[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const float* row = s.kk + (a0 + r) * Pad + a0;
    float part[2] = {0.f, 0.f};
#pragma unroll
    for (int m = 0; m < r; ++m) part[m & 1] = fmaf(row[m], x[m], part[m & 1]);
    x[r] = r < c ? 0.f : (r == c ? 1.f : -s.beta[a0 + r] * (part[0] + part[1]));
  }
#pragma unroll
  for (int r = 1; r < 16; ++r)
    if (r > c) s.set_x(a0 + r, a0 + c, x[r]);
}

// X_ab^T = -(X_bb^T L_ab^T) X_aa^T for rows [ra, ra + 16 M) and columns [cb, cb + 16 M) of X, computed
// by one warp for its 16 rows [cb + 16 w, ...) of X_ab^T (w: this warp's row tile, M = 1 or 2 row
// tiles in the block). T^T = X_bb^T L_ab^T is (16 x 16 M), kept in accumulators; then
// X_ab^T rows = -T^T X_aa^T.
template <int Pad, int M>
__device__ __forceinline__ void offdiagonal_block(const Tiles<Pad>& s, int ra, int cb, int w, int lane) {
  constexpr int N = 2 * M;  // 8-wide tiles across the 16 M columns
  const int g = lane / 4, q = lane % 4;
  const int i0 = cb + 16 * w;  // this warp's rows of X_ab^T are columns i0.. of X
  // T^T[i][n] = sum_k X_bb^T[i][k] L_ab^T[k][n] = sum_k X[cb + k][i] L[ra + n][cb + k]
  float tt[N][4] = {};
#pragma unroll
  for (int ks = 0; ks < N; ++ks) {
    if (8 * ks + 7 < 16 * w) continue;  // X[cb + k][i0 + ..] = 0 for k < i: warp-uniform skip
    const int k = cb + 8 * ks + q;
    const float a[4] = {s.x(k, i0 + g), s.x(k, i0 + g + 8), s.x(k + 4, i0 + g), s.x(k + 4, i0 + g + 8)};
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float b[2] = {s.l(ra + 8 * n + g, k), s.l(ra + 8 * n + g, k + 4)};
      mma_3xtf32(tt[n], a, b);
    }
  }
  // X_ab^T[i][n] = -sum_k T^T[i][k] X_aa^T[k][n] = -sum_k T^T[i][k] X[ra + n][ra + k]. The k of
  // step ks are the columns of accumulator tile ks, in its order: fragment column q of the A
  // operand is k = 8 ks + 2 q, column q + 4 is k = 8 ks + 2 q + 1; the B operand follows.
  float out[N][4] = {};
#pragma unroll
  for (int ks = 0; ks < N; ++ks) {
    const float a[4] = {tt[ks][0], tt[ks][2], tt[ks][1], tt[ks][3]};
    const int k = ra + 8 * ks + 2 * q;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      if (n < ks) continue;  // X[ra + n'][ra + k] = 0 for n' < k
      const float b[2] = {s.x(ra + 8 * n + g, k), s.x(ra + 8 * n + g, k + 1)};
      mma_3xtf32(out[n], a, b);
    }
  }
  // out[n] holds X_ab^T[i][n'] at (g, 2q), (g, 2q + 1), (g + 8, 2q), (g + 8, 2q + 1) of tile n:
  // X[ra + n'][i0 + i] = -out.
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s.set_x(ra + 8 * n + 2 * q + (e & 1), i0 + g + 8 * (e >> 1), -out[n][e]);
}

__device__ __forceinline__ void sync64() { asm volatile("bar.sync 1, 64;" ::: "memory"); }

// The whole solve on the 64 threads t = 0..63 (two warps) that `sync` (a barrier of exactly them)
// waits for, with X into s.xt.
template <int Pad, class Sync>
__device__ __forceinline__ void solve_tiles(const Tiles<Pad>& s, int t, Sync&& sync) {
  const int w = t / 32, lane = t % 32;
  diagonal_blocks(s, t);
  sync();
  offdiagonal_block<Pad, 1>(s, 16 + 32 * w, 32 * w, 0, lane);  // warp 0: X_10, warp 1: X_32
  sync();
  offdiagonal_block<Pad, 2>(s, 32, 0, w, lane);  // X_HL, 16 of its columns per warp
  sync();
}

// On threads 0..63 with X into K K^T's upper triangle; the caller's other threads must not use
// barrier 1.
template <int Pad>
__device__ __forceinline__ void solve(float* kk, const float* beta, int t) {
  solve_tiles(Tiles<Pad>{kk, kk, beta}, t, [] { sync64(); });
}

// One of several solves at once, each on its own 64 threads (t = 0..63 within them) with its own
// named barrier `bar` and its own X tile `xt` (which may be K K^T itself for one of them: each
// writes only its X tile's upper triangle and reads only K K^T's lower one).
template <int Pad>
__device__ __forceinline__ void solve_into(const float* kk, float* xt, const float* beta, int t, int bar) {
  solve_tiles(Tiles<Pad>{kk, xt, beta}, t, [bar] { asm volatile("bar.sync %0, 64;" ::"r"(bar) : "memory"); });
}

}  // namespace solve_mma
}  // namespace fqt
