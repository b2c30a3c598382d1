// The sequential GDN forward on Hopper: one CTA per (V tile, v-head, sequence) walks the
// sequence chunk by chunk, keeping the transposed state S^T [block_v x K] in fp32 registers.
//
// Warp group 0 is the producer: one thread streams each chunk's q, k, v, the prepared Aw and P
// tiles and the gates into a ring of shared-memory stages with TMA (bulk copies completing on
// mbarriers); it alone reads the prep kernel's output, so it alone waits for it (gdn_grid_sync.cuh).
// Each consumer warp group (one per 64 state columns) owns 64 rows (values) of S^T and runs, per chunk,
// three dependent wgmma phases whose A operands never leave registers (the accumulator layout of
// one wgmma is the A-fragment layout of the next, as in FlashAttention-3):
//   1. X^T = V^T - (S^T K^T) D        and  O^T = scale (S^T Q^T) D      (A = S^T, bf16/fp16)
//   2. Vn^T = X^T Aw^T                                                  (A = X^T)
//   3. O^T += Vn^T P^T                and  S^T = e^{gC} S^T + Vn^T diag(e^{gC - g}) K
// with D = diag(e^{g}). Only K, Q, Aw, P (B operands) and V come from shared memory; nothing of
// the state goes through shared memory, so a chunk needs no barrier between its phases.
// With OutputGroup (block_v 64), the O^T terms move to a last warp group that reads S^T and Vn^T
// handed over in shared memory; the consumer then runs only what the next chunk depends on.
// A tail chunk first zeroes K's and V's rows past the sequence end (0 x NaN would leak).
// The register budget is split between the roles with setmaxnreg.
//
// The kernel composes collectives, each a type over the plan's configuration (FwdConfig, which
// takes the head dims K and V as template parameters): FwdScheduler (which sequence or CP job a
// CTA runs), FwdWarpRoles (which warp group does what), FwdProducer (the TMA loads into the stage
// ring, FwdConfig::MainPipeline from gdn_pipeline.cuh, through the TmaProducer of
// gdn_tma_producer.cuh that the prep and the CP chain use too), FwdChunkConsumer (the chunk step
// above and the end state), FwdOutputWarpGroup (the O GEMMs of an OutputGroup plan, fed through
// FwdConfig::HandoffPipeline) and FwdEpilogue (O through shared memory to global memory). The
// producer, the output warp group and the epilogue declare their shared storage;
// FwdSharedStorage composes it with the pipelines' barriers.
#pragma once
#include "gdn_driver_entry.cuh"  // first: before any CUTLASS header
#include <cuda_runtime.h>
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "gdn_grid_sync.cuh"
#include "gdn_pipeline.cuh"
#include "gdn_sequences.cuh"
#include "gdn_tma_producer.cuh"
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

constexpr int kRowsPerConsumer = 64;  // wgmma M: state rows (values) per consumer warp group
constexpr int kOutPitch = kRowsPerConsumer + 8;  // padded row of the O staging tile (no bank conflicts)

template <class Cfg>
struct FwdSharedStorage;

template <class Elem_, int Hqk_, int Hv_, int HeadK_, int HeadV_, int BlockV_, int Stages_, bool StateVFirst_,
          int ProducerRegs_, int ConsumerRegs_, int CtasPerSm_ = 1, bool OutputGroup_ = false, int PrepThreads_ = 256>
struct FwdConfig {
  using Elem = Elem_;
  static constexpr int Hqk = Hqk_, Hv = Hv_, HeadK = HeadK_, HeadV = HeadV_;
  static constexpr int BlockV = BlockV_, Stages = Stages_;
  static constexpr bool StateVFirst = StateVFirst_;
  static constexpr int ProducerRegs = ProducerRegs_, ConsumerRegs = ConsumerRegs_;
  static_assert(BlockV == 64 || BlockV == 128, "block_v is 64 (one consumer warp group) or 128 (two)");
  static constexpr int Consumers = BlockV / kRowsPerConsumer;
  // OutputGroup: a further warp group computes O from the chain's S^T and Vn^T, handed over in
  // shared memory, so the chain runs only the three GEMMs the next chunk depends on.
  static constexpr bool OutputGroup = OutputGroup_;
  static_assert(!OutputGroup || BlockV == 64, "the output warp group pairs with one chain (block_v 64)");
  static constexpr int Threads = 128 * (1 + Consumers + (OutputGroup ? 1 : 0));
  // Launch bounds leave 65536 / CtasPerSm registers per CTA, LaunchRegs per thread; setmaxnreg moves
  // them from the producer to the chains. The output warp group keeps LaunchRegs.
  static constexpr int CtasPerSm = CtasPerSm_;
  static_assert(CtasPerSm == 1 || CtasPerSm == 2, "one or two CTAs per SM");
  // The pool is LaunchRegs x Threads (168 x 384 = 64512 for three warp groups), not 65536.
  static constexpr int LaunchRegs = (65536 / CtasPerSm / Threads) / 8 * 8 < 256 ? (65536 / CtasPerSm / Threads) / 8 * 8 : 256;
  static_assert(ProducerRegs <= LaunchRegs, "setmaxnreg can only lower the producer's registers");
  static_assert(128 * (ProducerRegs + Consumers * ConsumerRegs + (OutputGroup ? LaunchRegs : 0)) <= LaunchRegs * Threads,
                "the register split exceeds the pool the launch bounds leave");
  static_assert(HeadK % 64 == 0 && HeadK <= 256,
                "q/k tile rows are whole 128-byte swizzle atoms, and the state update is one wgmma of N = K <= 256");
  static constexpr int PrepThreads = PrepThreads_;  // the prep kernel's CTA (gdn_prep.cuh)
  static_assert(HeadV % BlockV == 0, "block_v must divide V");

  using C64 = Int<kChunk>;
  using CK = Int<HeadK>;
  using CBV = Int<BlockV>;
  using CM = Int<kRowsPerConsumer>;

  // Q, K tiles (token, k), k contiguous: K-major B operands of S^T Q^T and S^T K^T. K's
  // transposed view (k, token) is the MN-major B operand of the state update.
  using LayoutQK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, CK>{}));
  using LayoutKt = decltype(composition(LayoutQK{}, make_layout(Shape<CK, C64>{}, GenRowMajor{})));
  // Aw, P (i, j), j contiguous: K-major B operands of X^T Aw^T and Vn^T P^T.
  using LayoutMat = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, C64>{}));
  // V tile (v, token), v contiguous as in global memory (the swizzle spreads a thread's column
  // reads over the banks).
  using LayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<CBV, C64>{}));

  // Register-A wgmma, M = 64 values: N = 64 tokens with a K-major B; N = K keys with K MN-major.
  using MmaTok = decltype(make_tiled_mma(GMMA::rs_op_selector<Elem, Elem, float, Shape<CM, C64, C64>,
                                                              GMMA::Major::K, GMMA::Major::K>()));
  using MmaState = decltype(make_tiled_mma(GMMA::rs_op_selector<Elem, Elem, float, Shape<CM, CK, C64>,
                                                                GMMA::Major::K, GMMA::Major::MN>()));
  // The output warp group's GEMMs read both operands from shared memory (S^T, Vn^T handed over).
  using MmaOut = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<CM, C64, C64>,
                                                              GMMA::Major::K, GMMA::Major::K>()));

  // The stages: the producer's bulk copies complete on each stage's full barrier; the consumers
  // (and the output warp group) release it. The handoff: the consumer's S^T and Vn^T to the output
  // warp group, two buffers used by chunk parity.
  using MainPipeline = MbarrierPipeline<Stages, /*Transactions=*/true>;
  using HandoffPipeline = MbarrierPipeline<2, /*Transactions=*/false>;

  // The kernel's shared memory, composed of its collectives' storage (FwdSharedStorage, after them).
  using SharedStorage = FwdSharedStorage<FwdConfig>;
  static constexpr int SmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t StageTxBytes =
      uint32_t(sizeof(Elem)) * (2 * cosize_v<LayoutQK> + cosize_v<LayoutVt> + 2 * cosize_v<LayoutMat>) +
      uint32_t(sizeof(float)) * kChunk;
  // The state-only pass reads neither Q nor P; a transition job (kJobZeroV) not V either.
  static constexpr uint32_t StateStageTxBytes =
      StageTxBytes - uint32_t(sizeof(Elem)) * (cosize_v<LayoutQK> + cosize_v<LayoutMat>);
  static constexpr uint32_t VTileBytes = uint32_t(sizeof(Elem)) * cosize_v<LayoutVt>;

  // Global views for TMA. q/k: (token, Hqk*K) row-major. v: (Hv*V, token). Aw/P: (Hv*slots*64, 64).
  static auto gmem_qk(const Elem* ptr, int64_t T) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(T), int32_t(Hqk * HeadK)),
                       make_stride(int64_t(Hqk * HeadK), _1{}));
  }
  static auto gmem_v(const Elem* ptr, int64_t T) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(Hv * HeadV), int32_t(T)),
                       make_stride(_1{}, int64_t(Hv * HeadV)));
  }
  static auto gmem_mat(const Elem* ptr, int64_t rows) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(int32_t(rows), int32_t(kChunk)), make_stride(int64_t(kChunk), _1{}));
  }
  static auto tma_qk(const Elem* ptr, int64_t T) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_qk(ptr, T), LayoutQK{}, Shape<C64, CK>{});
  }
  static auto tma_v(const Elem* ptr, int64_t T) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_v(ptr, T), LayoutVt{}, Shape<CBV, C64>{});
  }
  static auto tma_mat(const Elem* ptr, int64_t rows) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_mat(ptr, rows), LayoutMat{}, Shape<C64, C64>{});
  }
  using TmaQK = decltype(tma_qk(nullptr, 1));
  using TmaV = decltype(tma_v(nullptr, 1));
  using TmaMat = decltype(tma_mat(nullptr, 1));
};

// The plan's sequential kernel at two CTAs per SM, for calls with more sequential CTAs than SMs
// (many sequences times v-heads), which one CTA per SM runs in two waves: one pipeline stage and a
// 24 / 232 register split fit two (the tile sweep behind it: docs/kernel-notes.md). Only the
// pipeline depth and the register split differ, so the
// results are the plan's bit for bit. Plans with two consumer warp groups, an output warp group or
// two CTAs per SM already have none.
template <class Cfg>
struct TwoPerSmConfig {
  static constexpr bool exists = Cfg::CtasPerSm == 1 && Cfg::BlockV == 64 && !Cfg::OutputGroup;
  using type = FwdConfig<typename Cfg::Elem, Cfg::Hqk, Cfg::Hv, Cfg::HeadK, Cfg::HeadV, 64, /*stages=*/1,
                         Cfg::StateVFirst, /*producer_regs=*/24, /*consumer_regs=*/232, /*ctas_per_sm=*/2,
                         /*output_group=*/false, Cfg::PrepThreads>;
};

// The forward kernel's warp groups (threadIdx.x / kThreads) by role: the producer, whose thread
// kLoadIssuer issues every load (and initialises the barriers); Consumers consumer groups (64 state
// rows each); then the output warp group when the plan has one. setmaxnreg moves registers from
// the producer to the consumers. Plain constants: the kernel compares its group with them.
template <class Cfg>
struct FwdWarpRoles {
  static constexpr int kThreads = 128;  // a warp group
  static constexpr int kProducer = 0;
  static constexpr int kLoadIssuer = 0;  // threadIdx.x
  static constexpr int kFirstConsumer = 1;
  static constexpr int kOutput = 1 + Cfg::Consumers;  // with Cfg::OutputGroup
};

// The sequential kernel's parameters, typed by what it loads and stores only: configurations that
// load the same tiles (a plan and its TwoPerSmConfig) share one parameter type, so one set of TMA
// descriptors and pointers serves either kernel.
template <class Elem, class TmaQK, class TmaV, class TmaMat>
struct FwdParamsOf {
  TmaQK tma_q;
  TmaQK tma_k;
  TmaV tma_v;
  TmaMat tma_aw;
  TmaMat tma_p;
  const float* gamma;          // [Hv, slots * 64]
  const uint32_t* ready;       // [Hqk, slots] prep's per-item flags; null: wait for the whole prep grid
  const int64_t* cu_seqlens;
  const float* initial_state;  // may be null
  float* final_state;          // may be null
  const CpJob* jobs;           // [rows, Hv] context-parallel jobs (CTA z runs row FwdScheduler::job_row); null: CTA z
                               // runs sequence z
  Elem* o;                     // [T, Hv, V]
  int64_t total_tokens;
  int64_t num_seqs;
  int64_t num_slots;
  float scale;
  int32_t job_pass = kAllJobs; // with jobs: which of them this launch runs (kUnchainedThenChained)
  const int32_t* job_order = nullptr;  // [S] kUnchainedThenChained: the unchained half's CTA z runs
                                       // row job_order[z] (gdn_cp.cuh plan_segment); null: row z
};
template <class Cfg>
using FwdParams = FwdParamsOf<typename Cfg::Elem, typename Cfg::TmaQK, typename Cfg::TmaV, typename Cfg::TmaMat>;

// Accumulator element e of a 64 x N wgmma tile sits at (row0 + 8 * ((e / 2) % 2), col0 + e % 2 +
// 8 * (e / 4)) (CuTe's SM90 C layout); A-register fragment element e has the same coordinates,
// which is what lets an accumulator become the next wgmma's A operand element by element.
// Column slot of element e among a thread's N / 4 columns:
__host__ __device__ constexpr int column_slot(int e) { return (e / 4) * 2 + e % 2; }

// Four 8x8 16-bit tiles from shared memory, transposed: lane l gets, of tile m, the two elements of
// stored column l / 4 at stored rows 2 (l % 4) and 2 (l % 4) + 1, which is the accumulator layout.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t smem_addr, uint32_t* dst) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3])
               : "r"(smem_addr)
               : "memory");
}

template <class Frag, class Acc>
__device__ __forceinline__ void to_operand(Frag& frag, const Acc& acc) {
  static_assert(decltype(size(frag))::value == decltype(size(acc))::value, "fragment and accumulator differ");
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) *word_at(frag, e) = pack2<typename Frag::value_type>(acc(e), acc(e + 1));
}

// The stage ring that FwdProducer fills and the consumers (and the output warp group) drain: per
// stage the chunk's q, k, v, Aw and P tiles, 1024-byte aligned (whole 128-byte swizzle atoms), and
// its gates. The gates are a part of their own, placed after the O staging and the handoff
// buffers: between the tiles and an output warp group's 1024-byte aligned handoff they would cost
// padding.
template <class Cfg>
struct FwdStageStorage {
  using Elem = typename Cfg::Elem;
  struct Stage {
    cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutQK>, 1024> q;
    cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutQK>, 1024> k;
    cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutVt>, 1024> v;
    cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutMat>, 1024> aw;
    cute::array_aligned<Elem, cosize_v<typename Cfg::LayoutMat>, 1024> p;
  };
  struct Tiles {
    Stage stage[Cfg::Stages];
  };
  struct Gates {
    alignas(16) float gamma[Cfg::Stages][kChunk];  // a bulk copy beside the stage's tiles
  };
};

// The TMA producer: one thread streams each chunk of the CTA's range into the stage ring through
// Cfg::MainPipeline (the prep's output waited for first, per item or for the whole grid).
template <class Cfg, bool StateOnly>
struct FwdProducer {
  using SharedStorage = FwdStageStorage<Cfg>;  // the state pass loads fewer tiles into the same ring
  static __device__ __forceinline__ void run(const FwdParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                                 const SeqRange& range, int vt, int hv, int hqk, bool zero_v) {
    using C64 = typename Cfg::C64;
    using CK = typename Cfg::CK;
    using CBV = typename Cfg::CBV;
    constexpr int Stages = Cfg::Stages;
    using Load = TmaProducer<typename Cfg::MainPipeline>;
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_aw.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_p.get_tma_descriptor());
    const int32_t T = int32_t(p.total_tokens);
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(T, int32_t(Cfg::Hqk * Cfg::HeadK)));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(T, int32_t(Cfg::Hqk * Cfg::HeadK)));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(int32_t(Cfg::Hv * Cfg::HeadV), T));
    const int32_t mat_rows = int32_t(Cfg::Hv * p.num_slots * kChunk);
    Tensor mAw = p.tma_aw.get_tma_tensor(make_shape(mat_rows, int32_t(kChunk)));
    Tensor mP = p.tma_p.get_tma_tensor(make_shape(mat_rows, int32_t(kChunk)));
    const int32_t tok0 = int32_t(range.start);
    // (tile rows, tile cols, chunk) views of this CTA's part of each tensor.
    Tensor gQ = local_tile(domain_offset(make_coord(tok0, 0), mQ), Shape<C64, CK>{}, make_coord(_, hqk));
    Tensor gK = local_tile(domain_offset(make_coord(tok0, 0), mK), Shape<C64, CK>{}, make_coord(_, hqk));
    Tensor gV = local_tile(domain_offset(make_coord(0, tok0), mV), Shape<CBV, C64>{},
                           make_coord(hv * (Cfg::HeadV / Cfg::BlockV) + vt, _));
    const int32_t mat_row0 = int32_t((int64_t(hv) * p.num_slots + range.slot0) * kChunk);
    Tensor gAw = local_tile(domain_offset(make_coord(mat_row0, 0), mAw), Shape<C64, C64>{}, make_coord(_, 0));
    Tensor gP = local_tile(domain_offset(make_coord(mat_row0, 0), mP), Shape<C64, C64>{}, make_coord(_, 0));

    const float* gamma = p.gamma + (int64_t(hv) * p.num_slots + range.slot0) * kChunk;
    const uint32_t* ready = p.ready ? p.ready + int64_t(hqk) * p.num_slots + range.slot0 : nullptr;
    // Everything below reads the prep kernel's output (the sequential kernel may start early).
    // (the split context-parallel pass has waited above where it must: its prerequisite is the chain)
    if (ready == nullptr && p.job_pass != kUnchainedThenChained) wait_prerequisite_grids();

    const Load load(ss.pipelines.main);
    const int num_chunks = int(range.num_chunks());
    for (int c = 0; c < num_chunks; ++c) {
      const PipelineState<Stages> ps{c};
      const int s = ps.index();
      load.acquire(ps);
      if (ready != nullptr) wait_ready(ready + c);
      auto& st = ss.tiles.stage[s];
      Tensor sQ = make_tensor(make_smem_ptr(st.q.data()), typename Cfg::LayoutQK{});
      Tensor sK = make_tensor(make_smem_ptr(st.k.data()), typename Cfg::LayoutQK{});
      Tensor sV = make_tensor(make_smem_ptr(st.v.data()), typename Cfg::LayoutVt{});
      Tensor sAw = make_tensor(make_smem_ptr(st.aw.data()), typename Cfg::LayoutMat{});
      Tensor sP = make_tensor(make_smem_ptr(st.p.data()), typename Cfg::LayoutMat{});
      const uint32_t tx = (StateOnly ? Cfg::StateStageTxBytes : Cfg::StageTxBytes) - (zero_v ? Cfg::VTileBytes : 0u);
      load.expect(ps, tx);
      if constexpr (!StateOnly) load.tile(ps, p.tma_q, gQ(_, _, c), sQ);
      load.tile(ps, p.tma_k, gK(_, _, c), sK);
      if (!zero_v) load.tile(ps, p.tma_v, gV(_, _, c), sV);  // a transition job reads v as zeros
      load.tile(ps, p.tma_aw, gAw(_, _, c), sAw);
      if constexpr (!StateOnly) load.tile(ps, p.tma_p, gP(_, _, c), sP);
      load.bulk(ps, gamma + int64_t(c) * kChunk, ss.gates.gamma[s], uint32_t(sizeof(float) * kChunk));
    }
  }
};

// O^T -> staging (token, value) rows -> 16-byte global stores of the rows inside the sequence (rows
// past its end belong to the next sequence). The caller alternates two staging buffers by chunk,
// so the next chunk's writes cannot race this chunk's reads: they are a barrier apart.
template <class Cfg>
struct FwdEpilogue {
  // O^T staged as (token, value) rows, two buffers (by chunk parity) per consumer warp group.
  struct SharedStorage {
    cute::array_aligned<typename Cfg::Elem, Cfg::Consumers * 2 * kChunk * kOutPitch, 16> out;
  };
  template <class Acc, class Crd>
  static __device__ __forceinline__ void store_output_chunk(const Acc& accO, const Crd& crd, typename Cfg::Elem* stage_o,
                                                     typename Cfg::Elem* o_chunk, int valid, int ctid, int barrier_id) {
    using Elem = typename Cfg::Elem;
    CUTE_UNROLL
    for (int e = 0; e < size(accO); ++e) stage_o[get<1>(crd(e)) * kOutPitch + get<0>(crd(e))] = Elem(accO(e));
    cutlass::arch::NamedBarrier::sync(128, barrier_id);
    constexpr int kVecs = kRowsPerConsumer * int(sizeof(Elem)) / 16;  // 16-byte vectors per row
    CUTE_UNROLL
    for (int i = 0; i < kChunk * kVecs / 128; ++i) {
      const int idx = ctid + 128 * i, row = idx / kVecs, vec = idx % kVecs;
      if (row < valid)
        *reinterpret_cast<uint4*>(o_chunk + int64_t(row) * (Cfg::Hv * Cfg::HeadV) + vec * 8) =
            *reinterpret_cast<const uint4*>(stage_o + row * kOutPitch + vec * 8);
    }
  }
};

// The output warp group (Cfg::OutputGroup): per chunk, once the chain has handed over S^T (the
// state at the chunk's start) and Vn^T, O^T = scale (S^T Q^T) D + Vn^T P^T from shared memory.
template <class Cfg>
struct FwdOutputWarpGroup {
  // The chain's handoff, double-buffered by chunk parity: S^T at the chunk's start (v, k) and Vn^T
  // (v, t), both K-major A operands of the output GEMMs. A token array without the group.
  struct SharedStorage {
    using Elem = typename Cfg::Elem;
    static constexpr int kS = cosize_v<typename Cfg::LayoutQK>, kVn = cosize_v<typename Cfg::LayoutMat>;
    cute::array_aligned<Elem, Cfg::OutputGroup ? 2 * (kS + kVn) : 8, (Cfg::OutputGroup ? 1024 : 16)> buffers;
    __device__ Elem* s(int parity) { return buffers.data() + parity * kS; }
    __device__ Elem* vn(int parity) { return buffers.data() + 2 * kS + parity * kVn; }
  };
  static __device__ __forceinline__ void run(const FwdParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                               const SeqRange& range, int vt, int hv, int ctid, bool write_o) {
    using Elem = typename Cfg::Elem;
    using C64 = typename Cfg::C64;
    using CM = typename Cfg::CM;
    const typename Cfg::MainPipeline pipe(ss.pipelines.main);
    const typename Cfg::HandoffPipeline handoff(ss.pipelines.handoff);
    typename Cfg::MmaOut mma;
    auto thr = mma.get_thread_slice(ctid);
    Tensor accO = partition_fragment_C(mma, Shape<CM, C64>{});
    Tensor crd = thr.partition_C(make_identity_tensor(Shape<CM, C64>{}));
    const int col0 = get<1>(crd(0));
    Elem* o_base = p.o + range.start * int64_t(Cfg::Hv * Cfg::HeadV) + int64_t(hv) * Cfg::HeadV + vt * Cfg::BlockV;
    const int num_chunks = int(range.num_chunks());
    for (int c = 0; c < num_chunks; ++c) {
      const PipelineState<Cfg::Stages> ps{c};
      const PipelineState<2> hs{c};
      const int s = ps.index(), parity = hs.index();
      auto& st = ss.tiles.stage[s];
      Tensor tAS = thr.partition_fragment_A(make_tensor(make_smem_ptr(ss.handoff.s(parity)), typename Cfg::LayoutQK{}));
      Tensor tAVn = thr.partition_fragment_A(make_tensor(make_smem_ptr(ss.handoff.vn(parity)), typename Cfg::LayoutMat{}));
      Tensor tBQ = thr.partition_fragment_B(make_tensor(make_smem_ptr(st.q.data()), typename Cfg::LayoutQK{}));
      Tensor tBP = thr.partition_fragment_B(make_tensor(make_smem_ptr(st.p.data()), typename Cfg::LayoutMat{}));
      pipe.consumer_wait(ps);
      float decay[16];
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const float2 g = *reinterpret_cast<const float2*>(&ss.gates.gamma[s][col0 + 8 * i]);
        decay[2 * i] = p.scale * __expf(g.x);
        decay[2 * i + 1] = p.scale * __expf(g.y);
      }
      handoff.consumer_wait(hs);

      warpgroup_fence_operand(accO);
      warpgroup_arrive();
      wgmma_gemm(mma, tAS, tBQ, accO, true);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accO);
      CUTE_UNROLL
      for (int e = 0; e < size(accO); ++e) accO(e) *= decay[column_slot(e)];
      warpgroup_fence_operand(accO);
      warpgroup_arrive();
      wgmma_gemm(mma, tAVn, tBP, accO, false);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accO);
      handoff.consumer_release(hs);
      pipe.consumer_release(ps);

      const int valid = range.rows_in_chunk(c);
      if (write_o)
        FwdEpilogue<Cfg>::store_output_chunk(accO, crd, ss.epilogue.out.data() + parity * kChunk * kOutPitch,
                                o_base + int64_t(c) * kChunk * (Cfg::Hv * Cfg::HeadV), valid, ctid, 1);
    }
  }
};

// The CTA scheduler: which work a CTA of the forward kernel (V tile, v-head hv, grid z) runs. Without
// p.jobs, grid z is a sequence; with them (context parallelism, gdn_cp.cuh plans them), a job row,
// and in a kUnchainedThenChained launch the first half of grid z runs the unchained jobs (in the
// order p.job_order gives), the second half the chained ones.
template <class Cfg>
struct FwdScheduler {
  // Whether this CTA is in the chained half of a kUnchainedThenChained launch.
  static __device__ __forceinline__ bool in_chained_half(const FwdParams<Cfg>& p) {
    return p.job_pass == kUnchainedThenChained && blockIdx.z >= gridDim.z / 2;
  }
  // The row of p.jobs this CTA runs (grid z, less the first half's S rows in the chained half).
  static __device__ __forceinline__ int64_t job_row(const FwdParams<Cfg>& p) {
    if (in_chained_half(p)) return int64_t(blockIdx.z) - int64_t(gridDim.z / 2);
    if (p.job_pass == kUnchainedThenChained && p.job_order != nullptr) {
      const int32_t row = p.job_order[blockIdx.z];
      return row >= 0 && row < int32_t(gridDim.z / 2) ? row : int64_t(blockIdx.z);  // malformed offsets: in bounds
    }
    return blockIdx.z;
  }
  // This CTA's start state (end == false) or end state (end == true) for v-head hv: its job's, or
  // sequence blockIdx.z's in `states` ([N, Hv, K, V]); null for none.
  static __device__ __forceinline__ const float* state_pointer(const FwdParams<Cfg>& p, const float* states, int hv,
                                                              bool end) {
    if (p.jobs != nullptr) {
      const CpJob& job = p.jobs[job_row(p) * Cfg::Hv + hv];
      return end ? job.out : job.h0;
    }
    return states ? states + (int64_t(blockIdx.z) * Cfg::Hv + hv) * (int64_t(Cfg::HeadK) * Cfg::HeadV) : nullptr;
  }
  // The token range this CTA runs and its job's flags; false when it has nothing to run (an unused
  // job slot, or a job of the other half of a kUnchainedThenChained launch). A CTA of the chained
  // half waits here for the chain grid before any of its threads reads the chained start state.
  static __device__ __forceinline__ bool cta_work(const FwdParams<Cfg>& p, int hv, SeqRange& range, int32_t& job_flags) {
    if (p.jobs != nullptr) {
      const bool split = p.job_pass == kUnchainedThenChained, chained_half = in_chained_half(p);
      const CpJob& job = p.jobs[job_row(p) * Cfg::Hv + hv];
      range.start = job.start;
      range.len = job.len;
      range.slot0 = job.slot0;
      job_flags = job.flags;
      if (range.len == 0 && job.out == nullptr) return false;  // an unused slot
      const bool chained = job_flags & kJobChained;
      if (split && chained != chained_half) return false;
      // Every thread that reads the chained start state (the consumers, before the first chunk) or
      // anything after it waits for the chain grid; the unchained half never waits for it.
      if (chained_half) wait_prerequisite_grids();
    } else {
      range = sequence_range(p.cu_seqlens, blockIdx.z, p.total_tokens);
    }
    return true;
  }
};

// A consumer warp group: rows [v0, v0 + 64) of S^T through every chunk of the CTA's range (the
// three wgmma phases of the file comment), then the end state. consumer: its index among the
// consumer groups; ctid: its thread within the group.
template <class Cfg, bool StateOnly>
struct FwdChunkConsumer {
  static __device__ __forceinline__ void run(const FwdParams<Cfg>& p, typename Cfg::SharedStorage& ss,
                                                 const SeqRange& range, int num_chunks, int vt, int hv,
                                                 int32_t job_flags, bool write_o, int consumer, int ctid) {
    constexpr bool kConsumerO = !Cfg::OutputGroup && !StateOnly;  // the consumers compute O themselves
    constexpr bool kHandoff = Cfg::OutputGroup && !StateOnly;     // they hand S^T, Vn^T to the output group
    using Elem = typename Cfg::Elem;
    using C64 = typename Cfg::C64;
    using CK = typename Cfg::CK;
    using CM = typename Cfg::CM;
    constexpr int Stages = Cfg::Stages;
    typename Cfg::MmaTok mma_tok;
    typename Cfg::MmaState mma_state;
    auto thr_tok = mma_tok.get_thread_slice(ctid);
    auto thr_state = mma_state.get_thread_slice(ctid);

    Tensor accS = partition_fragment_C(mma_state, Shape<CM, CK>{});  // (v, k) state, fp32
    Tensor accX = partition_fragment_C(mma_tok, Shape<CM, C64>{});   // (v, t): S^T K^T, then Vn^T
    Tensor accO = partition_fragment_C(mma_tok, Shape<CM, C64>{});   // (v, t): O^T
    Tensor crdS = thr_state.partition_C(make_identity_tensor(Shape<CM, CK>{}));
    Tensor crdTok = thr_tok.partition_C(make_identity_tensor(Shape<CM, C64>{}));
    // Register A operands, element e at the coordinates of accumulator element e.
    Tensor fragS = make_tensor<Elem>(shape(thr_tok.partition_A(make_identity_tensor(Shape<CM, CK>{}))));
    Tensor fragX = make_tensor<Elem>(shape(thr_tok.partition_A(make_identity_tensor(Shape<CM, C64>{}))));
    Tensor fragVn = make_tensor<Elem>(shape(thr_tok.partition_A(make_identity_tensor(Shape<CM, C64>{}))));
    Tensor fragVs = make_tensor<Elem>(shape(thr_state.partition_A(make_identity_tensor(Shape<CM, C64>{}))));
    const int col0 = get<1>(crdTok(0));  // this thread's token columns: col0 + {0, 1} + 8 i

    // Initial state (fp32) into the accumulator; zeros without one, the identity for a transition job.
    const int v0 = vt * Cfg::BlockV + consumer * kRowsPerConsumer;
    // (k, v) of this thread's rows in a [K, V] state, or a [V, K] one (v_first)
    auto state_offset = [&](int kk, int vv, bool v_first = Cfg::StateVFirst) -> int64_t {
      return v_first ? int64_t(v0 + vv) * Cfg::HeadK + kk : int64_t(kk) * Cfg::HeadV + v0 + vv;
    };
    const bool identity_state = job_flags & kJobIdentityState;
    const float* h0 = FwdScheduler<Cfg>::state_pointer(p, p.initial_state, hv, false);
    CUTE_UNROLL
    for (int e = 0; e < size(accS); ++e) {
      const int vv = get<0>(crdS(e)), kk = get<1>(crdS(e));
      accS(e) = identity_state ? (kk == v0 + vv ? 1.f : 0.f) : (h0 ? h0[state_offset(kk, vv)] : 0.f);
    }
    to_operand(fragS, accS);

    // V^T in the accumulator layout by ldmatrix.trans: this thread's 16 (row half h, column block i)
    // 8x8 tiles, tile n = h + 2 i landing in word n; lane l points at stored row (token) 8 i + l % 8
    // of tile 4 q + l / 8. Byte offsets inside a stage's V tile (the same for every stage).
    uint32_t v_tile_offset[4];
    {
      Tensor sV0 = make_tensor(make_smem_ptr(ss.tiles.stage[0].v.data()), typename Cfg::LayoutVt{});
      const int lane = ctid % 32, warp = ctid / 32;
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) {
        const int n = 4 * q + lane / 8, h = n % 2, i = n / 2;
        const Elem* row = &sV0(consumer * kRowsPerConsumer + 16 * warp + 8 * h, 8 * i + lane % 8);
        v_tile_offset[q] = uint32_t(reinterpret_cast<const char*>(row) - reinterpret_cast<const char*>(ss.tiles.stage[0].v.data()));
      }
    }

    Elem* o_base = p.o + range.start * int64_t(Cfg::Hv * Cfg::HeadV) + int64_t(hv) * Cfg::HeadV + v0;
    Elem* out_stage = ss.epilogue.out.data() + consumer * 2 * kChunk * kOutPitch;

    const typename Cfg::MainPipeline pipe(ss.pipelines.main);
    const typename Cfg::HandoffPipeline handoff(ss.pipelines.handoff);
    for (int c = 0; c < num_chunks; ++c) {
      const PipelineState<Stages> ps{c};
      const PipelineState<2> hs{c};  // the handoff buffer of this chunk
      const int s = ps.index();
      auto& st = ss.tiles.stage[s];
      const float* gamma = ss.gates.gamma[s];  // the chunk's gates, in shared memory once the stage is full

      Tensor sQ = make_tensor(make_smem_ptr(st.q.data()), typename Cfg::LayoutQK{});
      Tensor sK = make_tensor(make_smem_ptr(st.k.data()), typename Cfg::LayoutQK{});
      Tensor sKt = make_tensor(make_smem_ptr(st.k.data()), typename Cfg::LayoutKt{});
      Tensor sAw = make_tensor(make_smem_ptr(st.aw.data()), typename Cfg::LayoutMat{});
      Tensor sP = make_tensor(make_smem_ptr(st.p.data()), typename Cfg::LayoutMat{});
      Tensor tBQ = thr_tok.partition_fragment_B(sQ);
      Tensor tBK = thr_tok.partition_fragment_B(sK);
      Tensor tBAw = thr_tok.partition_fragment_B(sAw);
      Tensor tBP = thr_tok.partition_fragment_B(sP);
      Tensor tBKt = thr_state.partition_fragment_B(sKt);

      pipe.consumer_wait(ps);
      const int valid = range.rows_in_chunk(c);
      if (valid < kChunk) {
        // A tail chunk's rows past the sequence end hold the next sequence's tokens or tokens no
        // sequence owns (whatever the caller's tensor or the workspace holds there; with in-kernel
        // L2 norm and the overlapped prep, even rows another prep CTA is still writing). Their weights
        // in Aw and K^T Vs are zero, but 0 x NaN is NaN, so K's and V's padding rows are zeroed
        // before any GEMM reads them. Every consumer takes part: they share the stage.
        Tensor sV = make_tensor(make_smem_ptr(st.v.data()), typename Cfg::LayoutVt{});  // (v, t)
        const int tid = ctid + 128 * consumer, stride = 128 * Cfg::Consumers;
        for (int idx = tid; idx < (kChunk - valid) * Cfg::HeadK; idx += stride)
          sK(valid + idx / Cfg::HeadK, idx % Cfg::HeadK) = Elem(0.f);
        for (int idx = tid; idx < (kChunk - valid) * Cfg::BlockV; idx += stride)
          sV(idx % Cfg::BlockV, valid + idx / Cfg::BlockV) = Elem(0.f);
        cutlass::arch::fence_view_async_shared();  // generic stores, read by wgmma (async proxy)
        cutlass::arch::NamedBarrier::sync(stride, 1 + Cfg::Consumers);
      }

      // Phase 1: S^T K^T (commit group 1, on the chain) and S^T Q^T (group 2, off it).
      warpgroup_fence_operand(fragS);
      warpgroup_fence_operand(accX);
      if constexpr (kConsumerO) warpgroup_fence_operand(accO);
      warpgroup_arrive();
      wgmma_gemm(mma_tok, fragS, tBK, accX, true);
      warpgroup_commit_batch();
      if constexpr (kConsumerO) {
        wgmma_gemm(mma_tok, fragS, tBQ, accO, true);
        warpgroup_commit_batch();
      } else if constexpr (kHandoff) {
        // Hand S^T (this chunk's start state) to the output warp group once it is done with the
        // buffer two chunks back; wgmma only reads fragS, so storing it now is safe.
        handoff.producer_acquire(hs);
        Tensor tHS = thr_tok.partition_C(make_tensor(make_smem_ptr(ss.handoff.s(hs.index())), typename Cfg::LayoutQK{}));
        CUTE_UNROLL
        for (int e = 0; e < size(fragS); e += 2) *word_at(tHS, e) = *word_at(fragS, e);
      }
      // Off the tensor cores while they run: V^T and this thread's 16 token columns' decays e^{g}.
      uint32_t v_frag[16];
      const uint32_t v_base = uint32_t(cute::cast_smem_ptr_to_uint(st.v.data()));
      if (job_flags & kJobZeroV) {  // a transition job: V is not loaded and reads as zeros
        CUTE_UNROLL
        for (int i = 0; i < 16; ++i) v_frag[i] = 0u;
      } else {
        CUTE_UNROLL
        for (int q = 0; q < 4; ++q) ldsm_x4_trans(v_base + v_tile_offset[q], v_frag + 4 * q);
      }
      float decay[16];
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const float2 g = *reinterpret_cast<const float2*>(gamma + col0 + 8 * i);
        decay[2 * i] = __expf(g.x);
        decay[2 * i + 1] = __expf(g.y);
      }
      warpgroup_wait<kConsumerO ? 1 : 0>();
      warpgroup_fence_operand(accX);

      // X^T = V^T - (S^T K^T) D, while the tensor cores still run S^T Q^T.
      CUTE_UNROLL
      for (int e = 0; e < size(accX); e += 2) {
        Elem v_pair[2];
        memcpy(v_pair, &v_frag[e / 2], sizeof(v_pair));
        *word_at(fragX, e) = pack2<Elem>(float(v_pair[0]) - decay[column_slot(e)] * accX(e),
                                         float(v_pair[1]) - decay[column_slot(e + 1)] * accX(e + 1));
      }

      // Phase 2: Vn^T = X^T Aw^T (group 3); meanwhile O^T <- scale (S^T Q^T) D once group 2 is done.
      warpgroup_fence_operand(fragX);
      warpgroup_fence_operand(accX);
      warpgroup_arrive();
      wgmma_gemm(mma_tok, fragX, tBAw, accX, true);
      warpgroup_commit_batch();
      if constexpr (kConsumerO) {
        warpgroup_wait<1>();
        warpgroup_fence_operand(accO);
        CUTE_UNROLL
        for (int e = 0; e < size(accO); ++e) accO(e) *= p.scale * decay[column_slot(e)];
        warpgroup_fence_operand(accO);
      }
      // e^{gC - g} from the gates again (shared memory): holding them since phase 1 would cost 16
      // registers while S^T's operand copy is still live.
      const float gamma_last = gamma[kChunk - 1];
      float tail[16];
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const float2 g = *reinterpret_cast<const float2*>(gamma + col0 + 8 * i);
        tail[2 * i] = __expf(gamma_last - g.x);
        tail[2 * i + 1] = __expf(gamma_last - g.y);
      }
      const float chunk_decay = __expf(gamma_last);
      CUTE_UNROLL
      for (int e = 0; e < size(accS); ++e) accS(e) *= chunk_decay;  // phase 2 does not touch S^T
      // Pin the scaling before the wait, so it overlaps phase 2 instead of following it.
      warpgroup_fence_operand(accS);
      warpgroup_wait<0>();
      warpgroup_fence_operand(accX);

      CUTE_UNROLL
      for (int e = 0; e < size(accX); e += 2) {
        *word_at(fragVn, e) = pack2<Elem>(accX(e), accX(e + 1));
        *word_at(fragVs, e) = pack2<Elem>(tail[column_slot(e)] * accX(e), tail[column_slot(e + 1)] * accX(e + 1));
      }
      if constexpr (kHandoff) {  // hand Vn^T over, then signal: S^T and Vn^T are in place
        Tensor tHVn = thr_tok.partition_C(make_tensor(make_smem_ptr(ss.handoff.vn(hs.index())), typename Cfg::LayoutMat{}));
        CUTE_UNROLL
        for (int e = 0; e < size(fragVn); e += 2) *word_at(tHVn, e) = *word_at(fragVn, e);
        cutlass::arch::fence_view_async_shared();  // generic-proxy stores, read by the other group's wgmma
        handoff.producer_commit(hs);
      }

      // Phase 3: S^T += Vs^T K (group 4, on the chain), then O^T += Vn^T P^T (group 5).
      if constexpr (!StateOnly) warpgroup_fence_operand(fragVn);
      warpgroup_fence_operand(fragVs);
      if constexpr (kConsumerO) warpgroup_fence_operand(accO);
      warpgroup_fence_operand(accS);
      warpgroup_arrive();
      wgmma_gemm(mma_state, fragVs, tBKt, accS, false);
      warpgroup_commit_batch();
      if constexpr (kConsumerO) {
        wgmma_gemm(mma_tok, fragVn, tBP, accO, false);
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        warpgroup_fence_operand(accS);
        to_operand(fragS, accS);  // the next chunk's A operand, while O^T += Vn^T P^T runs
        warpgroup_wait<0>();
        warpgroup_fence_operand(accO);
        pipe.consumer_release(ps);
        if (write_o)
          FwdEpilogue<Cfg>::store_output_chunk(accO, crdTok, out_stage + (c % 2) * kChunk * kOutPitch,
                                  o_base + int64_t(c) * kChunk * (Cfg::Hv * Cfg::HeadV), valid, ctid, 1 + consumer);
      } else {
        warpgroup_wait<0>();
        warpgroup_fence_operand(accS);
        pipe.consumer_release(ps);
        to_operand(fragS, accS);
      }
    }

    // Looked up again here rather than kept in registers across the loop.
    float* state_out = const_cast<float*>(FwdScheduler<Cfg>::state_pointer(p, p.final_state, hv, true));
    if (state_out) {
      // A state only the exact chain reads (a transition M, identity start) is stored v-major,
      // (k, v) at v K + k, whatever the state layout: the chain reads M down its columns by one bulk
      // copy per step (gdn_cp.cuh).
      const bool v_major = StateOnly && (job_flags & kJobIdentityState);
      CUTE_UNROLL
      for (int e = 0; e < size(accS); ++e) {
        const int vv = get<0>(crdS(e)), kk = get<1>(crdS(e));
        state_out[state_offset(kk, vv, Cfg::StateVFirst || v_major)] = accS(e);
      }
    }
  }
};

// The forward kernel's shared memory: its collectives' storage, then the barriers of its pipelines.
template <class Cfg>
struct alignas(1024) FwdSharedStorage {
  typename FwdStageStorage<Cfg>::Tiles tiles;               // FwdProducer's stage ring
  typename FwdEpilogue<Cfg>::SharedStorage epilogue;        // O staging
  typename FwdOutputWarpGroup<Cfg>::SharedStorage handoff;  // consumers -> output warp group
  typename FwdStageStorage<Cfg>::Gates gates;               // the stage ring's gates
  struct Pipelines {
    typename Cfg::MainPipeline::Storage main;
    typename Cfg::HandoffPipeline::Storage handoff;
  } pipelines;
};

// StateOnly: the context-parallel state pass (windows, H, M): the chain alone, without the O GEMMs,
// the O stores or the output warp group's handoffs.
template <class Cfg, bool StateOnly = false>
__global__ void __launch_bounds__(Cfg::Threads, Cfg::CtasPerSm) gdn_fwd_kernel(CUTE_GRID_CONSTANT const FwdParams<Cfg> p) {
  constexpr bool kHandoff = Cfg::OutputGroup && !StateOnly;  // the consumers hand S^T, Vn^T to the output group
  constexpr int G = Cfg::Hv / Cfg::Hqk;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int hqk = hv / G;
  SeqRange range;
  int32_t job_flags = 0;
  if (!FwdScheduler<Cfg>::cta_work(p, hv, range, job_flags)) return;  // uniform: the whole CTA
  const bool write_o = !(job_flags & kJobNoOutput);
  const int num_chunks = int(range.num_chunks());
  using Roles = FwdWarpRoles<Cfg>;
  const int warp_group = threadIdx.x / Roles::kThreads;

  if (threadIdx.x == Roles::kLoadIssuer) {
    Cfg::MainPipeline::init(ss.pipelines.main, 1, 128 * (Cfg::Consumers + (kHandoff ? 1 : 0)));
    Cfg::HandoffPipeline::init(ss.pipelines.handoff, 128, 128);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == Roles::kProducer) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::ProducerRegs>();
    if (threadIdx.x == Roles::kLoadIssuer) {
      FwdProducer<Cfg, StateOnly>::run(p, ss, range, vt, hv, hqk, job_flags & kJobZeroV);
      // An unchained CTA of the split pass never waited for the chain, its prerequisite grid. Waiting
      // before it exits keeps the launch from completing ahead of the chain, so whatever the stream
      // runs next (which may reuse this call's scratch) starts after both.
      if (p.job_pass == kUnchainedThenChained) wait_prerequisite_grids();
    }
    return;
  }
  if constexpr (Cfg::OutputGroup) {
    if (warp_group == Roles::kOutput) {  // keeps the launch-time registers
      if constexpr (!StateOnly)
        FwdOutputWarpGroup<Cfg>::run(p, ss, range, vt, hv, threadIdx.x - Roles::kThreads * warp_group, write_o);
      return;
    }
  }

  // ---------------- consumers: rows [v0, v0 + 64) of S^T ----------------
  cutlass::arch::warpgroup_reg_alloc<Cfg::ConsumerRegs>();
  FwdChunkConsumer<Cfg, StateOnly>::run(p, ss, range, num_chunks, vt, hv, job_flags, write_o,
                                        warp_group - Roles::kFirstConsumer, threadIdx.x - Roles::kThreads * warp_group);
}

}  // namespace fqt
