// The sequential part of the GDN backward on Hopper: the two chains over a sequence's chunks that
// the rest of the backward (batched over chunks) cannot do, as one kernel family with a direction.
//
// Per chunk c of 64 tokens and v-head (docs/backward.md has the names), with every per-chunk input
// prepared by the batched part in the padded chunk layout [chunks, Hv, 64, D] (pad rows zero):
//
//   kStates     (forward over the chunks, from h0 or zeros):
//                 S_c is stored; Vn = u - w S_c (stored when asked for);
//                 S_{c+1} = e^{gamma_C} S_c + Kd^T Vn;  the last S is the final state.
//   kGradients  (backward over the chunks, from dht or zeros):
//                 dS_{c+1} is stored; dVn = scale P^T dO + Kd dS_{c+1} (stored when asked for);
//                 dS_c = e^{gamma_C} dS_{c+1} + (D Q)^T (scale dO) - w^T dVn;  the last is dh0.
//
// One CTA per (64-column V tile, v-head, sequence) walks the sequence's chunks keeping the
// transposed state (S^T or dS^T, [64 values x K]) in fp32 registers of its consumer warp group,
// so nothing of the state goes through shared memory. Per chunk, two dependent wgmma phases take
// their A operands from registers (an accumulator packed to 16 bits is the next wgmma's A fragment,
// element by element, as in the forward's chunk step) and their B operands from the stage:
//   kStates:    (1) Vn^T = u^T - S^T w^T                          A = S^T,  B = w   (t, k) K-major
//               (2) S^T  = e^{gC} S^T + Vn^T Kd                   A = Vn^T, B = Kd  viewed (k, t)
//   kGradients: (1) dVn^T = (P^T dO)^T + dS^T Kd^T                A = dS^T, B = Kd  (t, k) K-major
//                   and dS^T = e^{gC} dS^T + dO^T (D Q), beside it A = dO^T from shared memory
//               (2) dS^T += (-dVn^T) w                            A = -dVn^T, B = w viewed (k, t)
// The fp32 term of phase 1 (u or scale P^T dO) arrives in the stage as a (token, value) tile and
// is taken times its chunk's add_scale (the unit the caller runs the chain in).
//
// Warp group 0 is the producer: one thread streams each chunk's tiles into a ring of stages
// (MbarrierPipeline of gdn_pipeline.cuh, filled through TmaProducer of gdn_tma_producer.cuh: TMA
// tiles for the 16-bit operands, one bulk copy for the fp32 tile); the consumers release a stage
// once their last wgmma reading it is done.
//
// Work comes as segments (ChainSegment): a CTA walks one segment of a sequence, the whole
// sequence when it is not split. A segment after the sequence's first (states) or before its last
// (gradients) starts from the state at its boundary, which the CTA either approximates by a
// warm-up from zero over the `warmup[h]` chunks beyond the boundary, storing nothing for them, or
// gets exactly by a walk from the sequence's own start (end), which goes on through the following
// (preceding) boundaries chained so, whose segments' CTAs are then idle (chain_range). The warm-up
// is taken only where the window's summed log-decay is at most log(eps) and every token of it has
// 0 <= b |k|^2 <= 2 (the host folds the latter into window_log_decay as +inf): then the dropped
// term is at most eps times
// the true state at the window's far end (docs/backward.md, "The backward's warm-up bound"). A
// window that would reach past the sequence's start (end) is no approximation: it is the exact walk.
// Every chunk index is clamped into [0, num_chunks], so whatever the segments hold, nothing is
// read or written out of bounds.
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "gdn_pipeline.cuh"
#include "gdn_sequences.cuh"  // kChunk
#include "gdn_tma_producer.cuh"
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

enum class ChainDirection : int32_t { kStates = 0, kGradients = 1 };

constexpr int kChainRows = 64;  // wgmma M: state rows (values) per consumer warp group

template <class Cfg>
struct BwdChainSharedStorage;

// Elem: the 16-bit operand type of every wgmma (the state and the values are rounded to it as A
// operands; accumulation and the chain itself stay fp32). BlockV: the V columns of one CTA, one
// consumer warp group per 64.
template <class Elem_, int HeadK_, int HeadV_, int BlockV_, int Stages_, ChainDirection Direction_>
struct ChainConfig {
  using Elem = Elem_;
  static constexpr int HeadK = HeadK_, HeadV = HeadV_, BlockV = BlockV_, Stages = Stages_;
  static constexpr ChainDirection Direction = Direction_;
  static constexpr bool Gradients = Direction == ChainDirection::kGradients;
  static_assert(sizeof(Elem) == 2, "the wgmma operands are 16-bit (fp16 or bf16)");
  static_assert(HeadK % 64 == 0 && HeadK <= 256,
                "(t, k) tiles are whole 128-byte swizzle atoms and phase 2 is one wgmma of N = K <= 256");
  static_assert(BlockV == 64 || BlockV == 128, "block_v is 64 (one consumer warp group) or 128 (two)");
  static_assert(HeadV % BlockV == 0, "block_v must divide V");
  static_assert(Stages >= 1 && Stages <= 4, "one to four stages");
  static constexpr int Consumers = BlockV / kChainRows;
  static constexpr int Threads = 128 * (1 + Consumers);
  // One consumer group fits in the 255 registers a 256-thread CTA leaves each thread; two need the
  // producer's registers (setmaxnreg): 40 + 2 x 232 of the 168 x 3 per thread the launch leaves.
  static constexpr int ProducerRegs = 40, ConsumerRegs = 232;

  using C64 = Int<kChunk>;
  using CK = Int<HeadK>;
  using CBV = Int<BlockV>;
  using CM = Int<kChainRows>;

  // w, Kd, D Q as (token, k) tiles, k contiguous: K-major B operands of phase 1 (kStates' w,
  // kGradients' Kd); their (k, token) views are the MN-major B operands of phase 2.
  using LayoutTK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, CK>{}));
  using LayoutKT = decltype(composition(LayoutTK{}, make_layout(Shape<CK, C64>{}, GenRowMajor{})));
  // dO as a (value, token) tile, values contiguous: the MN-major A operand of dO^T (D Q) (the op's
  // scale is split between the two tiles by the caller).
  using LayoutVT = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<CBV, C64>{}));

  // (v, t) += (v, k) (t, k)^T: A from registers, B K-major.
  using MmaTok = decltype(make_tiled_mma(GMMA::rs_op_selector<Elem, Elem, float, Shape<CM, C64, CK>,
                                                              GMMA::Major::K, GMMA::Major::K>()));
  // (v, k) += (v, t) (t, k): A from registers, B MN-major.
  using MmaState = decltype(make_tiled_mma(GMMA::rs_op_selector<Elem, Elem, float, Shape<CM, CK, C64>,
                                                                GMMA::Major::K, GMMA::Major::MN>()));
  // (v, k) += dO^T (t, k): both operands MN-major in shared memory.
  using MmaStateSmem = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<CM, CK, C64>,
                                                                    GMMA::Major::MN, GMMA::Major::MN>()));

  using MainPipeline = MbarrierPipeline<Stages, /*Transactions=*/true>;
  using SharedStorage = BwdChainSharedStorage<ChainConfig>;
  static constexpr int SmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t TileTKBytes = uint32_t(sizeof(Elem)) * cosize_v<LayoutTK>;
  static constexpr uint32_t TileVTBytes = uint32_t(sizeof(Elem)) * cosize_v<LayoutVT>;
  static constexpr uint32_t AddBytes = uint32_t(sizeof(float)) * kChunk * BlockV;
  static constexpr uint32_t StageTxBytes = (Gradients ? 3 * TileTKBytes + TileVTBytes : 2 * TileTKBytes) + AddBytes;

  // Global views for TMA over the chunk layout: (t, k) tiles of rows = chunks * Hv * 64; dO as
  // (V, rows), values contiguous.
  static auto gmem_tk(const Elem* ptr, int64_t rows) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(rows), int32_t(HeadK)),
                       make_stride(int64_t(HeadK), _1{}));
  }
  static auto gmem_vt(const Elem* ptr, int64_t rows) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(HeadV), int32_t(rows)),
                       make_stride(_1{}, int64_t(HeadV)));
  }
  static auto tma_tk(const Elem* ptr, int64_t rows) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_tk(ptr, rows), LayoutTK{}, Shape<C64, CK>{});
  }
  static auto tma_vt(const Elem* ptr, int64_t rows) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_vt(ptr, rows), LayoutVT{}, Shape<CBV, C64>{});
  }
  using TmaTK = decltype(tma_tk(nullptr, 64));
  using TmaVT = decltype(tma_vt(nullptr, 64));
};

// The kernel's parameters. Per-chunk inputs are indexed by the chunk layout's chunk c and v-head h
// (tile c * Hv + h); states are [., Hv, K, V] (k-major rows of V values): the start and end
// states fp32, every chunk's state and values 16-bit, rounded as the wgmma operands that carry
// them to the next phase are.
template <class Cfg>
struct ChainParams {
  typename Cfg::TmaTK tma_w;    // w = T D K            [chunks, Hv, 64, K]
  typename Cfg::TmaTK tma_kd;   // Kd = diag(e^{gC - gamma}) K
  typename Cfg::TmaTK tma_qd;   // D Q, with part of the scale (kGradients)
  typename Cfg::TmaVT tma_do;   // dO with the rest of it [chunks, Hv, 64, V] (kGradients)
  // u (kStates) or scale P^T dO (kGradients), fp32 tiles [chunks, Hv, V / BlockV, 64, BlockV]
  const float* add;
  const float* add_scale;       // [chunks, Hv]: add is read times this (the chain's unit); null: 1
  const float* decay;           // e^{gamma_C} [chunks, Hv]
  const int64_t* segments;      // [num_segments, kSegmentFields] (ChainSegment)
  const int32_t* warmup;        // [Hv] warm-up window in chunks, <= 0 exact; null: every boundary exact
  const float* window_log_decay;  // [chunks, Hv] gamma_C, +inf where a token breaks the bound
  const float* state_in;        // h0 or dht [num_seqs, Hv, K, V]; null: zeros
  float* state_out;             // the final state or dh0 [num_seqs, Hv, K, V]; may be null
  typename Cfg::Elem* chunk_states;  // S_c or dS_{c+1} [chunks, Hv, K, V]
  typename Cfg::Elem* chunk_values;  // Vn or dVn [chunks, Hv, 64, V]; may be null
  int64_t num_chunks;
  int64_t num_seqs;
  float log_eps;
  int32_t num_heads;
  int64_t num_segments;         // rows of segments
};

// A segment as the host lays it out: its sequence's first chunk, the segment's chunks
// [begin, end), the sequence's end chunk, and the sequence (state_in / state_out row; -1: an
// unused slot, whose CTA does nothing).
constexpr int kSegmentFields = 5;

// The chunks [begin, begin + count) a CTA walks, the first `skip` iterations of them a warm-up
// whose chunks it does not store; whether it starts from state_in (the walk starts where its
// sequence does) and whether its end state is the sequence's (state_out).
struct ChainRange {
  int64_t begin;
  int64_t count;
  int64_t skip;
  int64_t seq;
  bool from_state;
  bool to_state;
  // The chunk of iteration i: forward or backward over the range.
  template <bool Backward>
  __device__ __forceinline__ int64_t chunk(int i) const { return Backward ? begin + count - 1 - i : begin + i; }
};

// Row s of the segment table, its chunk indices clamped into [0, num_chunks] and ordered.
struct ChainSegment {
  int64_t first, begin, end, last, seq;
  __device__ __forceinline__ bool continues(const ChainSegment& before) const {
    return seq >= 0 && seq == before.seq && first == before.first && last == before.last && begin == before.end;
  }
};

template <class Params>
__device__ __forceinline__ ChainSegment chain_segment(const Params& p, int64_t s) {
  const int64_t* e = p.segments + s * kSegmentFields;
  ChainSegment g;
  g.first = clamp_offset(e[0], p.num_chunks);
  g.begin = max(g.first, clamp_offset(e[1], p.num_chunks));
  g.end = max(g.begin, clamp_offset(e[2], p.num_chunks));
  g.last = max(g.end, clamp_offset(e[3], p.num_chunks));
  g.seq = e[4] >= 0 && e[4] < p.num_seqs ? e[4] : -1;
  return g;
}

// The warm-up window beyond a segment's boundary (Backward: its end, else its begin), [lo, hi),
// and whether it is taken: the segment has that boundary, the window stays inside the sequence and
// it passes the guard. A boundary that is not taken is chained exactly.
struct ChainWindow {
  int64_t lo, hi;
  bool boundary, warm;
};

template <bool Backward, class Params>
__device__ __forceinline__ ChainWindow chain_window(const Params& p, const ChainSegment& g, int hv) {
  const int n = p.warmup ? p.warmup[hv] : 0;
  ChainWindow w{0, 0, Backward ? g.end < g.last : g.begin > g.first, false};
  if (w.boundary) {
    w.lo = Backward ? g.end : g.begin - n;
    w.hi = Backward ? g.end + n : g.begin;
    if (n > 0 && (Backward ? w.hi < g.last : w.lo > g.first)) {
      float sum = 0.f;
      for (int64_t c = w.lo; c < w.hi; ++c) sum += p.window_log_decay[c * p.num_heads + hv];
      w.warm = sum <= p.log_eps;  // false for NaN: chained exactly
    }
  }
  return w;
}

// The walk of segment s for v-head hv (Backward: the reverse chain, whose boundary is the
// segment's end). A boundary whose window is not taken is chained exactly, by a walk from the
// sequence's own start (end). Such a walk goes on through every following (Backward: preceding)
// adjacent row whose boundary is chained exactly too (rows that continue each other in the table),
// storing them all, and those rows' CTAs are idle: a row is idle where its boundary is chained
// exactly and the row before it (after it) continues it with a boundary of its own that is not
// warm (so that row is walked exactly, by its CTA or by the walk that reaches it). So a sequence
// chained exactly is walked once, not once per segment; the arithmetic is the walk from the start
// either way, so whichever CTA walks a chunk, it stores the same values. Idle (seq -1) too for an
// unused slot or a sequence index out of range.
template <bool Backward, class Params>
__device__ __forceinline__ ChainRange chain_range(const Params& p, int64_t s, int hv) {
  ChainRange r{0, 0, 0, -1, false, false};
  const ChainSegment g = chain_segment(p, s);
  if (g.seq < 0) return r;
  const ChainWindow w = chain_window<Backward>(p, g, hv);
  const int64_t step = Backward ? -1 : 1;  // the walk's direction through the table's rows
  if (w.boundary && !w.warm && s - step >= 0 && s - step < p.num_segments) {
    const ChainSegment n = chain_segment(p, s - step);  // the row across this one's boundary
    if ((Backward ? n.continues(g) : g.continues(n)) && !chain_window<Backward>(p, n, hv).warm) return r;
  }
  int64_t lo_run = g.begin, hi_run = g.end;  // the chunks this CTA stores
  if (!w.warm) {
    // a walk from the sequence's start (end): on through the adjacent rows chained exactly
    ChainSegment run = g;
    for (int64_t t = s + step; t >= 0 && t < p.num_segments; t += step) {
      const ChainSegment n = chain_segment(p, t);
      if (!(Backward ? run.continues(n) : n.continues(run))) break;
      if (chain_window<Backward>(p, n, hv).warm) break;
      if (Backward) lo_run = run.begin = n.begin; else hi_run = run.end = n.end;
    }
  }
  r.seq = g.seq;
  if (Backward) {
    const int64_t stop = w.warm ? w.hi : g.last;
    r.begin = lo_run;
    r.count = stop - lo_run;
    r.skip = stop - hi_run;
    r.to_state = lo_run == g.first;
  } else {
    const int64_t start = w.warm ? w.lo : g.first;
    r.begin = start;
    r.count = hi_run - start;
    r.skip = lo_run - start;
    r.to_state = hi_run == g.last;
  }
  r.from_state = !w.warm;
  return r;
}

// One stage: the 16-bit tiles on 1024 bytes (whole swizzle atoms), then the fp32 tile. The
// kStates stage holds no D Q or dO tile.
template <class Cfg>
struct ChainStageStorage {
  using Elem = typename Cfg::Elem;
  static constexpr int kTK = cosize_v<typename Cfg::LayoutTK>, kVT = cosize_v<typename Cfg::LayoutVT>;
  struct Stage {
    cute::array_aligned<Elem, kTK, 1024> w;
    cute::array_aligned<Elem, kTK, 1024> kd;
    cute::array_aligned<Elem, Cfg::Gradients ? kTK : 8, 1024> qd;
    cute::array_aligned<Elem, Cfg::Gradients ? kVT : 8, 1024> dot;
    cute::array_aligned<float, kChunk * Cfg::BlockV, 128> add;  // (token, value) rows of BlockV
  };
  Stage stage[Cfg::Stages];
};

template <class Cfg>
struct alignas(1024) BwdChainSharedStorage {
  ChainStageStorage<Cfg> tiles;
  typename Cfg::MainPipeline::Storage pipeline;
};

// The producer: one thread loads every chunk of the CTA's range, in the direction's order.
template <class Cfg>
struct ChainProducer {
  static __device__ __forceinline__ void run(const ChainParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                             const ChainRange& range, int vt, int hv) {
    using C64 = typename Cfg::C64;
    using CK = typename Cfg::CK;
    using CBV = typename Cfg::CBV;
    using Load = TmaProducer<typename Cfg::MainPipeline>;
    cute::prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_kd.get_tma_descriptor());
    if constexpr (Cfg::Gradients) {
      cute::prefetch_tma_descriptor(p.tma_qd.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    }
    const int32_t rows = int32_t(p.num_chunks * p.num_heads * kChunk);
    Tensor gW = local_tile(p.tma_w.get_tma_tensor(make_shape(rows, int32_t(Cfg::HeadK))), Shape<C64, CK>{},
                           make_coord(_, 0));
    Tensor gKd = local_tile(p.tma_kd.get_tma_tensor(make_shape(rows, int32_t(Cfg::HeadK))), Shape<C64, CK>{},
                            make_coord(_, 0));
    Tensor gQd = local_tile(p.tma_qd.get_tma_tensor(make_shape(rows, int32_t(Cfg::HeadK))), Shape<C64, CK>{},
                            make_coord(_, 0));
    Tensor gDo = local_tile(p.tma_do.get_tma_tensor(make_shape(int32_t(Cfg::HeadV), rows)), Shape<CBV, C64>{},
                            make_coord(vt, _));
    constexpr int kVTiles = Cfg::HeadV / Cfg::BlockV;
    const Load load(ss.pipeline);
    for (int i = 0; i < int(range.count); ++i) {
      const PipelineState<Cfg::Stages> ps{i};
      const int64_t tile = range.chunk<Cfg::Gradients>(i) * p.num_heads + hv;
      const int32_t t = int32_t(tile);  // < 2^31 / 64: the launch checks the rows
      auto& st = ss.tiles.stage[ps.index()];
      auto tk = [](auto& buffer) { return make_tensor(make_smem_ptr(buffer.data()), typename Cfg::LayoutTK{}); };
      load.acquire(ps);
      load.expect(ps, Cfg::StageTxBytes);
      load.tile(ps, p.tma_w, gW(_, _, t), tk(st.w));
      load.tile(ps, p.tma_kd, gKd(_, _, t), tk(st.kd));
      if constexpr (Cfg::Gradients) {
        load.tile(ps, p.tma_qd, gQd(_, _, t), tk(st.qd));
        load.tile(ps, p.tma_do, gDo(_, _, t), make_tensor(make_smem_ptr(st.dot.data()), typename Cfg::LayoutVT{}));
      }
      load.bulk(ps, p.add + (tile * kVTiles + vt) * int64_t(kChunk * Cfg::BlockV), st.add.data(), Cfg::AddBytes);
    }
  }
};

// An accumulator into the A fragment of the next wgmma (same coordinates element by element),
// times `factor`, rounded to the operand type.
template <class Frag, class Acc>
__device__ __forceinline__ void chain_operand(Frag& frag, const Acc& acc, float factor = 1.f) {
  static_assert(decltype(size(frag))::value == decltype(size(acc))::value, "fragment and accumulator differ");
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2)
    *word_at(frag, e) = pack2<typename Frag::value_type>(factor * acc(e), factor * acc(e + 1));
}

// A consumer warp group: rows [v0, v0 + 64) of the transposed state through the CTA's chunks.
template <class Cfg>
struct ChainConsumer {
  static __device__ __forceinline__ void run(const ChainParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                             const ChainRange& range, int vt, int hv, int consumer, int ctid) {
    using Elem = typename Cfg::Elem;
    using C64 = typename Cfg::C64;
    using CK = typename Cfg::CK;
    using CM = typename Cfg::CM;
    constexpr int K = Cfg::HeadK, V = Cfg::HeadV;
    typename Cfg::MmaTok mma_tok;
    typename Cfg::MmaState mma_state;
    typename Cfg::MmaStateSmem mma_smem;
    auto thr_tok = mma_tok.get_thread_slice(ctid);
    auto thr_state = mma_state.get_thread_slice(ctid);
    auto thr_smem = mma_smem.get_thread_slice(ctid);

    Tensor accS = partition_fragment_C(mma_state, Shape<CM, CK>{});  // (v, k) the state, fp32
    Tensor accT = partition_fragment_C(mma_tok, Shape<CM, C64>{});   // (v, t) phase 1
    Tensor crdS = thr_state.partition_C(make_identity_tensor(Shape<CM, CK>{}));
    Tensor crdT = thr_tok.partition_C(make_identity_tensor(Shape<CM, C64>{}));
    Tensor fragS = make_tensor<Elem>(shape(thr_tok.partition_A(make_identity_tensor(Shape<CM, CK>{}))));
    Tensor fragT = make_tensor<Elem>(shape(thr_state.partition_A(make_identity_tensor(Shape<CM, C64>{}))));

    const int vrow = consumer * kChainRows;     // this group's rows within the CTA's tile
    const int v0 = vt * Cfg::BlockV + vrow;     // and within V
    const int64_t head_state = int64_t(K) * V;
    {
      const float* in = p.state_in && range.from_state ? p.state_in + (range.seq * p.num_heads + hv) * head_state
                                                       : nullptr;
      CUTE_UNROLL
      for (int e = 0; e < size(accS); ++e)
        accS(e) = in ? in[int64_t(get<1>(crdS(e))) * V + v0 + get<0>(crdS(e))] : 0.f;
    }
    chain_operand(fragS, accS);

    const typename Cfg::MainPipeline pipe(ss.pipeline);
    // e^{gamma_C} and the add term's scale are read one chunk ahead: the state is scaled before
    // phase 1 is issued, so a load in the same iteration would put a global-memory round trip on
    // the chain.
    auto add_scale_of = [&](int i) {
      return p.add_scale ? p.add_scale[range.chunk<Cfg::Gradients>(i) * p.num_heads + hv] : 1.f;
    };
    float next_decay = range.count > 0 ? p.decay[range.chunk<Cfg::Gradients>(0) * p.num_heads + hv] : 0.f;
    float next_add_scale = range.count > 0 ? add_scale_of(0) : 0.f;
    for (int i = 0; i < int(range.count); ++i) {
      const PipelineState<Cfg::Stages> ps{i};
      const int64_t c = range.chunk<Cfg::Gradients>(i);
      const int64_t tile = c * p.num_heads + hv;
      const float decay = next_decay, add_scale = next_add_scale;
      if (i + 1 < int(range.count)) {
        next_decay = p.decay[range.chunk<Cfg::Gradients>(i + 1) * p.num_heads + hv];
        next_add_scale = add_scale_of(i + 1);
      }
      auto& st = ss.tiles.stage[ps.index()];
      Tensor sW = make_tensor(make_smem_ptr(st.w.data()), typename Cfg::LayoutTK{});
      Tensor sWt = make_tensor(make_smem_ptr(st.w.data()), typename Cfg::LayoutKT{});
      Tensor sKd = make_tensor(make_smem_ptr(st.kd.data()), typename Cfg::LayoutTK{});
      Tensor sKdt = make_tensor(make_smem_ptr(st.kd.data()), typename Cfg::LayoutKT{});
      const float* add = st.add.data() + vrow;  // (t, v) at add[t * BlockV + v]

      // The state entering phase 1 (S_c, or dS_{c+1}) is this chunk's stored state (a warm-up
      // chunk belongs to the neighbouring segment, which stores it).
      const bool store = i >= range.skip;
      if (store) {
        Elem* out = p.chunk_states + tile * head_state;
        CUTE_UNROLL
        for (int e = 0; e < size(accS); ++e)
          out[int64_t(get<1>(crdS(e))) * V + v0 + get<0>(crdS(e))] = Elem(accS(e));
      }
      CUTE_UNROLL
      for (int e = 0; e < size(accS); ++e) accS(e) *= decay;  // no wgmma touches the state before phase 2

      pipe.consumer_wait(ps);
      warpgroup_fence_operand(fragS);
      warpgroup_fence_operand(accT);
      warpgroup_fence_operand(accS);
      warpgroup_arrive();
      if constexpr (Cfg::Gradients) {
        Tensor sDot = local_tile(make_tensor(make_smem_ptr(st.dot.data()), typename Cfg::LayoutVT{}),
                                 Shape<CM, C64>{}, make_coord(consumer, 0));
        Tensor sQdt = make_tensor(make_smem_ptr(st.qd.data()), typename Cfg::LayoutKT{});
        wgmma_gemm(mma_tok, fragS, thr_tok.partition_fragment_B(sKd), accT, true);  // dS^T Kd^T
        warpgroup_commit_batch();
        wgmma_gemm(mma_smem, thr_smem.partition_fragment_A(sDot), thr_smem.partition_fragment_B(sQdt), accS, false);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // phase 1's first GEMM; dO^T (D Q) may still run
      } else {
        wgmma_gemm(mma_tok, fragS, thr_tok.partition_fragment_B(sW), accT, true);  // S^T w^T
        warpgroup_commit_batch();
        warpgroup_wait<0>();
      }
      warpgroup_fence_operand(accT);

      // The new values (or their gradient), (v, t) of this thread: the fp32 term plus or minus phase 1.
      constexpr float kSign = Cfg::Gradients ? 1.f : -1.f;
      Elem* values = p.chunk_values && store ? p.chunk_values + tile * int64_t(kChunk) * V : nullptr;
      CUTE_UNROLL
      for (int e = 0; e < size(accT); ++e) {
        const int vv = get<0>(crdT(e)), tt = get<1>(crdT(e));
        accT(e) = add_scale * add[tt * Cfg::BlockV + vv] + kSign * accT(e);
        if (values) values[int64_t(tt) * V + v0 + vv] = Elem(accT(e));
      }
      // Phase 2 adds Vn^T Kd (kStates) or -dVn^T w (kGradients).
      chain_operand(fragT, accT, Cfg::Gradients ? -1.f : 1.f);
      warpgroup_fence_operand(fragT);
      warpgroup_arrive();
      if constexpr (Cfg::Gradients) wgmma_gemm(mma_state, fragT, thr_state.partition_fragment_B(sWt), accS, false);
      else wgmma_gemm(mma_state, fragT, thr_state.partition_fragment_B(sKdt), accS, false);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accS);
      pipe.consumer_release(ps);
      chain_operand(fragS, accS);
    }

    if (p.state_out && range.to_state) {
      float* out = p.state_out + (range.seq * p.num_heads + hv) * head_state;
      CUTE_UNROLL
      for (int e = 0; e < size(accS); ++e) out[int64_t(get<1>(crdS(e))) * V + v0 + get<0>(crdS(e))] = accS(e);
    }
  }
};

// Grid: x = segment * (V / BlockV) + V tile, y = v-head. Block: Cfg::Threads.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::Threads, 1) gdn_bwd_chain_kernel(CUTE_GRID_CONSTANT const ChainParams<Cfg> p) {
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  constexpr int kVTiles = Cfg::HeadV / Cfg::BlockV;
  const int vt = int(blockIdx.x % kVTiles), hv = int(blockIdx.y);
  const ChainRange range = chain_range<Cfg::Gradients>(p, int64_t(blockIdx.x / kVTiles), hv);
  if (range.seq < 0) return;  // an unused slot: the whole CTA leaves before any barrier
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    Cfg::MainPipeline::init(ss.pipeline, 1, 128 * Cfg::Consumers);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    if constexpr (Cfg::Consumers > 1) cutlass::arch::warpgroup_reg_dealloc<Cfg::ProducerRegs>();
    if (threadIdx.x == 0) ChainProducer<Cfg>::run(p, ss, range, vt, hv);
    return;
  }
  if constexpr (Cfg::Consumers > 1) cutlass::arch::warpgroup_reg_alloc<Cfg::ConsumerRegs>();
  ChainConsumer<Cfg>::run(p, ss, range, vt, hv, warp_group - 1, threadIdx.x % 128);
}

}  // namespace fqt
