"""The segment policy: how a sequence's length and a segment table give its CP segments, and the
limits on a call. The Python home of these rules; csrc/gdn_segment_policy.h is the C++/CUDA one
(the kernels, the library's launch checks and the C++ host path include it), and
tests/test_segment_policy.py compiles that header and checks that the two agree.

A segment table has SEGMENT_BUCKETS entries: entry b is the segment length (chunks) for sequences
of at most 2^b chunks (entry 0: one chunk or none; the last entry: every longer sequence). A
length of 0, or one at least the sequence's chunk count, means one segment.
"""
from __future__ import annotations

SEGMENT_BUCKETS = 32              # kSegmentBuckets
MAX_SEQUENCES = 65535             # kMaxSequences: the sequential kernel has one grid z-slice per sequence
MAX_SEGMENTS = MAX_SEQUENCES // 3  # kMaxSegments: the state pass has 3 grid z-slices per segment
MAX_TOKENS = 2**31 - 1            # kMaxTokens: TMA coordinates are 32-bit


def bucket_of_chunks(chunks: int) -> int:
    """The segment-table entry a sequence of `chunks` chunks reads: ceil(log2 chunks), 0 for one
    chunk or none, the last entry for longer ones."""
    return min(max(chunks - 1, 0).bit_length(), SEGMENT_BUCKETS - 1)


def segments_of(chunks: int, length: int) -> int:
    """Segments of a sequence of `chunks` chunks cut every `length` chunks; one unless
    0 < length < chunks."""
    return -(-chunks // length) if 0 < length < chunks else 1


__all__ = ["MAX_SEGMENTS", "MAX_SEQUENCES", "MAX_TOKENS", "SEGMENT_BUCKETS", "bucket_of_chunks", "segments_of"]
