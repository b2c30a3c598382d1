// Host side, shared by the backward's launchers: the once-per-device attribute a kernel needs before
// its first launch on a device (the dynamic shared memory above the default 48 KiB).
#pragma once
#include <cuda_runtime.h>

#include <mutex>

namespace fqt {

// Sets Kernel's dynamic shared memory limit to `smem_bytes` on the current device, once per device
// and kernel (thread-safe; the result of the first call is remembered and returned).
template <auto Kernel>
cudaError_t allow_dynamic_smem_once(int smem_bytes) {
  constexpr int kMaxDevices = 64;
  struct Setup {
    std::once_flag once;
    cudaError_t error = cudaSuccess;
  };
  // one table per kernel: each instantiation has its own
  static Setup setups[kMaxDevices];
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  Setup& setup = setups[device];
  std::call_once(setup.once, [&] {
    setup.error = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  });
  return setup.error;
}

}  // namespace fqt
