// The prep kernel's shared memory, part by part: each collective's storage is a type of its own,
// and PrepSharedStorage places them, in this order:
//   tiles     the TMA producer's q and k tiles of an item (1024-byte aligned: whole swizzle atoms)
//   products  K K^T and Q K^T in fp32 (qk_products); the solve leaves X in them
//   gates     a head batch's gamma and beta (PrepGates), and the next item's, copied ahead
//   loaded    the barrier of the q/k tiles' ring (PrepConfig::LoadPipeline)
//   items     the shared copy of cu_seqlens and two decoded-item slots, from the next 1024 bytes
//   extra_x   with 256 threads, the X tiles of heads 2 and 3 of a batch solved at once
// Each part starts where the one before ends (at its alignment): PrepConfig pins the offsets with
// static_asserts. The launch asks for the bytes up to the end of the last part it uses
// (PrepConfig::SmemBytes), not for the struct's tail padding.
#pragma once
#include <stddef.h>  // offsetof
#include <stdint.h>

#include <cute/container/array_aligned.hpp>
#include <cute/layout.hpp>  // cosize_v

#include "gdn_sequences.cuh"

namespace fqt {

constexpr int kPrepPad = kChunk + 4;  // padded rows of 64x64 fp32 tiles (16-byte aligned rows)

// A call of up to kPrepSeqCache sequences decodes its items from a shared-memory copy of
// cu_seqlens: the binary search over the offsets otherwise waits on dependent global loads
// (measured: docs/kernel-notes.md).
constexpr int kPrepSeqCache = 128;

// One work item: a chunk of one sequence for one q/k head (invalid for unused slots or chunks).
struct PrepItem {
  int64_t slot;
  int64_t chunk;
  SeqRange range;
  int hqk;
  bool valid;
};

// An item as thread 0 decoded it, and the index of the item after it. Thread 0 alone finds and
// decodes each next item, into one of two shared-memory slots the other threads read after the
// item's barriers: every thread decoding each item for itself would take about a quarter of the
// prep's SASS instructions (int64 offsets, clamps, the binary search; docs/kernel-notes.md).
struct PrepItemSlot {
  PrepItem it;
  int64_t next;
};

// The TMA producer's part: an item's q and k tiles, (64, K) in the swizzled layout LayoutQK.
template <class Elem, class LayoutQK>
struct PrepTileStorage {
  cute::array_aligned<Elem, cute::cosize_v<LayoutQK>, 1024> q;
  cute::array_aligned<Elem, cute::cosize_v<LayoutQK>, 1024> k;
};

// The products' fp32 tiles, rows padded to kPrepPad. QkInQ (128 threads): Q K^T lives in the q
// tile once the GEMMs have read it, and qk is a stand-in of 16 bytes.
template <bool QkInQ>
struct PrepProductStorage {
  float kk[kChunk * kPrepPad];
  float qk[QkInQ ? 4 : kChunk * kPrepPad];
};

// PrepGates' part: per v-head of a head batch, the in-chunk cumulative log-decay and beta, and
// the next item's first-batch gates and betas, copied asynchronously while this item is solved.
template <int HeadBatch>
struct PrepGateStorage {
  float gamma[HeadBatch][kChunk];
  float beta[HeadBatch][kChunk];
  float g_next[HeadBatch][kChunk];
  float beta_next[HeadBatch][kChunk];
};

// The item decoder's part: cu_seqlens (calls of up to kPrepSeqCache sequences) and the two item
// slots, in a block of SeqBytes + SlotBytes.
struct PrepItemStorage {
  static constexpr int SeqBytes = int(sizeof(int64_t)) * (kPrepSeqCache + 1);
  static constexpr int SlotBytes = 2 * 64;
  int64_t offsets[kPrepSeqCache + 1];
  PrepItemSlot slots[2];
  unsigned char unused[SlotBytes - 2 * sizeof(PrepItemSlot)];
};
static_assert(sizeof(PrepItemStorage) == PrepItemStorage::SeqBytes + PrepItemStorage::SlotBytes,
              "cu_seqlens' copy, then two item slots in 128 bytes");

// The X tiles of the heads solved at once beyond the two that the products' tiles hold, 16-byte
// aligned for for_each_in_x_column; none with 128 threads.
template <int Tiles>
struct PrepExtraXStorage {
  float x[Tiles][kChunk * kPrepPad];
};
template <>
struct PrepExtraXStorage<0> {};

// The kernel's storage for q/k tiles in LayoutQK, the q/k ring's barriers LoadStorage, HeadBatch
// v-heads per batch of gates, Q K^T in the q tile (QkInQ) and ExtraX more X tiles (PrepConfig).
template <class Elem, class LayoutQK, class LoadStorage, int HeadBatch, bool QkInQ, int ExtraX>
struct alignas(1024) PrepSharedStorage {
  using Tiles = PrepTileStorage<Elem, LayoutQK>;
  using Products = PrepProductStorage<QkInQ>;
  using Gates = PrepGateStorage<HeadBatch>;
  using GateRows = float[HeadBatch][kChunk];

  Tiles tiles;
  Products products;
  Gates gates;
  LoadStorage loaded;
  alignas(1024) PrepItemStorage items;
  alignas(128) PrepExtraXStorage<ExtraX> extra_x;

  // Q K^T's fp32 tile: in the q tile with QkInQ, else a tile of its own.
  __device__ __forceinline__ float* qk_tile() {
    if constexpr (QkInQ) {
      static_assert(sizeof(tiles.q) >= kChunk * kChunk * sizeof(float), "Q K^T's fp32 tile fits the q tile (K >= 128)");
      return reinterpret_cast<float*>(tiles.q.data());
    } else {
      return products.qk;
    }
  }
  // The gate rows, each addressed by one constant offset from the storage's base. Through the
  // nested member (gates.beta) nvcc keeps the part's base in a register of its own, which
  // changes the code of the prep of one v-head per q/k head; from the base, its code is that of
  // the arrays as members of the storage itself.
  __device__ __forceinline__ GateRows& gamma() { return gate_rows(offsetof(Gates, gamma)); }
  __device__ __forceinline__ GateRows& beta() { return gate_rows(offsetof(Gates, beta)); }
  __device__ __forceinline__ GateRows& g_next() { return gate_rows(offsetof(Gates, g_next)); }
  __device__ __forceinline__ GateRows& beta_next() { return gate_rows(offsetof(Gates, beta_next)); }

 private:
  __device__ __forceinline__ GateRows& gate_rows(size_t member) {
    return *reinterpret_cast<GateRows*>(reinterpret_cast<char*>(this) + offsetof(PrepSharedStorage, gates) + member);
  }
};

}  // namespace fqt
