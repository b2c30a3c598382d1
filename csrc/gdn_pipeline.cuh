// Shared-memory pipelines on mbarriers: a ring of Stages buffers that a producer fills and
// consumers drain, shared by the forward kernel (its TMA stages and the output warp group's
// handoff), the prep kernel (its q/k tiles) and the CP chain kernel (its double-buffered M). The
// producer side of a ring that TMA fills is TmaProducer (gdn_tma_producer.cuh).
//
// Iteration n of a ring uses buffer n % Stages; each buffer's barriers complete once per round of
// the ring, so iteration n waits for the phase of parity (n / Stages) & 1. PipelineState (and
// PairState, for a two-buffer ring walked without an iteration count) is where that arithmetic
// lives (SingleState for a one-buffer ring that keeps only the phase bit); the pipeline's producer
// and consumer operations take one. A full barrier counts the producer's arrivals (and, with
// transactions, the bytes its bulk copies deliver); an empty barrier counts the consumers'
// arrivals. A ring whose consumers release buffers by a CTA-wide barrier instead has no empty
// barriers (ConsumerRelease::kCtaBarrier).
#pragma once
#include <stdint.h>

#include <type_traits>

#include <cutlass/arch/barrier.h>

#include "gdn_grid_sync.cuh"  // mbarrier_wait

namespace fqt {

// Iteration `count` of a ring of Stages buffers: which buffer, and which phase of its barriers.
// For loops that number their iterations (the state is the loop counter).
template <int Stages_>
struct PipelineState {
  static constexpr int Stages = Stages_;
  int count;
  __device__ __forceinline__ int index() const { return count % Stages; }
  __device__ __forceinline__ uint32_t phase() const { return (count / Stages) & 1; }
  // The first round: no consumer has released this buffer yet, so the producer need not wait.
  __device__ __forceinline__ bool first_round() const { return count < Stages; }
  __device__ __forceinline__ PipelineState next() const { return PipelineState{count + 1}; }
};

// The same for a ring of two buffers used in turn by a loop that does not number its steps (the
// CP chain walks only the exact boundaries): the buffer, and one phase bit per buffer.
struct PairState {
  static constexpr int Stages = 2;
  int buffer;
  uint32_t phases;  // bit b: the parity of buffer b's next phase
  __device__ __forceinline__ int index() const { return buffer; }
  __device__ __forceinline__ uint32_t phase() const { return (phases >> buffer) & 1u; }
  __device__ __forceinline__ PairState next() const { return PairState{buffer ^ 1, phases ^ (1u << buffer)}; }
};

// A ring of one buffer whose loop keeps only the phase bit, flipping it every round (the prep's
// q/k tiles, loaded once per work item).
struct SingleState {
  static constexpr int Stages = 1;
  uint32_t bit;  // the parity of the buffer's next phase
  __device__ __forceinline__ int index() const { return 0; }
  __device__ __forceinline__ uint32_t phase() const { return bit; }
};

enum class ConsumerRelease { kEmptyBarrier, kCtaBarrier };

// The barriers of a ring in shared memory: full[] then empty[] (the members' order is the layout).
template <int Stages, bool HasEmpty>
struct RingBarriers {
  uint64_t full[Stages];
  uint64_t empty[Stages];
};
template <int Stages>
struct RingBarriers<Stages, false> {
  uint64_t full[Stages];
};

template <int Stages_, bool Transactions, ConsumerRelease Release = ConsumerRelease::kEmptyBarrier>
struct MbarrierPipeline {
  static constexpr int Stages = Stages_;
  static constexpr bool HasEmpty = Release == ConsumerRelease::kEmptyBarrier;
  using State = PipelineState<Stages>;  // or PairState for two stages
  using FullBarrier =
      std::conditional_t<Transactions, cutlass::arch::ClusterTransactionBarrier, cutlass::arch::ClusterBarrier>;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  using Storage = RingBarriers<Stages, HasEmpty>;

  uint64_t* full;
  uint64_t* empty;  // null without empty barriers

  __device__ __forceinline__ explicit MbarrierPipeline(Storage& s) : full(s.full), empty(empty_of(s)) {}

  // By one thread, before a fence_barrier_init and a CTA-wide barrier.
  static __device__ __forceinline__ void init(Storage& s, int producer_arrivals, int consumer_arrivals = 0) {
    for (int i = 0; i < Stages; ++i) {
      FullBarrier::init(&s.full[i], producer_arrivals);
      if constexpr (HasEmpty) EmptyBarrier::init(&s.empty[i], consumer_arrivals);
    }
  }

  // Producer: wait until the consumers have released the buffer of `st` (from the second round on).
  template <class St = State>
  __device__ __forceinline__ void producer_acquire(St st) const {
    static_assert(HasEmpty, "a ring released by a CTA-wide barrier has no empty barriers to wait on");
    if (!st.first_round()) mbarrier_wait(&empty[st.index()], st.phase() ^ 1);
  }
  // Producer: arrive on the full barrier, expecting `bytes` more from bulk copies that complete on it.
  template <class St = State>
  __device__ __forceinline__ void producer_expect(St st, uint32_t bytes) const {
    static_assert(Transactions, "only a transaction barrier counts bytes");
    FullBarrier::arrive_and_expect_tx(&full[st.index()], bytes);
  }
  // Producer: arrive on the full barrier (a ring without transactions: the data is in place).
  template <class St = State>
  __device__ __forceinline__ void producer_commit(St st) const { FullBarrier::arrive(&full[st.index()]); }
  // The barrier that the bulk copies of `st` complete on.
  template <class St = State>
  __device__ __forceinline__ uint64_t& full_barrier(St st) const { return full[st.index()]; }

  // Consumer: wait until the buffer of `st` is full.
  template <class St = State>
  __device__ __forceinline__ void consumer_wait(St st) const { mbarrier_wait(&full[st.index()], st.phase()); }
  // Consumer: release the buffer of `st` to the producer.
  template <class St = State>
  __device__ __forceinline__ void consumer_release(St st) const {
    static_assert(HasEmpty, "a ring released by a CTA-wide barrier has no empty barriers");
    EmptyBarrier::arrive(&empty[st.index()]);
  }

 private:
  static __device__ __forceinline__ uint64_t* empty_of(Storage& s) {
    if constexpr (HasEmpty) return s.empty;
    else return nullptr;
  }
};

}  // namespace fqt
