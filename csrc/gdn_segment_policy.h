// The segment policy: how a sequence's length and a segment table give its CP segments, and the
// limits on a call. The one C++/CUDA home of these rules: the CP kernels (gdn_cp.cuh), the
// library's launch checks (gdn_fwd_host.cuh) and the eager op's C++ host path
// (gdn_torch_host.cpp) include it; flashqla_tune/segment_policy.py is the Python copy, and
// tests/test_segment_policy.py compiles this header on the host and compares the two.
//
// A segment table has kSegmentBuckets entries: entry b is the segment length (chunks) for
// sequences of at most 2^b chunks (entry 0: one chunk or none; the last entry: every longer
// sequence). A length of 0, or one at least the sequence's chunk count, means one segment.
//
// Plain C++ apart from the qualifiers, so that a host compiler without CUDA can read it.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define FQT_POLICY_FN __host__ __device__ __forceinline__
#else
#define FQT_POLICY_FN inline
#endif

namespace fqt {

constexpr int kSegmentBuckets = 32;
constexpr int64_t kMaxSequences = 65535;   // the sequential kernel has one grid z-slice per sequence
constexpr int64_t kMaxSegments = kMaxSequences / 3;  // the state pass has 3 grid z-slices per segment
constexpr int64_t kMaxTokens = (int64_t(1) << 31) - 1;  // TMA coordinates are 32-bit

// Leading zero bits of x > 0 as a 64-bit value.
FQT_POLICY_FN int leading_zeros64(int64_t x) {
#if defined(__CUDA_ARCH__)
  return __clzll(x);
#else
  return __builtin_clzll(static_cast<unsigned long long>(x));
#endif
}

// The segment-table entry a sequence of `chunks` chunks reads: ceil(log2(chunks)), 0 for one
// chunk or none, the last entry for longer sequences.
FQT_POLICY_FN int bucket_of_chunks(int64_t chunks) {
  int b = chunks <= 1 ? 0 : 64 - leading_zeros64(chunks - 1);  // ceil(log2(chunks))
  b = b < kSegmentBuckets ? b : kSegmentBuckets - 1;
  return b;
}

// Segment length in chunks for a sequence of `chunks` chunks; a result of 0 or >= chunks means one
// segment.
FQT_POLICY_FN int64_t segment_chunks_for(const int32_t* table, int64_t chunks) {
  return table[bucket_of_chunks(chunks)];
}

// Segments of a sequence of `chunks` chunks cut every `seg_chunks` chunks: one unless
// 0 < seg_chunks < chunks.
FQT_POLICY_FN int64_t segments_of(int64_t chunks, int64_t seg_chunks) {
  return seg_chunks > 0 && chunks > seg_chunks ? (chunks + seg_chunks - 1) / seg_chunks : 1;
}

}  // namespace fqt
