// Warm-up context parallelism (docs/cp-design.md): long sequences are cut into segments of L
// chunks so that more sequential CTAs run at once. All of it is planned on the device from
// cu_seqlens, the per-length segment table and the per-v-head warm-up table, so a call needs no
// host synchronisation and stays capturable in a CUDA graph.
//
// Per call, around the prep kernel (gdn_fwd_host.cuh launches them in this order):
//   cp_segments_kernel  (before the prep) one CTA: segment counts per sequence (L from the
//                       sequence's own length), their prefix sum, and segment -> (sequence, index).
//                       Only for calls of more than kFusedSegmentSeqs sequences; otherwise each
//                       job row scans the few sequences itself, which costs less than a launch
//                       (the host time of a launch: docs/kernel-notes.md).
//   plan_cp_jobs        run by the prep's CTAs once their items are done (gdn_prep.cuh): it reads
//                       only the call's inputs, and a kernel of its own would cost a launch.
//                       Per (segment, v-head): the forward job of the segment and, at each
//                       boundary, either a warm-up window (n_h chunks from a zero state, kept only
//                       if the guard holds on this input) or, for exact boundaries, the previous
//                       segment's H (end state from zero) and M (transition) jobs.
//   phase 1             the sequential kernel over the H, M and window jobs (state only).
//   cp_chain_kernel     exact boundaries in order: S_j = M_{j-1} S_{j-1} + H_{j-1}, fp32; it lets
//                       its programmatic dependent launch as soon as every chain CTA is resident:
//   phase 3             the sequential kernel over the forward jobs, one launch on the caller's
//                       stream (kUnchainedThenChained): the jobs that start from h0 or a warm-up
//                       state run beside the chain (unsplit sequences first in calls of up to
//                       kFusedSegmentSeqs sequences: plan_segment), those
//                       that start from a chained state wait for it in the kernel
//                       (griddepcontrol.wait). One stream and no events: a side stream would cost
//                       the host two event records and two waits per call.
// A segment's arithmetic depends only on its own sequence (its length picks L, its tokens decide
// the guard), so a sequence's output is the same bit for bit whatever it is batched with.
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <cub/block/block_scan.cuh>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <stdint.h>

#include <type_traits>

#include "gdn_gate_options.cuh"  // GateInputs, GateOptions: the guard reads g and beta as the prep does
#include "gdn_grid_sync.cuh"
#include "gdn_pipeline.cuh"
#include "gdn_segment_policy.h"  // kSegmentBuckets, kMaxSegments, segment_chunks_for, segments_of
#include "gdn_sequences.cuh"
#include "gdn_tma_producer.cuh"  // the chain's M, one bulk copy per step

namespace fqt {

constexpr int kPlanThreads = 1024;
constexpr int kFusedSegmentSeqs = 64;  // up to this many sequences each job row plans the segments itself

struct CpPlanArgs {
  const int64_t* cu_seqlens;
  const int32_t* segment_chunks;  // [kSegmentBuckets]
  const int32_t* warmup;          // [Hv]: n_h >= 1, or -1 (exact)
  const float* g;                 // [T, Hv] as the caller passed it (raw with an in-kernel gate)
  const float* beta;              // [T, Hv] as the caller passed it (raw with an in-kernel sigmoid)
  const void* k;                  // [T, Hqk, K] (the caller's, before any in-kernel norm)
  const float* initial_state;     // [N, Hv, state] or null
  float* final_state;             // [N, Hv, state] or null
  int32_t* seg_seq;               // [S] sequence of segment z, -1 past the last
  int32_t* seg_index;             // [S] index of segment z in its sequence
  int64_t* seq_first;             // [N] first segment of each sequence
  int32_t* seq_count;             // [N] segments of each sequence
  CpJob* jobs_state;              // [3 S, Hv]: H, M, then windows (the long jobs are dispatched first,
                                  // the short windows fill in behind them)
  CpJob* jobs_fwd;                // [S, Hv]
  int32_t* exact;                 // [S, Hv]: 1 if boundary z is chained exactly
  int32_t* fwd_order;             // [S]: the forward pass's unchained CTA z runs job row fwd_order[z]
  float* boundary;                // [S, Hv, state]: the start state of segment z (z not first)
  float* h_end;                   // [S, Hv, state]: H of the segment before boundary z
  float* m_end;                   // [S, Hv, K, K]: M of the segment before boundary z, m-major
  int64_t total_tokens;
  int64_t num_seqs;
  int64_t num_segments;           // S
  float log_eps;
  int32_t use_qk_l2norm;
  int32_t fused_segments;         // 1: no cp_segments_kernel ran; each job row plans (num_seqs <= kFusedSegmentSeqs)
  GateInputs gates;               // A_log and dt_bias of an in-kernel gate (unread with precomputed gates)
};

// Segments sequence i asks for (at least one), at most S.
__device__ __forceinline__ int32_t wanted_segments(const CpPlanArgs& a, int64_t i) {
  const int64_t chunks = sequence_range(a.cu_seqlens, i, a.total_tokens).num_chunks();
  const int64_t want = segments_of(chunks, segment_chunks_for(a.segment_chunks, chunks));
  return int32_t(want < a.num_segments ? want : a.num_segments);
}

// Of the n segments of a sequence whose first is segment `first`, those below S. Overlapping
// (malformed) cu_seqlens can ask for more than S segments: the rest is dropped, so such rows are
// unspecified, never out of bounds.
__device__ __forceinline__ int32_t segments_that_fit(int32_t n, int64_t first, int64_t S) {
  const int64_t room = S - first;
  return int32_t(room <= 0 ? 0 : (n < room ? n : room));
}

__global__ void __launch_bounds__(kPlanThreads) cp_segments_kernel(const CpPlanArgs a) {
  using Scan = cub::BlockScan<int32_t, kPlanThreads>;  // counts fit: S <= kMaxSegments
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < a.num_seqs; base += kPlanThreads) {
    const int64_t i = base + threadIdx.x;
    const int32_t n = i < a.num_seqs ? wanted_segments(a, i) : 0;
    int32_t before;
    Scan(scan).ExclusiveSum(n, before);
    const int64_t first = carry + before;
    if (i < a.num_seqs) {
      a.seq_first[i] = first;
      a.seq_count[i] = segments_that_fit(n, first, a.num_segments);
      for (int64_t j = 0; j < n && first + j < a.num_segments; ++j) {
        a.seg_seq[first + j] = int32_t(i);
        a.seg_index[first + j] = int32_t(j);
      }
    }
    __syncthreads();  // everyone has read carry
    if (threadIdx.x == kPlanThreads - 1) carry = first + n;
    __syncthreads();
  }
  for (int64_t z = carry + threadIdx.x; z < a.num_segments; z += kPlanThreads) a.seg_seq[z] = -1;
}

// The guard over tokens [t0, t1) of v-head hv: the summed log-decay reaches log(eps) and every
// token keeps 0 <= b ||k||^2 <= 2 (so each (I - b k k^T) is a contraction). NaN fails both.
// g and b are the values the chunks use: Gates (gdn_gate_options.cuh) applies the call's in-kernel
// gate and beta options to the inputs exactly as the prep does. With allow_neg_eigval, b is in
// (0, 2), so the bound is checked on b ||k||^2 per token like any other beta: without the in-kernel
// l2norm a token with b ||k||^2 > 2 fails the guard and its boundary is chained exactly; with it the
// chunks use the normalised row rounded to Elem, whose ||k||^2 can exceed sum x^2 / (sum x^2 + eps)
// by the rounding, so the guard takes normed_row_bound<Elem>() times that (a b near 2 then chains
// exactly rather than rely on an expansion the rounding could leave).
// A thread per token: it reads its k row as K / 8 16-byte pieces, all in flight at once, so a
// window of up to Threads tokens costs one round of loads rather than one dependent load per token
// (measurements: docs/kernel-notes.md).
// The sums run in a fixed order (per thread, then an xor tree, then by warp): deterministic.
// An upper bound on ||k||^2 / (sum x^2 / (sum x^2 + 1e-6)) for a row the prep normalises in the
// kernel (gdn_prep.cuh prepare_qk_rows): its elements are rounded to Elem, each by a relative error
// of at most u (2^-8 for bfloat16, 2^-11 for half), and the fp32 sums and rsqrtf add well below 2^-14.
template <class Elem>
constexpr float normed_row_bound() {
  static_assert(std::is_same_v<Elem, cutlass::half_t> || std::is_same_v<Elem, cutlass::bfloat16_t>,
                "q/k rows are half or bfloat16");
  constexpr float u = std::is_same_v<Elem, cutlass::half_t> ? 0x1p-11f : 0x1p-8f;
  return (1.f + u) * (1.f + u) * (1.f + 0x1p-14f);
}

template <class Elem, int Hqk, int Hv, int K, int Threads, class Gates>
__device__ bool window_is_safe(const CpPlanArgs& a, int64_t t0, int64_t t1, int hv) {
  static_assert(sizeof(Elem) == 2 && K % 8 == 0, "a k row is read as 16-byte pieces of eight elements");
  constexpr int kWarps = Threads / 32;
  __shared__ float warp_sums[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hqk = hv / (Hv / Hqk);
  float decay = 0.f;
  bool ok = true;
  for (int64_t t = t0 + threadIdx.x; t < t1; t += Threads) {
    const float b_in = a.beta[t * Hv + hv], g_in = a.g[t * Hv + hv];  // issued first: in flight with k
    // 16-byte aligned: k starts on a 16-byte boundary (runtime.tma_ready) and rows are K * 2 bytes
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const Elem*>(a.k) + (t * Hqk + hqk) * K);
    uint4 pieces[K / 8];
#pragma unroll
    for (int p = 0; p < K / 8; ++p) pieces[p] = __ldg(row + p);
    float sq = 0.f;
#pragma unroll
    for (int p = 0; p < K / 8; ++p) {
      const Elem* e = reinterpret_cast<const Elem*>(&pieces[p]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x = float(e[j]);
        sq = fmaf(x, x, sq);
      }
    }
    float norm2 = a.use_qk_l2norm ? sq / (sq + 1e-6f) : sq;  // the kernel's in-kernel norm
    if constexpr (Gates::NegEigval) {
      if (a.use_qk_l2norm) norm2 *= normed_row_bound<Elem>();  // b up to 2: the rounding matters
    }
    const float bk = Gates::beta(b_in) * norm2;
    ok = ok && bk >= 0.f && bk <= 2.f;
    decay += Gates::gate(g_in, a.gates, hv);
  }
  for (int off = 16; off > 0; off /= 2) decay += __shfl_xor_sync(0xffffffffu, decay, off);
  if (lane == 0) warp_sums[warp] = decay;
  const bool all_ok = __syncthreads_and(ok);
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  return all_ok && total <= a.log_eps;
}

// Segment z of cp_segments_kernel's plan, found by this CTA alone (a.fused_segments: a thread per
// sequence, two scans): its sequence (-1 past the last segment), index, the sequence's segment
// count, and its place in the forward pass's unchained order: the sequences that do not split
// first (in sequence order), then the segments of the others. An unsplit sequence's one job can be
// longer than a segment (the table splits by length bucket), so it should not wait behind the
// segments for an SM. The CTA of row 0 also writes every sequence's first segment and count,
// which the chain reads.
struct SegmentOf {
  int32_t seq, index, count, order;
};
template <int Threads>
__device__ __forceinline__ SegmentOf plan_segment(const CpPlanArgs& a, int64_t z, bool writes_sequences) {
  static_assert(kFusedSegmentSeqs <= Threads, "a thread per sequence");
  // Warp scans: little shared memory, so the 128-thread prep keeps four CTAs per SM
  using Scan = cub::BlockScan<int32_t, Threads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage scan, scan_whole;
  __shared__ SegmentOf found;
  const int64_t i = threadIdx.x;
  const int32_t n = i < a.num_seqs ? wanted_segments(a, i) : 0;
  if (threadIdx.x == 0) found = SegmentOf{-1, 0, 0, 0};
  int32_t first, whole_before, wholes;
  Scan(scan).ExclusiveSum(n, first);
  Scan(scan_whole).ExclusiveSum(n == 1 ? 1 : 0, whole_before, wholes);
  __syncthreads();  // the reset above comes before any thread's find below
  const int32_t count = segments_that_fit(n, first, a.num_segments);
  if (i < a.num_seqs && first <= z && z < first + int64_t(count)) {
    const int32_t index = int32_t(z - first);
    found = SegmentOf{int32_t(i), index, count, n == 1 ? whole_before : wholes + (first - whole_before) + index};
  }
  if (writes_sequences && i < a.num_seqs) {
    a.seq_first[i] = first;
    a.seq_count[i] = count;
  }
  __syncthreads();
  return found;
}

// The jobs of job row `row` = z * Hv + hv (segment z, v-head hv), by all Threads threads of the
// calling CTA; the same for every CTA that calls it, so a CTA may take several rows in turn.
template <class Elem, int Hqk, int Hv, int K, int V, int Threads, class Gates>
__device__ void plan_cp_jobs(const CpPlanArgs& a, int64_t row) {
  static_assert(K == V, "a transition job (S = I) needs K = V");
  constexpr int64_t kState = int64_t(K) * V;
  const int64_t z = row / Hv;
  const int hv = int(row % Hv);
  const int64_t S = a.num_segments;
  CpJob window{}, h_job{}, m_job{}, fwd{};
  bool exact = false;
  SegmentOf seg{-1, 0, 0, 0};
  __syncthreads();  // the CTA's previous row is done with plan_segment's and window_is_safe's scratch
  if (a.fused_segments) {
    seg = plan_segment<Threads>(a, z, row == 0);
  } else if ((seg.seq = a.seg_seq[z]) >= 0) {
    seg.index = a.seg_index[z];
    seg.count = a.seq_count[seg.seq];
  }
  const int32_t i = seg.seq;
  if (i >= 0) {
    const int64_t j = seg.index;
    const SeqRange r = sequence_range(a.cu_seqlens, i, a.total_tokens);
    const int64_t chunks = r.num_chunks();
    const int64_t n = seg.count;
    const int64_t L = n > 1 ? segment_chunks_for(a.segment_chunks, chunks) : chunks;
    const int64_t c0 = j * L;
    const int64_t len = r.len - c0 * kChunk < L * kChunk ? r.len - c0 * kChunk : L * kChunk;
    const float* seq_h0 = a.initial_state ? a.initial_state + (int64_t(i) * Hv + hv) * kState : nullptr;
    fwd = CpJob{r.start + c0 * kChunk, len, r.slot0 + c0, j == 0 ? seq_h0 : a.boundary + row * kState,
                j == n - 1 && a.final_state ? a.final_state + (int64_t(i) * Hv + hv) * kState : nullptr, 0, 0};
    if (j > 0) {
      float* start_state = a.boundary + row * kState;
      const int64_t nh = a.warmup[hv];
      bool warm = false;
      if (nh >= 0 && c0 - nh <= 0) {
        // The window reaches the sequence start: the whole prefix from h0, exact.
        window = CpJob{r.start, c0 * kChunk, r.slot0, seq_h0, start_state, kJobNoOutput, 0};
        warm = true;
      } else if (nh > 0) {
        const int64_t w0 = c0 - nh;
        warm = window_is_safe<Elem, Hqk, Hv, K, Threads, Gates>(a, r.start + w0 * kChunk, r.start + c0 * kChunk,
                                                                hv);
        if (warm) window = CpJob{r.start + w0 * kChunk, nh * kChunk, r.slot0 + w0, nullptr, start_state, kJobNoOutput, 0};
      }
      if (!warm) {  // the previous segment's H and M; the chain kernel combines them
        const int64_t p0 = c0 - L;
        h_job = CpJob{r.start + p0 * kChunk, L * kChunk, r.slot0 + p0, nullptr, a.h_end + row * kState,
                      kJobNoOutput, 0};
        m_job = CpJob{r.start + p0 * kChunk, L * kChunk, r.slot0 + p0, nullptr, a.m_end + row * int64_t(K) * K,
                      kJobIdentityState | kJobZeroV | kJobNoOutput, 0};
        exact = true;
        fwd.flags |= kJobChained;
      }
    }
  }
  if (threadIdx.x == 0) {
    a.jobs_state[row] = h_job;
    a.jobs_state[S * Hv + row] = m_job;
    a.jobs_state[2 * S * Hv + row] = window;
    a.jobs_fwd[row] = fwd;
    a.exact[row] = exact ? 1 : 0;
    if (hv == 0) {  // unused segments, and calls planned by cp_segments_kernel, keep their own place
      const int64_t place = a.fused_segments && seg.seq >= 0 ? seg.order : z;
      if (place >= 0 && place < S) a.fwd_order[place] = int32_t(z);  // malformed offsets: in bounds
    }
  }
}

// The CP job scheduler: how a context-parallel call's work is split between CTAs, from the plan's
// arguments (CpPlanArgs).
//   - Job rows: row z * Hv + hv plans segment z of v-head hv (plan_cp_jobs). The prep's CTAs take
//     them once their items are done, from the last CTA back (those had at most as many items).
//   - Chain CTAs: CTA (i, hv, column slice) walks the boundaries of sequence i for v-head hv; of
//     its segments [first, first + count), boundary j is chained when it is exact.
template <int Hv>
struct CpScheduler {
  // Calls plan_row(row) for each job row of this CTA of the prep grid.
  template <class PlanRow>
  static __device__ __forceinline__ void for_each_job_row(const CpPlanArgs& a, PlanRow&& plan_row) {
    const int64_t rows = a.num_segments * Hv;
    for (int64_t row = int64_t(gridDim.x) - 1 - blockIdx.x; row < rows; row += gridDim.x) plan_row(row);
  }

  // A chain CTA's work: its sequence's segments and v-head.
  struct ChainWork {
    const CpPlanArgs& a;
    int64_t first;  // the sequence's first segment
    int32_t count;  // its segments
    int hv;
    // Whether boundary j (the start of the sequence's segment j) is chained exactly.
    __device__ __forceinline__ bool exact_at(int32_t j) const {
      return first + j < a.num_segments && a.exact[(first + j) * Hv + hv];
    }
    // The first exact boundary at or after j (count when none is left).
    __device__ __forceinline__ int32_t next_exact(int32_t j) const {
      while (j < count && !exact_at(j)) ++j;
      return j;
    }
  };
  static __device__ __forceinline__ ChainWork chain_work(const CpPlanArgs& a) {
    return ChainWork{a, a.seq_first[blockIdx.x], a.seq_count[blockIdx.x], int(blockIdx.y)};
  }
  // This chain CTA's first state column (blockIdx.z: its slice of Columns).
  template <int Columns>
  static __device__ __forceinline__ int first_column() { return blockIdx.z * Columns; }
};

// One CTA per (sequence, v-head, Columns state columns): the exact boundaries of the sequence in
// order. S_j = M_{j-1} S_{j-1} + H_{j-1}, where S_{j-1} is whatever segment j-1 starts from (the
// sequence's h0, a warm-up state, or this loop's previous result). Columns are independent, so
// CTAs of one head need no ordering between them, and each output element sums over m in the same
// order whatever Columns is (bitwise the same for 4, 8 or 16).
// The chain is a latency-bound walk. Each step's M (K x K fp32) goes to shared memory by one bulk
// copy while the previous step computes (two buffers), and the step's H comes into registers
// during the previous step too. M comes m-major whatever the state layout (the state pass stores
// it so), so a warp's scalar read down one of its columns is contiguous, touches every bank once
// and needs no swizzle, while the warp's read of prev at the same m stays a broadcast (k-major rows
// read from rotated starts would lose that broadcast). Each output element sums its K products in
// four running sums (m mod 4), which shortens the dependent chain of FMAs. A step's result stays
// in shared memory as the next step's input when the next boundary is exact too. The cycle counts
// behind these choices: docs/kernel-notes.md.
constexpr int kChainThreads = 256;   // kChainThreads / K threads per state row, each its part of the columns
constexpr int kChainPartials = 4;    // running sums per output element, over m mod 4

// M's two buffers: the bulk copies complete on the full barriers; a buffer is free again once the
// CTA-wide barrier that closes the step reading it has passed.
using ChainRing = MbarrierPipeline<2, /*Transactions=*/true, ConsumerRelease::kCtaBarrier>;

// The chain's shared memory: M's two buffers (m-major, as in global memory), the step's start
// state and the ring's barriers.
template <int K, int Columns>
struct ChainSharedStorage {
  float m[2][K * K];
  float prev[K * Columns];  // [K][Columns]
  ChainRing::Storage ring;
};

template <int K, int Columns>
constexpr int chain_smem_bytes() {
  return int(sizeof(ChainSharedStorage<K, Columns>));
}

template <int Hv, int K, int V, bool VFirst, int Columns>
__global__ void __launch_bounds__(kChainThreads) cp_chain_kernel(const CpPlanArgs a) {
  static_assert(K == V, "M maps a state to a state: the exact chain needs K = V (a transition job starts from S = I)");
  static_assert(kChainThreads % K == 0 && K % 32 == 0, "a state row has a whole number of threads, a warp whole rows");
  static_assert(chain_smem_bytes<K, Columns>() <= 227 * 1024,
                "two K x K fp32 M buffers must fit in shared memory: the chain supports K <= 128");
  constexpr int kHalf = Columns / (kChainThreads / K);  // this thread's columns (half of them at K = 128)
  static_assert(kHalf == 2 || (kHalf > 0 && kHalf % 4 == 0), "a thread's columns are read as one float2 or float4s");
  constexpr int64_t kState = int64_t(K) * V;
  using Ring = ChainRing;
  extern __shared__ __align__(16) float chain_smem[];
  auto& ss = *reinterpret_cast<ChainSharedStorage<K, Columns>*>(chain_smem);
  float* m_buf = &ss.m[0][0];  // [2][K][K]
  float* prev = ss.prev;
  // The forward pass may launch now: its unchained jobs need nothing from here, and its chained
  // ones wait for this grid to finish (every chain CTA is resident or done before it starts).
  allow_dependent_launch();
  using Scheduler = CpScheduler<Hv>;
  const int col0 = Scheduler::template first_column<Columns>();
  const int kk = threadIdx.x % K;                  // the state row this thread computes
  const int c0 = (threadIdx.x / K) * kHalf;        // its first column within the CTA's
  auto at = [](int64_t r, int64_t c) -> int64_t { return VFirst ? c * K + r : r * V + c; };  // (k, v) element
  if (threadIdx.x == 0) {
    Ring::init(ss.ring, 1);
    cutlass::arch::fence_barrier_init();
  }
  const typename Scheduler::ChainWork work = Scheduler::chain_work(a);
  const int64_t first = work.first;
  const int32_t n = work.count;
  const int hv = work.hv;
  {
    // Most CTAs have nothing to chain (only exact heads work). Their flags are read at once, one
    // per thread, so such a CTA frees its SM after one load instead of walking the boundaries one
    // dependent load at a time. The barrier also orders the barrier init above before any wait.
    bool any = false;
    for (int32_t b = 1 + int32_t(threadIdx.x); b < n; b += kChainThreads) any = any || work.exact_at(b);
    if (!__syncthreads_or(any)) return;
  }
  // M lies m-major, (k, m) at m K + k, in global memory as in shared: shared row m is M's column
  // m. The whole K x K fp32 comes by one bulk copy that one thread issues, completing on the
  // buffer's barrier (16-byte cp.async copies, or one bulk copy per row, take far longer to issue:
  // docs/kernel-notes.md).
  const TmaProducer<Ring> load(ss.ring);
  const Ring& ring = load.pipe;
  auto fill = [&](int32_t j, PairState st) {
    if (threadIdx.x == 0) {
      // the buffer's last readers passed the barrier that closed the previous step: order their
      // generic reads before the copy's async-proxy writes
      cutlass::arch::fence_view_async_shared();
      constexpr uint32_t kBytes = uint32_t(sizeof(float)) * K * K;
      load.expect(st, kBytes);
      load.bulk(st, a.m_end + ((first + j) * Hv + hv) * int64_t(K) * K, m_buf + st.index() * K * K, kBytes);
    }
  };
  auto load_h = [&](int32_t j, float (&h)[kHalf]) {
    const float* src = a.h_end + ((first + j) * Hv + hv) * kState;
    for (int c = 0; c < kHalf; ++c) h[c] = src[at(kk, col0 + c0 + c)];
  };
  int32_t j = work.next_exact(1);
  if (j >= n) return;
  fill(j, PairState{0, 0u});
  float h_cur[kHalf];
  load_h(j, h_cur);
  // PairState{buf, phases}: this step's buffer and the buffers' phases, kept in two loop variables
  // (a PairState variable across the loop compiles to a different register allocation)
  int buf = 0;
  uint32_t phases = 0u;
  int32_t last = -1;  // the boundary whose result `prev` holds
  while (j < n) {
    const int64_t row = (first + j) * Hv + hv;
    const int32_t following = work.next_exact(j + 1);
    float h_next[kHalf];
    if (following < n) {
      fill(following, PairState{buf, phases}.next());  // its buffer's last reads precede the previous step's closing barrier
      load_h(following, h_next);
    }
    ring.consumer_wait(PairState{buf, phases});
    phases ^= 1u << buf;  // buffer buf's next phase (PairState::next, split across the step)
    if (last != j - 1) {  // segment j - 1 starts from h0, a warm-up state or zeros: read it
      const float* s_prev = a.jobs_fwd[row - Hv].h0;
      for (int e = threadIdx.x; e < K * Columns; e += kChainThreads) {
        const int r = e / Columns, c = e % Columns;
        prev[e] = s_prev ? s_prev[at(r, col0 + c)] : 0.f;
      }
    }
    // acc = H + M prev, each element's 128 products in kChainPartials running sums (m mod
    // kChainPartials), added at the end in a fixed order: the same arithmetic for every column
    // width, so the widths give the same bits.
    float part[kChainPartials][kHalf];
    for (int c = 0; c < kHalf; ++c) {
      part[0][c] = h_cur[c];
#pragma unroll
      for (int p = 1; p < kChainPartials; ++p) part[p][c] = 0.f;
    }
    __syncthreads();  // M and prev are in shared memory
    const float* mb = m_buf + buf * K * K;
    // part[p] += M(kk, mm) * prev(mm, my columns), p = mm mod kChainPartials (a constant once unrolled)
    auto accumulate = [&](int mm, float w, int p) {
      float* acc = part[p];
      if constexpr (kHalf == 2) {
        const float2 x = *reinterpret_cast<const float2*>(prev + mm * Columns + c0);  // a broadcast per warp
        acc[0] = fmaf(w, x.x, acc[0]);
        acc[1] = fmaf(w, x.y, acc[1]);
      } else {
        const float4* p4 = reinterpret_cast<const float4*>(prev + mm * Columns + c0);
#pragma unroll
        for (int q = 0; q < kHalf / 4; ++q) {
          const float4 x = p4[q];
          acc[4 * q] = fmaf(w, x.x, acc[4 * q]);
          acc[4 * q + 1] = fmaf(w, x.y, acc[4 * q + 1]);
          acc[4 * q + 2] = fmaf(w, x.z, acc[4 * q + 2]);
          acc[4 * q + 3] = fmaf(w, x.w, acc[4 * q + 3]);
        }
      }
    };
    // shared row mm is M's column mm (stored m-major by the state pass): a scalar read down it
    for (int m8 = 0; m8 < K; m8 += 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u) accumulate(m8 + u, mb[(m8 + u) * K + kk], u % kChainPartials);
    }
    float acc[kHalf];
    for (int c = 0; c < kHalf; ++c) acc[c] = (part[0][c] + part[1][c]) + (part[2][c] + part[3][c]);
    float* out = a.boundary + row * kState;
    for (int c = 0; c < kHalf; ++c) out[at(kk, col0 + c0 + c)] = acc[c];
    __syncthreads();  // every read of prev and of this M buffer is done
    if (following == j + 1) {  // the next step starts from this result (otherwise it reads its own)
      for (int c = 0; c < kHalf; ++c) prev[kk * Columns + c0 + c] = acc[c];
    }
    if (following < n) {
      for (int c = 0; c < kHalf; ++c) h_cur[c] = h_next[c];
    }
    last = j;
    j = following;
    buf ^= 1;
  }
}

}  // namespace fqt
