// lltm_op: programmatic dependent launch (sm_90+), shared by the cell
// kernels (the backward's bias kernel) and the sequence's cuBLAS path (its
// cell kernels). A kernel launched with launch_dependent may start before
// the kernel ahead of it in the stream completes: it calls
// wait_for_grid_dependencies() before its first read, which waits until
// that kernel has completed and its writes are visible, and
// grid_dependents_may_launch() lets the kernel after it start launching.
// Both instructions are no-ops without such a launch.
#pragma once

#include <cuda_runtime.h>

#include "opscommon/checks.h"
#include "opscommon/cuda.h"

namespace lltm_op {

__device__ __forceinline__ void grid_dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_grid_dependencies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

inline bool supports_dependent_launch(int device) {
  return opscommon::compute_capability_major(device) >= 9;
}

// kernel<<<grid, block, 0, stream>>>(args...), as the programmatic
// dependent of the kernel ahead of it where `dependent` and the GPU has it
// (sm_90+), else a plain launch.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                      int device, bool dependent, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent && supports_dependent_launch(device) ? 1 : 0;
  OPSCOMMON_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

}  // namespace lltm_op
