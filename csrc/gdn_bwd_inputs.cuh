// The backward kernels' inputs as the call holds them: fp32, fp16 or bf16 rows, read in place in
// 16-byte pieces and widened to fp32 in registers. The kernels scale every input tile by a power of
// two of their own and round it to their 16-bit operand type, so reading the call's 16-bit rows
// instead of an fp32 copy of them gives the same operands: widening is exact, and the fp32 copy
// held the same values.
//
// The type is a launch argument (InputDtype), not a template parameter, so that one library serves
// fp32, fp16 and bf16 calls; with_input_type turns it into the element type of a generic lambda.
#pragma once
#include <stdint.h>
#include <string.h>

#include <cutlass/numeric_types.h>

namespace fqt {

// The element type of an input that the backward reads in place (the host checks the code).
enum InputDtype : int32_t { kInputF32 = 0, kInputF16 = 1, kInputBF16 = 2 };

__host__ __device__ __forceinline__ bool valid_input_dtype(int32_t code) {
  return code == kInputF32 || code == kInputF16 || code == kInputBF16;
}

// Calls f(In{}) with In the element type that `code` names (fp32 for any other code: the host has
// refused those).
template <class F>
__device__ __forceinline__ void with_input_type(int32_t code, F&& f) {
  if (code == kInputF16) {
    f(cutlass::half_t{});
  } else if (code == kInputBF16) {
    f(cutlass::bfloat16_t{});
  } else {
    f(float{});
  }
}

// The elements of In in one 16-byte piece: 4 fp32 or 8 16-bit values.
template <class In>
inline constexpr int kPieceElems = 16 / int(sizeof(In));

// A 16-byte piece of In as fp32 values.
template <class In>
__device__ __forceinline__ void widen(const uint4& word, float (&x)[kPieceElems<In>]) {
  In e[kPieceElems<In>];
  memcpy(e, &word, sizeof(word));
  #pragma unroll
  for (int i = 0; i < kPieceElems<In>; ++i) x[i] = float(e[i]);
}

// This thread's share of an [R, C] tile of In (rows `row_stride` elements apart, 16-byte pieces:
// the host checks strides and base), as the raw 16-byte pieces: load() issues every read at once
// and nothing waits for them until a piece is used, so a tile's (and several tiles') DRAM reads
// are in flight together; the raw pieces take half the registers of the fp32 values of a 16-bit
// tile. Piece j is element (row(j), col(j)) .. + N - 1.
template <int R, int C, int Threads, class In>
struct TilePieces {
  static constexpr int N = kPieceElems<In>, kPieces = R * C / N / Threads;
  static_assert(kPieces * N * Threads == R * C, "a tile is whole 16-byte pieces of the threads");
  uint4 raw[kPieces];

  __device__ __forceinline__ static int row(int j) { return (int(threadIdx.x) + Threads * j) / (C / N); }
  __device__ __forceinline__ static int col(int j) { return (int(threadIdx.x) + Threads * j) % (C / N) * N; }

  __device__ __forceinline__ void load(const In* g, int64_t row_stride) {
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) raw[j] = __ldg(reinterpret_cast<const uint4*>(g + row(j) * row_stride + col(j)));
  }
  // The largest |x| of this thread's pieces (fmaxf: a NaN is not seen here, it flows on in the
  // values themselves).
  __device__ __forceinline__ float amax() const {
    float m = 0.f;
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      float x[N];
      widen<In>(raw[j], x);
      #pragma unroll
      for (int i = 0; i < N; ++i) m = fmaxf(m, fabsf(x[i]));
    }
    return m;
  }
  // f(row, col, x) for each piece, x its N fp32 values.
  template <class F>
  __device__ __forceinline__ void for_each(F&& f) const {
    #pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      float x[N];
      widen<In>(raw[j], x);
      f(row(j), col(j), x);
    }
  }
};

// n fp32 values times `scale` as n / 2 packed pairs of Elem, written as one 8-byte (n = 4) or
// 16-byte (n = 8) store to dst (aligned to it).
template <class Elem, int N>
__device__ __forceinline__ void store_scaled_piece(void* dst, const float (&x)[N], float scale) {
  static_assert(N == 4 || N == 8, "a piece is four fp32 or eight 16-bit values");
  uint32_t w[N / 2];
  #pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    Elem pair[2] = {Elem(scale * x[2 * i]), Elem(scale * x[2 * i + 1])};
    memcpy(&w[i], pair, sizeof(uint32_t));
  }
  if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace fqt
