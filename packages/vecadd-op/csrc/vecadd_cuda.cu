// vecadd_op::add: CUDA kernels (16-byte vectorized, grid-stride with 64-bit
// indices, scalar tail and unaligned fallback, current stream: all from
// opscommon::launch_map).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "opscommon/checks.h"
#include "opscommon/cuda.h"
#include "opscommon/dispatch.h"
#include "opscommon/vectorized.h"
#include "vecadd.h"

namespace vecadd_op {

namespace {

// dst = a + b, all contiguous, same shape and dtype, on one CUDA device
// (the current one: the caller holds a DeviceGuard).
void run_cuda(Tensor& dst, const Tensor& a, const Tensor& b) {
  const int device = a.get_device();
  const cudaStream_t stream = opscommon::current_stream(device);
  opscommon::dispatch_floating_and_int(a.scalar_type(), kAdd, [&](auto tag) {
    using T = decltype(tag);
    opscommon::launch_map(dst.numel(), device, stream, AddOp<T>{}, dst.mutable_data_ptr<T>(),
                          a.const_data_ptr<T>(), b.const_data_ptr<T>());
  });
}

}  // namespace

Tensor add_cuda(Tensor a, Tensor b) {
  // Every check runs before the guard: a CPU tensor has device index -1.
  check_inputs(a, b);
  opscommon::DeviceGuard guard(a.get_device());
  return add_new(a, b, run_cuda);
}

Tensor add_out_cuda(Tensor a, Tensor b, Tensor out) {
  check_inputs(a, b);
  check_out(a, out);
  opscommon::DeviceGuard guard(a.get_device());
  add_into(a, b, out, run_cuda);
  return out;
}

}  // namespace vecadd_op

STABLE_TORCH_LIBRARY_IMPL(vecadd_op, CUDA, m) {
  m.impl("add", TORCH_BOX(&vecadd_op::add_cuda));
  m.impl("add.out", TORCH_BOX(&vecadd_op::add_out_cuda));
}
