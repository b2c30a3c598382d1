// The sequential GDN forward on Hopper: one CTA per (V tile, v-head, sequence) walks the
// sequence chunk by chunk, keeping its [K x block_v] slice of the state S in fp32 registers.
//
// Warp group 0 is the producer: one thread streams each chunk's q, k, v and the prepared Aw
// and P tiles into a ring of shared-memory stages with TMA (bulk tensor copies completing on
// mbarriers). Warp group 1 does the math on the tensor cores (wgmma), per chunk:
//   KS = K S, QS = Q S                 (S read as bf16/fp16 from shared memory)
//   W  = V - D KS                      -> smem
//   Vn = Aw W                          -> smem, and Vs = diag(e^{gC - g}) Vn -> smem
//   O  = scale D QS + P Vn             -> global (rows past the sequence end are not stored)
//   S  = e^{gC} S + K^T Vs             (accumulated in registers)
// The register budget is split between the two roles with setmaxnreg.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "gdn_sequences.cuh"
#include "gdn_wgmma.cuh"

namespace fqt {

using namespace cute;

template <class Elem_, int Hqk_, int Hv_, int HeadK_, int HeadV_, int BlockV_, int Stages_, bool StateVFirst_,
          int ProducerRegs_, int ConsumerRegs_, int CtasPerSm_ = 1>
struct FwdConfig {
  using Elem = Elem_;
  static constexpr int Hqk = Hqk_, Hv = Hv_, HeadK = HeadK_, HeadV = HeadV_;
  static constexpr int BlockV = BlockV_, Stages = Stages_;
  static constexpr bool StateVFirst = StateVFirst_;
  static constexpr int ProducerRegs = ProducerRegs_, ConsumerRegs = ConsumerRegs_;
  static constexpr int Threads = 256;
  // Launch bounds cap registers at 65536 / (Threads * CtasPerSm) per thread; setmaxnreg then moves
  // them from the producer to the math warp group inside that pool.
  static constexpr int CtasPerSm = CtasPerSm_;
  static_assert(CtasPerSm == 1 || CtasPerSm == 2, "one or two CTAs per SM");
  static_assert(ProducerRegs + ConsumerRegs <= 2 * (65536 / (Threads * CtasPerSm)),
                "the register split exceeds the pool the launch bounds leave");
  static_assert(HeadK == 128, "the shared-memory layouts assume K = 128");
  static_assert(HeadV % BlockV == 0, "block_v must divide V");

  using C64 = Int<kChunk>;
  using CK = Int<HeadK>;
  using CBV = Int<BlockV>;

  // Q, K tiles as (token, k): K-major A operands of KS/QS; K's transposed view (k, token) is
  // the MN-major A operand of K^T Vs.
  using LayoutQK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, CK>{}));
  using LayoutKt = decltype(composition(LayoutQK{}, make_layout(Shape<CK, C64>{}, GenRowMajor{})));
  // Aw, P as (i, j): K-major A operands.
  using LayoutMat = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<C64, C64>{}));
  // V-like tiles stored (v, token), v contiguous: MN-major B operands of Aw W, P Vn, K^T Vs.
  using AtomVt = std::conditional_t<BlockV % 64 == 0, GMMA::Layout_MN_SW128_Atom<Elem>, GMMA::Layout_MN_SW64_Atom<Elem>>;
  using LayoutVt = decltype(tile_to_shape(AtomVt{}, Shape<CBV, C64>{}));
  using LayoutTV = decltype(composition(LayoutVt{}, make_layout(Shape<C64, CBV>{}, GenRowMajor{})));  // (token, v) view
  // S stored (v, k), v contiguous: MN-major B operand of KS/QS; (k, v) view for writing it.
  using LayoutSt = decltype(tile_to_shape(AtomVt{}, Shape<CBV, CK>{}));
  using LayoutKV = decltype(composition(LayoutSt{}, make_layout(Shape<CK, CBV>{}, GenRowMajor{})));

  // M = 64 token rows: A K-major, B MN-major.
  using MmaTok = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<C64, CBV, C64>,
                                                              GMMA::Major::K, GMMA::Major::MN>()));
  // M = 128 state rows (two atoms stacked by one warp group): A and B MN-major.
  using MmaState = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, CBV, C64>,
                                                                GMMA::Major::MN, GMMA::Major::MN>()));

  struct Stage {
    cute::array_aligned<Elem, cosize_v<LayoutQK>, 1024> q;
    cute::array_aligned<Elem, cosize_v<LayoutQK>, 1024> k;
    cute::array_aligned<Elem, cosize_v<LayoutVt>, 1024> v;
    cute::array_aligned<Elem, cosize_v<LayoutMat>, 1024> aw;
    cute::array_aligned<Elem, cosize_v<LayoutMat>, 1024> p;
  };
  struct alignas(1024) SharedStorage {
    Stage stage[Stages];
    cute::array_aligned<Elem, cosize_v<LayoutSt>, 1024> s;
    cute::array_aligned<Elem, cosize_v<LayoutVt>, 1024> w;
    cute::array_aligned<Elem, cosize_v<LayoutVt>, 1024> vn;
    cute::array_aligned<Elem, cosize_v<LayoutVt>, 1024> vs;
    uint64_t full[Stages];
    uint64_t empty[Stages];
  };
  static constexpr int SmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t StageTxBytes =
      uint32_t(sizeof(Elem)) * (2 * cosize_v<LayoutQK> + cosize_v<LayoutVt> + 2 * cosize_v<LayoutMat>);

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

template <class Cfg>
struct FwdParams {
  typename Cfg::TmaQK tma_q;
  typename Cfg::TmaQK tma_k;
  typename Cfg::TmaV tma_v;
  typename Cfg::TmaMat tma_aw;
  typename Cfg::TmaMat tma_p;
  const float* gamma;          // [Hv, slots * 64]
  const int64_t* cu_seqlens;
  const float* initial_state;  // may be null
  float* final_state;          // may be null
  typename Cfg::Elem* o;       // [T, Hv, V]
  int64_t total_tokens;
  int64_t num_seqs;
  int64_t num_slots;
  float scale;
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::Threads, Cfg::CtasPerSm) gdn_fwd_kernel(CUTE_GRID_CONSTANT const FwdParams<Cfg> p) {
  using Elem = typename Cfg::Elem;
  using C64 = typename Cfg::C64;
  using CK = typename Cfg::CK;
  using CBV = typename Cfg::CBV;
  constexpr int Stages = Cfg::Stages;
  constexpr int G = Cfg::Hv / Cfg::Hqk;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int64_t seq = blockIdx.z;
  const int hqk = hv / G;
  const SeqRange range = sequence_range(p.cu_seqlens, seq, p.total_tokens);
  const int num_chunks = int(range.num_chunks());
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) {
      FullBarrier::init(&ss.full[s], 1);
      EmptyBarrier::init(&ss.empty[s], 128);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == 0) {
    // ---------------- producer ----------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::ProducerRegs>();
    if (threadIdx.x == 0) {
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

      for (int c = 0; c < num_chunks; ++c) {
        const int s = c % Stages;
        if (c >= Stages) EmptyBarrier::wait(&ss.empty[s], ((c / Stages) & 1) ^ 1);
        auto& st = ss.stage[s];
        Tensor sQ = make_tensor(make_smem_ptr(st.q.data()), typename Cfg::LayoutQK{});
        Tensor sK = make_tensor(make_smem_ptr(st.k.data()), typename Cfg::LayoutQK{});
        Tensor sV = make_tensor(make_smem_ptr(st.v.data()), typename Cfg::LayoutVt{});
        Tensor sAw = make_tensor(make_smem_ptr(st.aw.data()), typename Cfg::LayoutMat{});
        Tensor sP = make_tensor(make_smem_ptr(st.p.data()), typename Cfg::LayoutMat{});
        FullBarrier::arrive_and_expect_tx(&ss.full[s], Cfg::StageTxBytes);
        auto tma_copy = [&](auto& tma, auto gsrc, auto sdst) {
          auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdst), group_modes<0, 2>(gsrc));
          copy(tma.with(ss.full[s]), tg, ts);
        };
        tma_copy(p.tma_q, gQ(_, _, c), sQ);
        tma_copy(p.tma_k, gK(_, _, c), sK);
        tma_copy(p.tma_v, gV(_, _, c), sV);
        tma_copy(p.tma_aw, gAw(_, _, c), sAw);
        tma_copy(p.tma_p, gP(_, _, c), sP);
      }
    }
    return;
  }

  // ---------------- consumer (math warp group) ----------------
  cutlass::arch::warpgroup_reg_alloc<Cfg::ConsumerRegs>();
  const int ctid = threadIdx.x - 128;
  typename Cfg::MmaTok mma_tok;
  typename Cfg::MmaState mma_state;
  auto thr_tok = mma_tok.get_thread_slice(ctid);
  auto thr_state = mma_state.get_thread_slice(ctid);

  Tensor sS = make_tensor(make_smem_ptr(ss.s.data()), typename Cfg::LayoutSt{});     // (v, k)
  Tensor sSkv = make_tensor(make_smem_ptr(ss.s.data()), typename Cfg::LayoutKV{});   // (k, v)
  Tensor sW = make_tensor(make_smem_ptr(ss.w.data()), typename Cfg::LayoutVt{});
  Tensor sVn = make_tensor(make_smem_ptr(ss.vn.data()), typename Cfg::LayoutVt{});
  Tensor sVs = make_tensor(make_smem_ptr(ss.vs.data()), typename Cfg::LayoutVt{});
  Tensor sW_tv = make_tensor(make_smem_ptr(ss.w.data()), typename Cfg::LayoutTV{});
  Tensor sVn_tv = make_tensor(make_smem_ptr(ss.vn.data()), typename Cfg::LayoutTV{});
  Tensor sVs_tv = make_tensor(make_smem_ptr(ss.vs.data()), typename Cfg::LayoutTV{});

  // Accumulators and their (row, col) coordinates.
  Tensor accS = partition_fragment_C(mma_state, Shape<CK, CBV>{});   // (k, v) state
  Tensor accKS = partition_fragment_C(mma_tok, Shape<C64, CBV>{});   // (token, v): K S, then Aw W
  Tensor accO = partition_fragment_C(mma_tok, Shape<C64, CBV>{});
  auto& accVn = accKS;  // K S is dead once W is in shared memory
  Tensor crdS = thr_state.partition_C(make_identity_tensor(Shape<CK, CBV>{}));
  Tensor crdTok = thr_tok.partition_C(make_identity_tensor(Shape<C64, CBV>{}));
  Tensor tSsS = thr_state.partition_C(sSkv);
  Tensor tWsW = thr_tok.partition_C(sW_tv);
  Tensor tVnsVn = thr_tok.partition_C(sVn_tv);
  Tensor tVssVs = thr_tok.partition_C(sVs_tv);
  const int row0 = get<0>(crdTok(0));  // this thread's accumulator rows: row0 and row0 + 8

  // Operand descriptors for the fixed buffers.
  Tensor tBS = thr_tok.partition_fragment_B(sS);      // S as B of KS / QS
  Tensor tBW = thr_tok.partition_fragment_B(sW);
  Tensor tBVn = thr_tok.partition_fragment_B(sVn);
  Tensor tBVs = thr_state.partition_fragment_B(sVs);

  // Initial state (fp32) into the accumulator; zeros without one.
  const int v0 = vt * Cfg::BlockV;
  const int64_t state_base = (seq * Cfg::Hv + hv) * int64_t(Cfg::HeadK * Cfg::HeadV);
  auto state_offset = [&](int kk, int vv) -> int64_t {
    return Cfg::StateVFirst ? int64_t(v0 + vv) * Cfg::HeadK + kk : int64_t(kk) * Cfg::HeadV + v0 + vv;
  };
  CUTE_UNROLL
  for (int e = 0; e < size(accS); ++e) {
    const int kk = get<0>(crdS(e)), vv = get<1>(crdS(e));
    accS(e) = p.initial_state ? p.initial_state[state_base + state_offset(kk, vv)] : 0.f;
  }
  auto store_state_smem = [&]() {
    CUTE_UNROLL
    for (int e = 0; e < size(accS); e += 2) *word_at(tSsS, e) = pack2<Elem>(accS(e), accS(e + 1));
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, 1);
  };
  store_state_smem();

  const float* gamma_base = p.gamma + (int64_t(hv) * p.num_slots + range.slot0) * kChunk;
  Elem* o_base = p.o + range.start * int64_t(Cfg::Hv * Cfg::HeadV) + int64_t(hv) * Cfg::HeadV + v0;

  for (int c = 0; c < num_chunks; ++c) {
    const int s = c % Stages;
    auto& st = ss.stage[s];
    // Each thread's accumulator rows are row0 and row0 + 8: keep their gates in registers
    // (re-reading global memory per element would be ordered behind every shared store).
    const float* gamma = gamma_base + int64_t(c) * kChunk;
    const float gamma_last = __ldg(gamma + kChunk - 1);
    const float gamma_r0 = __ldg(gamma + row0), gamma_r1 = __ldg(gamma + row0 + 8);
    const float d_r0 = __expf(gamma_r0), d_r1 = __expf(gamma_r1);
    const float tail_r0 = __expf(gamma_last - gamma_r0), tail_r1 = __expf(gamma_last - gamma_r1);
    FullBarrier::wait(&ss.full[s], (c / Stages) & 1);

    Tensor sQ = make_tensor(make_smem_ptr(st.q.data()), typename Cfg::LayoutQK{});
    Tensor sK = make_tensor(make_smem_ptr(st.k.data()), typename Cfg::LayoutQK{});
    Tensor sKt = make_tensor(make_smem_ptr(st.k.data()), typename Cfg::LayoutKt{});
    Tensor sV_tv = make_tensor(make_smem_ptr(st.v.data()), typename Cfg::LayoutTV{});
    Tensor sAw = make_tensor(make_smem_ptr(st.aw.data()), typename Cfg::LayoutMat{});
    Tensor sP = make_tensor(make_smem_ptr(st.p.data()), typename Cfg::LayoutMat{});
    Tensor tAQ = thr_tok.partition_fragment_A(sQ);
    Tensor tAK = thr_tok.partition_fragment_A(sK);
    Tensor tAAw = thr_tok.partition_fragment_A(sAw);
    Tensor tAP = thr_tok.partition_fragment_A(sP);
    Tensor tAKt = thr_state.partition_fragment_A(sKt);
    Tensor tVsV = thr_tok.partition_C(sV_tv);

    // KS = K S, QS = Q S
    warpgroup_fence_operand(accKS);
    warpgroup_fence_operand(accO);
    warpgroup_arrive();
    wgmma_gemm(mma_tok, tAK, tBS, accKS, true);
    wgmma_gemm(mma_tok, tAQ, tBS, accO, true);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accKS);
    warpgroup_fence_operand(accO);

    // W = V - D KS -> smem; O <- scale D QS
    CUTE_UNROLL
    for (int e = 0; e < size(accKS); e += 2) {
      const float d = get<0>(crdTok(e)) == row0 ? d_r0 : d_r1;
      *word_at(tWsW, e) = pack2<Elem>(float(tVsV(e)) - d * accKS(e), float(tVsV(e + 1)) - d * accKS(e + 1));
      accO(e) *= p.scale * d;
      accO(e + 1) *= p.scale * d;
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, 1);

    // Vn = Aw W
    warpgroup_fence_operand(accVn);
    warpgroup_arrive();
    wgmma_gemm(mma_tok, tAAw, tBW, accVn, true);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accVn);

    CUTE_UNROLL
    for (int e = 0; e < size(accVn); e += 2) {
      const float tail = get<0>(crdTok(e)) == row0 ? tail_r0 : tail_r1;
      *word_at(tVnsVn, e) = pack2<Elem>(accVn(e), accVn(e + 1));
      *word_at(tVssVs, e) = pack2<Elem>(tail * accVn(e), tail * accVn(e + 1));
    }
    const float chunk_decay = __expf(gamma_last);
    CUTE_UNROLL
    for (int e = 0; e < size(accS); ++e) accS(e) *= chunk_decay;
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, 1);

    // O += P Vn ; S += K^T Vs
    warpgroup_fence_operand(accO);
    warpgroup_fence_operand(accS);
    warpgroup_arrive();
    wgmma_gemm(mma_tok, tAP, tBVn, accO, false);
    wgmma_gemm(mma_state, tAKt, tBVs, accS, false);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accO);
    warpgroup_fence_operand(accS);
    EmptyBarrier::arrive(&ss.empty[s]);

    // O rows past the sequence end belong to the next sequence: skip them.
    const int valid = int(min<int64_t>(kChunk, range.len - int64_t(c) * kChunk));
    Elem* o_chunk = o_base + int64_t(c) * kChunk * (Cfg::Hv * Cfg::HeadV);
    CUTE_UNROLL
    for (int e = 0; e < size(accO); e += 2) {
      const int row = get<0>(crdTok(e)), col = get<1>(crdTok(e));
      if (row < valid)
        *reinterpret_cast<uint32_t*>(o_chunk + int64_t(row) * (Cfg::Hv * Cfg::HeadV) + col) =
            pack2<Elem>(accO(e), accO(e + 1));
    }
    store_state_smem();
  }

  if (p.final_state) {
    CUTE_UNROLL
    for (int e = 0; e < size(accS); ++e) {
      const int kk = get<0>(crdS(e)), vv = get<1>(crdS(e));
      p.final_state[state_base + state_offset(kk, vv)] = accS(e);
    }
  }
}

}  // namespace fqt
