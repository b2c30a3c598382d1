// The producer side of a transaction ring (an MbarrierPipeline that counts bytes): one thread waits
// for a buffer to be free, announces the bytes the buffer's loads will deliver on its full barrier,
// then issues those loads, TMA tile copies and 1-D bulk copies, each completing on that barrier.
// The forward kernel's stage ring (q, k, v, Aw, P tiles and the gates), the prep's q/k tiles and the
// CP chain's M buffers are all filled through it.
#pragma once
#include <stdint.h>

#include <cute/arch/copy_sm90_tma.hpp>  // SM90_BULK_COPY_G2S
#include <cute/tensor.hpp>              // tma_partition, copy

#include "gdn_pipeline.cuh"

namespace fqt {

template <class Pipeline_>
struct TmaProducer {
  using Pipeline = Pipeline_;
  using Storage = typename Pipeline::Storage;
  Pipeline pipe;

  __device__ __forceinline__ explicit TmaProducer(Storage& s) : pipe(s) {}

  // Wait until the consumers have released the buffer of `st` (from the ring's second round on).
  template <class St>
  __device__ __forceinline__ void acquire(St st) const { pipe.producer_acquire(st); }
  // The buffer of `st` receives `bytes` from the loads issued next.
  template <class St>
  __device__ __forceinline__ void expect(St st, uint32_t bytes) const { pipe.producer_expect(st, bytes); }
  // TMA tile copy of `gsrc` (a tile of the descriptor's tensor) into `sdst`, both (rows, cols).
  template <class St, class Tma, class GSrc, class SDst>
  __device__ __forceinline__ void tile(St st, const Tma& tma, GSrc gsrc, SDst sdst) const {
    using namespace cute;
    auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdst), group_modes<0, 2>(gsrc));
    copy(tma.with(pipe.full_barrier(st)), tg, ts);
  }
  // Contiguous bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned).
  template <class St>
  __device__ __forceinline__ void bulk(St st, const void* src, void* dst, uint32_t bytes) const {
    cute::SM90_BULK_COPY_G2S::copy(src, &pipe.full_barrier(st), dst, int32_t(bytes));
  }
};

}  // namespace fqt
