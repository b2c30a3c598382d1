// FLA's in-kernel gate and beta options (FLA 0.6.0 chunk_gated_delta_rule), as one typed option of
// the prep kernel and the context-parallel guard: the only two places that read the call's g and
// beta. Everything after them reads what the prep wrote (gamma, Aw, P), so the sequential kernel,
// the state passes and the exact chain see the transformed values without knowing the option.
//
//   GateInKernel:  g    = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])   (dt_bias may be absent)
//   BetaSigmoid:   beta = sigmoid(b_raw)
//   NegEigval:     beta = 2 sigmoid(b_raw), in (0, 2); FLA takes it only with BetaSigmoid
//
// softplus follows FLA (fla/ops/utils/softplus.py) and torch.nn.functional.softplus: x above 20
// is returned as is, else log(1 + e^x). All math is fp32 from the fp32 inputs. The prep and the
// guard call the same functions on the same values, so the guard sums the gates the prep scans
// (to the last bit where nvcc contracts a sum into an FMA differently) and a window's bound holds
// for the betas the chunks actually use.
#pragma once
#include <cuda_runtime.h>

namespace fqt {

// The gate's per-v-head parameters: fp32 [Hv] on the device. a_log is read only with
// GateInKernel; dt_bias may be null (no bias, as FLA's dt_bias=None).
struct GateInputs {
  const float* a_log;
  const float* dt_bias;
};

template <bool GateInKernel_, bool BetaSigmoid_, bool NegEigval_>
struct GateOptions {
  static constexpr bool GateInKernel = GateInKernel_;
  static constexpr bool BetaSigmoid = BetaSigmoid_;
  static constexpr bool NegEigval = NegEigval_;
  // Whether g and beta are used exactly as the caller passed them.
  static constexpr bool Precomputed = !GateInKernel && !BetaSigmoid;
  static_assert(BetaSigmoid || !NegEigval, "allow_neg_eigval scales the in-kernel sigmoid (FLA takes it only so)");

  // The log-decay of a valid token of v-head hv from the caller's g.
  __device__ __forceinline__ static float gate(float g, const GateInputs& in, int hv) {
    if constexpr (GateInKernel) {
      const float x = in.dt_bias != nullptr ? g + in.dt_bias[hv] : g;
      const float softplus = x > 20.f ? x : log1pf(expf(x));
      return -expf(in.a_log[hv]) * softplus;
    } else {
      return g;
    }
  }

  // The beta of a valid token from the caller's beta.
  __device__ __forceinline__ static float beta(float b) {
    if constexpr (BetaSigmoid) {
      const float s = 1.f / (1.f + expf(-b));
      return NegEigval ? 2.f * s : s;
    } else {
      return b;
    }
  }
};

// g and beta as the caller computed them (the op's default).
using PrecomputedGates = GateOptions<false, false, false>;

}  // namespace fqt
