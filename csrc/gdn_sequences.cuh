// Sequence and chunk-slot bookkeeping shared by the GDN kernels.
//
// cu_seqlens lives on the device and is never trusted: every offset is clamped into
// [0, total_tokens], so whatever it holds, no kernel reads or writes out of bounds.
//
// Chunk slots: sequence i's chunk c is stored at slot (start_i / 64) + i + c. A sequence of
// length L needs ceil(L / 64) <= (end_i / 64) - (start_i / 64) + 1 slots, so slots never
// overlap between sequences and total_tokens / 64 + num_seqs + 1 slots always suffice.
// Slot-indexed scratch keeps a tail chunk's padding rows its own (zeros), never another
// sequence's tokens.
#pragma once
#include <stdint.h>

namespace fqt {

constexpr int kChunk = 64;

struct SeqRange {
  int64_t start;  // first token
  int64_t len;    // tokens (0 for an empty or malformed sequence)
  int64_t slot0;  // slot of the first chunk
  __host__ __device__ int64_t num_chunks() const { return (len + kChunk - 1) / kChunk; }
  // Tokens of chunk c that belong to the sequence (kChunk but in the tail chunk).
  __host__ __device__ int rows_in_chunk(int64_t c) const {
    const int64_t rows = len - c * kChunk;
    return int(rows < kChunk ? rows : kChunk);
  }
};

__device__ __forceinline__ int64_t clamp_offset(int64_t x, int64_t total) {
  return x < 0 ? 0 : (x > total ? total : x);
}

__device__ __forceinline__ SeqRange sequence_range(const int64_t* cu, int64_t seq, int64_t total) {
  int64_t a = clamp_offset(cu[seq], total);
  int64_t b = clamp_offset(cu[seq + 1], total);
  SeqRange r;
  r.start = a;
  r.len = b > a ? b - a : 0;
  r.slot0 = a / kChunk + seq;
  return r;
}

__host__ __device__ inline int64_t num_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return total_tokens / kChunk + num_seqs + 1;
}

// Context parallelism (gdn_cp.cuh) gives each sequential CTA a job instead of a whole sequence: a
// chunk-aligned token range of one sequence (its chunk slots are the sequence's, so the prep's
// output is reused as is), where its state starts and where its end state goes.
enum : int32_t {
  kJobIdentityState = 1,  // start from S = I (K = V): the end state is the range's transition M
  kJobZeroV = 2,          // read v as zeros (with kJobIdentityState: S' = M S exactly)
  kJobNoOutput = 4,       // state-only: o is not written (warm-up windows, H and M passes)
  kJobChained = 8,        // a forward job whose start state the exact chain writes (runs after it)
};

// Which forward jobs a context-parallel forward launch runs (FwdParams::job_pass).
enum : int32_t {
  kAllJobs = 0,
  // Grid z in [0, S) runs the jobs of row z that start from h0 or a warm-up state: they need
  // nothing from the exact chain and start at once. z in [S, 2 S) runs the jobs of row z - S that
  // start from a chained state, after the chain kernel, the launch's programmatic prerequisite,
  // has finished. CTAs of lower z tend to be dispatched first (not a guarantee, and correctness
  // does not rest on it), so waiting CTAs mostly come after the unchained ones.
  kUnchainedThenChained = 1,
};

struct CpJob {
  int64_t start;     // first token
  int64_t len;       // tokens; 0 with out == nullptr marks an unused grid slot
  int64_t slot0;     // chunk slot of the first chunk
  const float* h0;   // start state [K, V] (plan layout) of this v-head, or null for zeros
  float* out;        // end state, or null
  int32_t flags;
  int32_t unused;
};

// The sequence whose chunks cover `slot` (largest i with slot0(i) <= slot), by binary search.
__device__ __forceinline__ int64_t sequence_of_slot(const int64_t* cu, int64_t slot, int64_t num_seqs,
                                                    int64_t total) {
  int64_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (clamp_offset(cu[mid], total) / kChunk + mid <= slot) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace fqt
