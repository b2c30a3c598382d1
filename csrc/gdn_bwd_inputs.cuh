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

// The 16-byte piece at g (16-byte aligned) as fp32 values.
template <class In>
__device__ __forceinline__ void load_piece(const In* g, float (&x)[kPieceElems<In>]) {
  const uint4 word = __ldg(reinterpret_cast<const uint4*>(g));
  In e[kPieceElems<In>];
  memcpy(e, &word, sizeof(word));
  #pragma unroll
  for (int i = 0; i < kPieceElems<In>; ++i) x[i] = float(e[i]);
}

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
