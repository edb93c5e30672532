// round_op::round_ste: schema and CPU kernel.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "opscommon/checks.h"
#include "opscommon/cpu.h"
#include "opscommon/dispatch.h"
#include "opscommon/tensor.h"
#include "round_ste.h"

namespace round_op {

using torch::stable::Tensor;

Tensor round_ste_cpu(Tensor x) {
  opscommon::check_defined(kRoundSte, "x", x);
  opscommon::check_floating(kRoundSte, "x", x);
  Tensor out = opscommon::empty_contiguous_like(kRoundSte, x);
  const Tensor xc = opscommon::contiguous_of(kRoundSte, "x", x);
  opscommon::dispatch_floating(xc.scalar_type(), kRoundSte, [&](auto tag) {
    using T = decltype(tag);
    opscommon::cpu_map(xc.numel(), RoundHalfUp<T>{}, out.mutable_data_ptr<T>(),
                       xc.const_data_ptr<T>());
  });
  return out;
}

}  // namespace round_op

STABLE_TORCH_LIBRARY(round_op, m) {
  // Forward only: the straight-through backward is registered in Python and
  // needs no kernel (the gradient passes through unchanged).
  m.def("round_ste(Tensor x) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(round_op, CPU, m) {
  m.impl("round_ste", TORCH_BOX(&round_op::round_ste_cpu));
}
