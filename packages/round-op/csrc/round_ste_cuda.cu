// round_op::round_ste: CUDA kernel (vectorized, grid-stride, current stream).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "opscommon/checks.h"
#include "opscommon/cuda.h"
#include "opscommon/dispatch.h"
#include "opscommon/tensor.h"
#include "opscommon/vectorized.h"
#include "round_ste.h"

namespace round_op {

using torch::stable::Tensor;

Tensor round_ste_cuda(Tensor x) {
  opscommon::check_defined(kRoundSte, "x", x);
  opscommon::check_floating(kRoundSte, "x", x);
  const int device = x.get_device();
  opscommon::DeviceGuard guard(device);
  Tensor out = opscommon::empty_contiguous_like(kRoundSte, x);
  const Tensor xc = opscommon::contiguous_of(kRoundSte, "x", x);
  const cudaStream_t stream = opscommon::current_stream(device);
  opscommon::dispatch_floating(xc.scalar_type(), kRoundSte, [&](auto tag) {
    using T = decltype(tag);
    opscommon::launch_map(xc.numel(), device, stream, RoundHalfUp<T>{}, out.mutable_data_ptr<T>(),
                          xc.const_data_ptr<T>());
  });
  return out;
}

}  // namespace round_op

STABLE_TORCH_LIBRARY_IMPL(round_op, CUDA, m) {
  m.impl("round_ste", TORCH_BOX(&round_op::round_ste_cuda));
}
