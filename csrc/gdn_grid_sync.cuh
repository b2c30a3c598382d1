// Ordering: between the prep kernel and the sequential kernel when they overlap, between the CP
// chain kernel and the forward pass after it, and between an mbarrier or cp.async wait and the
// plain memory accesses it guards.
//
// The sequential kernel is launched as a programmatic dependent of the prep kernel (PDL), so it
// may start while the prep still runs (with CP, the forward pass is the chain kernel's dependent
// the same way: gdn_cp.cuh). Two ways to then read the prep's output safely:
//   - wait_prerequisite_grids(): the whole prep grid has finished and its writes are visible;
//   - per work item, a ready flag the prep publishes with release semantics and the reader
//     acquires before reading that item (what lets the two kernels run side by side).
// A flag read is a generic-proxy load; the TMA loads that follow run in the async proxy, hence the
// proxy fence after the acquire.
#pragma once
#include <stdint.h>

#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/barrier.h>

namespace fqt {

// CUTLASS's mbarrier wait is an asm statement without a memory clobber, so the compiler may move
// plain shared-memory loads and stores above it (wgmma and TMA, being asm themselves, stay put).
// Every wait that guards plain accesses goes through here.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t phase) {
  cutlass::arch::ClusterBarrier::wait(barrier, phase);
  asm volatile("" ::: "memory");
}

// The same for CuTe's wait on this thread's cp.async copies (also an asm without a clobber).
__device__ __forceinline__ void cp_async_wait_all_then_access() {
  cute::cp_async_wait<0>();
  asm volatile("" ::: "memory");
}

// Lets the dependent grid launch once every CTA of this grid has executed it (or exited).
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Blocks until the grids this one depends on have completed and their writes are visible
// (returns at once when the launch was not programmatic).
__device__ __forceinline__ void wait_prerequisite_grids() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Called by one thread after a CTA-wide barrier that follows all of the item's stores.
__device__ __forceinline__ void publish_ready(uint32_t* flag) {
  __threadfence();
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(1u) : "memory");
}

// Spins until the flag is set; afterwards this thread's TMA loads see the published data.
__device__ __forceinline__ void wait_ready(const uint32_t* flag) {
  uint32_t value;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    if (value != 0u) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace fqt
