// Host-side launch ABI shared by every rendered GDN kernel library and the Python loader.
//
// Each rendered .cu is built into one shared library that exports these extern "C" symbols;
// the runtime calls them through ctypes, so loading never needs a PyTorch C++ extension.
// Keep this struct in sync with flashqla_tune/abi.py (a test compares the two).
#pragma once
#include <stdint.h>

#define FQT_ABI_VERSION 4

// Libraries build with -fvisibility=hidden (flashqla_tune/build.py) and export only these
// functions. Hidden, the launcher's per-device static state stays private to each library:
// with default visibility g++ makes it a GNU-unique symbol, so a second library of the same
// plan in one process (a rebuilt cache entry, a pack beside the cache, a measurement variant)
// shared the first one's state and launched without its own shared-memory attributes.
#define FQT_EXPORT __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

enum { FQT_PREP_AUTO = 0, FQT_PREP_SERIAL = 1, FQT_PREP_OVERLAP = 2 };

typedef struct FqtGdnFwdArgs {
  // Inputs. Tokens of all sequences are packed: q, k [T, Hqk, K]; v [T, Hv, V]; g, beta [T, Hv] fp32.
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  // [N + 1] int64 token offsets on the device; values are clamped in-kernel, so any content is safe.
  const int64_t* cu_seqlens;
  // fp32 [N, Hv, K, V] (or [N, Hv, V, K] for the state_v_first layout); either may be null. They
  // must not overlap with context parallelism (one segment reads h0 while another writes the end).
  const float* initial_state;
  float* final_state;
  // Output [T, Hv, V], same dtype as q/k/v.
  void* o;
  // Scratch of fqt_gdn_fwd_workspace_bytes(total_tokens, num_seqs, max_segments) bytes, 256-byte aligned.
  void* workspace;
  int64_t total_tokens;
  int64_t num_seqs;
  float scale;
  int32_t use_qk_l2norm;  // normalise q and k rows in-kernel: x / sqrt(sum x^2 + 1e-6)
  // FQT_PREP_AUTO: overlap the prep and sequential kernels when the sequential grid leaves enough
  // SMs idle (gdn_fwd_host.cuh has the rule); FQT_PREP_SERIAL / FQT_PREP_OVERLAP force one
  // schedule; other values are refused (cudaErrorInvalidValue). For well-formed cu_seqlens the
  // results are the same bit for bit (tests and benchmarks compare them); offsets that overlap
  // after clamping give unspecified rows, never an out-of-bounds access.
  int32_t prep_schedule;
  // Warm-up context parallelism (gdn_cp.cuh); off when warmup is null. warmup: int32 [Hv] on the
  // device, n_h >= 1 warm-up chunks or -1 (chain exactly). segment_chunks: int32 [32] on the
  // device, entry b the segment length (chunks) of sequences of at most 2^b chunks, 0 = no split.
  // max_segments: an upper bound on the call's segments (>= num_seqs; sizes the workspace and the
  // grids; at most 21845), computed on the host from the table, total_tokens and num_seqs.
  // A warm-up window is used only where its summed log-decay is at most log_eps and every token
  // keeps 0 <= beta ||k||^2 <= 2; every other boundary is chained exactly. The prep schedule is
  // then serial.
  const int32_t* warmup;
  const int32_t* segment_chunks;
  int64_t max_segments;
  float log_eps;
  // With warmup: how many of its entries are -1. Those heads chain exactly on every input (a
  // failed guard adds more), so the exact chain's launch sizes its column slices from it.
  int32_t exact_heads;
  // FLA's in-kernel gate (a plan with gate_in_kernel): fp32 [Hv] A_log and dt_bias on the device,
  // g = -exp(A_log) * softplus(g + dt_bias) per token; dt_bias may be null (no bias). A plan
  // without it reads neither. Appended last: a library built before these fields reads none.
  const float* a_log;
  const float* dt_bias;
} FqtGdnFwdArgs;

// ABI version the library was built against (FQT_ABI_VERSION).
FQT_EXPORT int32_t fqt_abi_version(void);
// JSON text describing the compiled plan (spec and tile parameters), for checks at load time.
FQT_EXPORT const char* fqt_plan_json(void);
// Bytes of scratch a call with these sizes needs (max_segments: 0 without context parallelism).
FQT_EXPORT int64_t fqt_gdn_fwd_workspace_bytes(int64_t total_tokens, int64_t num_seqs, int64_t max_segments);
// Enqueue the forward on `stream` (a cudaStream_t). Returns 0 or a cudaError_t code; never syncs.
FQT_EXPORT int32_t fqt_gdn_fwd(const FqtGdnFwdArgs* args, void* stream);
// Message for a code returned above.
FQT_EXPORT const char* fqt_error_string(int32_t code);

#ifdef __cplusplus
}
#endif
