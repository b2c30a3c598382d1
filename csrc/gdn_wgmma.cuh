// Small helpers around Hopper wgmma (CuTe SM90 GMMA) and accumulator stores, shared by the kernels.
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <stdint.h>
#include <string.h>

#include <cute/tensor.hpp>

namespace fqt {

using namespace cute;

// Two adjacent elements as one 32-bit word (accumulator values e, e+1 are neighbouring columns).
template <class Elem>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  Elem pair[2] = {Elem(a), Elem(b)};
  uint32_t word;
  memcpy(&word, pair, sizeof(word));
  return word;
}

template <class Tensor_>
__device__ __forceinline__ uint32_t* word_at(Tensor_& t, int e) {
  return reinterpret_cast<uint32_t*>(&t(e));
}

// D (+)= A B over every k-block of the operands' shared-memory descriptors.
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_gemm(Mma& mma, const TA& tA, const TB& tB, TC& acc, bool zero_init) {
  mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tA); ++kb) {
    cute::gemm(mma, tA(_, _, kb), tB(_, _, kb), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

}  // namespace fqt
