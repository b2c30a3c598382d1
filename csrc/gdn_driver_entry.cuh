// The driver's TMA descriptor encoder, looked up once per process.
//
// CUTLASS reaches cuTensorMapEncodeTiled through cudaGetDriverEntryPointByVersion on every call
// (so that binaries need not link libcuda), and a forward encodes five descriptors per call. With
// CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL its wrapper calls the function by name instead, and the
// name is mapped here to a forwarder that caches the entry point: still no link-time libcuda
// dependency (`nm -D` on a plan shows no cu* import), and one lookup per process.
// Must be included before any CUTLASS header.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#if defined(CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL) || defined(cuTensorMapEncodeTiled) || \
    defined(CUTLASS_CUDA_DRIVER_WRAPPER_CALL)
#error "gdn_driver_entry.cuh must come before every CUTLASS header and own the driver-call switch"
#endif

namespace fqt {

inline PFN_cuTensorMapEncodeTiled_v12000 lookup_encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050  // the by-version lookup exists from 12.5; CUDA 13 has only it
  const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

inline CUresult encode_tiled_cached(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                    const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                    const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
                                    CUtensorMapFloatOOBfill fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = lookup_encode_tiled();  // thread-safe init
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, promotion, fill);
}

}  // namespace fqt

#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#define cuTensorMapEncodeTiled ::fqt::encode_tiled_cached
