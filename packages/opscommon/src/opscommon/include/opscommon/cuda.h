// CUDA helpers: error checks that raise a Python exception with file and
// line, the current stream, a 64-bit grid-stride loop and a launch config.
#pragma once

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "checks.h"

namespace opscommon {

#define OPSCOMMON_CUDA_CHECK(expr)                                                            \
  do {                                                                                        \
    cudaError_t opscommon_err_ = (expr);                                                      \
    OPSCOMMON_CHECK(opscommon_err_ == cudaSuccess,                                            \
                    "CUDA error: ", cudaGetErrorString(opscommon_err_), " (", #expr, ") at ", \
                    __FILE__, ":", __LINE__);                                                 \
  } while (0)

// After every kernel launch: launch-configuration errors surface here.
#define OPSCOMMON_CUDA_CHECK_LAUNCH() OPSCOMMON_CUDA_CHECK(cudaGetLastError())

// Grid-stride loop with 64-bit indices: any grid covers any n, including
// n > 2^31, and the launch can be capped below one thread per element.
#define OPSCOMMON_KERNEL_LOOP(i, n)                                                      \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// The stream PyTorch is using on this device (honours torch.cuda.stream(...)
// and CUDA graph capture). Through the C shim, available since torch 2.10.
inline cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  OPSCOMMON_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream) == AOTI_TORCH_SUCCESS,
                  "could not get the current CUDA stream of device ", device_index);
  return static_cast<cudaStream_t>(stream);
}

// A device attribute, asked of the driver once per device (64 devices
// cached; the call is a few microseconds, the hot path of a small op is not
// much more). Attributes are fixed for the life of the process; the ones
// cached here are never 0, which marks "not asked yet".
template <cudaDeviceAttr kAttribute>
int device_attribute(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < 64) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached != 0) return cached;
  }
  int value = 0;
  OPSCOMMON_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device));
  if (device >= 0 && device < 64) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

inline int multiprocessor_count(int device) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(device);
}

inline int compute_capability_major(int device) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
}

struct LaunchConfig {
  unsigned int blocks;
  unsigned int threads;
};

// blocks_per_sm value for a grid that covers all the work (up to max_blocks).
constexpr int kNoSmCap = 0;

// One thread per work item, rounded up to whole blocks, capped at
// `blocks_per_sm` blocks per multiprocessor unless that is kNoSmCap (a
// grid-stride loop covers the rest) and at `max_blocks` (the grid's x limit
// by default). Never zero blocks, so an empty launch is valid.
inline LaunchConfig launch_config(int64_t work_items, int device, unsigned int threads = 256,
                                  int blocks_per_sm = 8, int64_t max_blocks = 0x7fffffff) {
  const int64_t wanted = (work_items + threads - 1) / threads;
  const int64_t cap =
      blocks_per_sm == kNoSmCap
          ? max_blocks
          : std::min<int64_t>(static_cast<int64_t>(multiprocessor_count(device)) * blocks_per_sm,
                              max_blocks);
  return {static_cast<unsigned int>(std::max<int64_t>(1, std::min(wanted, cap))), threads};
}

}  // namespace opscommon
