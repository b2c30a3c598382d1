// The eager op's host path in C++ (flashqla_tune/host_path.py builds it as a torch extension; a
// kernel pack carries it prebuilt).
//
// A SignatureContext holds what the Python op settled once for a call signature (heads, dtype,
// device, state layout, warm-up table): the plan library's entry points and the CP tables. Per call,
// `forward` checks the tensors against it, allocates o, the final state and the scratch from
// torch's caching allocator and launches the library on the stream the caller passes: one
// crossing from Python instead of a few dozen small Python steps.
//
// It never raises on input: whatever it does not take as is (a dtype to convert, a strided
// tensor or one off a 16-byte boundary, shapes that do not fit, grad-requiring inputs, offsets to
// refuse, a CP bound over the limits) returns None, and the Python op runs its checked path, which
// owns every error message and conversion. Both paths call the same library with the same
// arguments, so their outputs are the same bit for bit (tests/test_host_path.py,
// tests/test_gpu_forward.py).
//
// No CUDA header: tensors are allocated through ATen's dispatcher and the stream is an integer.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gdn_abi.h"
#include "gdn_segment_policy.h"

namespace py = pybind11;

namespace {

// The plan library's two entry points a context calls (csrc/gdn_abi.h).
using LibraryLaunchFn = int32_t (*)(const FqtGdnFwdArgs*, void*);
using LibraryWorkspaceBytesFn = int64_t (*)(int64_t, int64_t, int64_t);

using fqt::bucket_of_chunks;  // the segment policy: csrc/gdn_segment_policy.h
using fqt::kMaxSequences;
using fqt::kMaxTokens;
using fqt::kSegmentBuckets;
using fqt::segments_of;

struct SignatureContext {
  LibraryLaunchFn launch = nullptr;
  LibraryWorkspaceBytesFn workspace_bytes = nullptr;
  at::Device device{at::kCPU};
  at::ScalarType qkv_dtype = at::kBFloat16;
  int64_t hqk = 0, hv = 0, head_k = 0, head_v = 0;
  bool state_v_first = false;
  // Context parallelism (warmup_tables.WarmupTables); warmup_ptr == 0: off.
  int64_t warmup_ptr = 0, segment_chunks_ptr = 0;
  double log_eps = 0.0;
  std::vector<int64_t> lengths, top_extra, top_shortest;  // warmup_tables.SegmentBound
  int64_t max_segments = 0, scratch_limit_bytes = 0, bytes_per_segment = 0;
  int32_t exact_heads = 0;  // the warm-up table's -1 entries (FqtGdnFwdArgs.exact_heads)

  bool splits() const {
    return warmup_ptr != 0 && std::any_of(lengths.begin(), lengths.end(), [](int64_t n) { return n != 0; });
  }

  // warmup_tables.SegmentBound.__call__
  int64_t bound(int64_t total_tokens, int64_t num_seqs) const {
    const int64_t chunks = total_tokens / 64 + num_seqs;
    const int64_t longest = (total_tokens + 63) / 64;
    const int part = bucket_of_chunks(longest);
    int64_t per_seq = part > 0 ? top_extra[part - 1] : 0;
    int64_t shortest = part > 0 ? top_shortest[part - 1] : 0;
    const int64_t length = lengths[part];
    if (0 < length && length < longest) {
      per_seq = std::max(per_seq, segments_of(longest, length) - 1);
      shortest = shortest == 0 ? length : std::min(shortest, length);
    }
    const int64_t extra = per_seq ? std::min(num_seqs * per_seq, chunks / shortest) : 0;
    return num_seqs + extra;
  }

  // warmup_tables.call_segments; -1 where Python must decide (it warns that CP is off for the call).
  int64_t call_segments(int64_t total_tokens, int64_t num_seqs, int64_t longest_tokens) const {
    if (!splits()) return 0;
    if (0 < longest_tokens && longest_tokens <= total_tokens && bound(longest_tokens, 1) == 1) return 0;
    const int64_t segments = bound(total_tokens, num_seqs);
    if (segments == num_seqs) return 0;
    if (segments > max_segments || segments * bytes_per_segment > scratch_limit_bytes) return -1;
    return segments;
  }
};

bool on(const at::Tensor& t, const at::Device& device) { return t.device() == device; }

// The longest sequence of host offsets that pass ops._check_offsets, or -1 (Python refuses them).
int64_t longest_of_offsets(const at::Tensor& cpu, int64_t expected_len, int64_t total_tokens) {
  if (cpu.device().type() != at::kCPU || cpu.dim() != 1 || cpu.numel() != expected_len || !cpu.is_contiguous())
    return -1;
  auto scan = [&](auto* values) -> int64_t {
    if (values[0] != 0) return -1;
    int64_t longest = 0;
    for (int64_t i = 1; i < expected_len; ++i) {
      if (values[i] < values[i - 1]) return -1;
      longest = std::max<int64_t>(longest, int64_t(values[i]) - int64_t(values[i - 1]));
    }
    return int64_t(values[expected_len - 1]) <= total_tokens ? longest : -1;
  };
  if (cpu.scalar_type() == at::kLong) return scan(cpu.data_ptr<int64_t>());
  if (cpu.scalar_type() == at::kInt) return scan(cpu.data_ptr<int32_t>());
  return -1;
}

// None (the Python path takes the call) or (o, final_state or None, CUDA error code).
py::object forward(const SignatureContext& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, const c10::optional<at::Tensor>& cu_seqlens,
                   const c10::optional<at::Tensor>& cu_seqlens_cpu, const c10::optional<at::Tensor>& initial_state,
                   const c10::optional<double>& scale, bool output_final_state, bool use_qk_l2norm, int64_t stream) {
  const py::object fallback = py::none();
  // Shapes, dtypes, devices and layouts exactly as the library reads them (ops.check_inputs and
  // runtime.forward without a conversion).
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.dim() != 4) return fallback;
  const int64_t B = q.size(0), T = q.size(1);
  if (q.size(2) != c.hqk || q.size(3) != c.head_k || v.size(0) != B || v.size(1) != T || v.size(2) != c.hv ||
      v.size(3) != c.head_v || B * T == 0)  // no tokens: the Python path returns without a launch
    return fallback;
  if (q.scalar_type() != c.qkv_dtype || k.scalar_type() != c.qkv_dtype || v.scalar_type() != c.qkv_dtype)
    return fallback;
  const std::array<int64_t, 3> gate_shape{B, T, c.hv};
  for (const at::Tensor* t : {&g, &beta})
    if (t->sizes() != at::IntArrayRef(gate_shape) || t->scalar_type() != at::kFloat) return fallback;
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
    if (!on(*t, c.device) || !t->is_contiguous()) return fallback;
  // TMA needs q, k and v to start on a 16-byte boundary; the Python path copies a view that does not
  for (const at::Tensor* t : {&q, &k, &v})
    if (reinterpret_cast<std::uintptr_t>(t->data_ptr()) % 16 != 0) return fallback;
  if (at::GradMode::is_enabled())
    for (const at::Tensor* t : {&q, &k, &v, &g, &beta})
      if (t->requires_grad()) return fallback;

  int64_t N = B, longest = T;
  at::Tensor cu;
  if (cu_seqlens.has_value()) {
    cu = *cu_seqlens;
    if (B != 1 || cu.dim() != 1 || cu.numel() < 2 || !on(cu, c.device) ||
        (cu.scalar_type() != at::kLong && cu.scalar_type() != at::kInt))
      return fallback;
    N = cu.numel() - 1;
    longest = 0;  // unknown without the host offsets
    if (cu_seqlens_cpu.has_value() && (longest = longest_of_offsets(*cu_seqlens_cpu, cu.numel(), T)) < 0)
      return fallback;
  } else if (cu_seqlens_cpu.has_value()) {
    return fallback;
  }
  if (N > kMaxSequences || B * T > kMaxTokens) return fallback;

  const at::Tensor* h0 = nullptr;
  if (initial_state.has_value()) {
    h0 = &*initial_state;
    const std::array<int64_t, 4> want{N, c.hv, c.state_v_first ? c.head_v : c.head_k,
                                      c.state_v_first ? c.head_k : c.head_v};
    if (h0->sizes() != at::IntArrayRef(want) || h0->scalar_type() != at::kFloat || !on(*h0, c.device) ||
        !h0->is_contiguous() || (at::GradMode::is_enabled() && h0->requires_grad()))
      return fallback;
  }

  const int64_t total = B * T;
  const int64_t segments = c.call_segments(total, N, longest);
  if (segments < 0) return fallback;
  if (!cu_seqlens.has_value())  // batch rows are sequences of T tokens: their offsets on the device
    cu = at::arange(0, (B + 1) * T, T, at::TensorOptions().dtype(at::kLong).device(c.device));
  else if (cu.scalar_type() != at::kLong || !cu.is_contiguous())  // as the Python path converts them
    cu = cu.to(at::kLong).contiguous();

  const auto on_device = at::TensorOptions().device(c.device);
  at::Tensor o = at::empty(v.sizes(), on_device.dtype(c.qkv_dtype));
  at::Tensor final_state =
      output_final_state
          ? at::empty({N, c.hv, c.state_v_first ? c.head_v : c.head_k, c.state_v_first ? c.head_k : c.head_v},
                      on_device.dtype(at::kFloat))
          : at::Tensor();
  at::Tensor workspace = at::empty({c.workspace_bytes(total, N, segments)}, on_device.dtype(at::kByte));

  FqtGdnFwdArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.g = g.data_ptr<float>();
  a.beta = beta.data_ptr<float>();
  a.cu_seqlens = cu.data_ptr<int64_t>();
  a.initial_state = h0 != nullptr ? h0->data_ptr<float>() : nullptr;
  a.final_state = output_final_state ? final_state.data_ptr<float>() : nullptr;
  a.o = o.data_ptr();
  a.workspace = workspace.data_ptr();
  a.total_tokens = total;
  a.num_seqs = N;
  a.scale = float(scale.has_value() ? *scale : std::pow(double(c.head_k), -0.5));  // Python's K ** -0.5
  a.use_qk_l2norm = use_qk_l2norm ? 1 : 0;
  a.prep_schedule = FQT_PREP_AUTO;
  const bool cp = segments > 0;
  a.warmup = cp ? reinterpret_cast<const int32_t*>(c.warmup_ptr) : nullptr;
  a.segment_chunks = cp ? reinterpret_cast<const int32_t*>(c.segment_chunks_ptr) : nullptr;
  a.max_segments = segments;
  a.log_eps = cp ? float(c.log_eps) : 0.f;
  a.exact_heads = cp ? c.exact_heads : 0;
  const int32_t code = c.launch(&a, reinterpret_cast<void*>(stream));
  return py::make_tuple(o, output_final_state ? py::cast(final_state) : py::none(), code);
}

// warmup_tables.call_segments from C++, for tests that compare the two over many calls.
int64_t call_segments(const SignatureContext& c, int64_t total_tokens, int64_t num_seqs, int64_t longest_tokens) {
  return c.call_segments(total_tokens, num_seqs, longest_tokens);
}

SignatureContext make_context(int64_t launch, int64_t workspace_bytes, const at::Device& device,
                              at::ScalarType qkv_dtype, int64_t hqk, int64_t hv, int64_t head_k, int64_t head_v,
                              bool state_v_first, int64_t warmup_ptr, int64_t segment_chunks_ptr, double log_eps,
                              std::vector<int64_t> lengths, std::vector<int64_t> top_extra,
                              std::vector<int64_t> top_shortest, int64_t max_segments, int64_t scratch_limit_bytes,
                              int64_t bytes_per_segment, int64_t exact_heads) {
  TORCH_CHECK(launch != 0 && workspace_bytes != 0, "a context needs the library's entry points");
  TORCH_CHECK(warmup_ptr == 0 || (lengths.size() == kSegmentBuckets && top_extra.size() == kSegmentBuckets - 1 &&
                                  top_shortest.size() == kSegmentBuckets - 1),
              "a CP context needs ", kSegmentBuckets, " segment lengths and their bound tables");
  SignatureContext c;
  c.launch = reinterpret_cast<LibraryLaunchFn>(launch);
  c.workspace_bytes = reinterpret_cast<LibraryWorkspaceBytesFn>(workspace_bytes);
  c.device = device;
  c.qkv_dtype = qkv_dtype;
  c.hqk = hqk;
  c.hv = hv;
  c.head_k = head_k;
  c.head_v = head_v;
  c.state_v_first = state_v_first;
  c.warmup_ptr = warmup_ptr;
  c.segment_chunks_ptr = segment_chunks_ptr;
  c.log_eps = log_eps;
  c.lengths = std::move(lengths);
  c.top_extra = std::move(top_extra);
  c.top_shortest = std::move(top_shortest);
  c.max_segments = max_segments;
  c.scratch_limit_bytes = scratch_limit_bytes;
  c.bytes_per_segment = bytes_per_segment;
  c.exact_heads = int32_t(exact_heads);
  return c;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ABI_VERSION") = FQT_ABI_VERSION;
  // module_local: a pack's prebuilt copy and the cache's build may both be imported in one process;
  // each keeps its own type, and a context is only ever passed back to the module that made it.
  py::class_<SignatureContext>(m, "SignatureContext", py::module_local());
  m.def("make_context", &make_context);
  m.def("forward", &forward);
  m.def("call_segments", &call_segments);
}
