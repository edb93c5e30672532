// vecadd_op::add: schemas and CPU kernels.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "opscommon/checks.h"
#include "opscommon/cpu.h"
#include "opscommon/dispatch.h"
#include "vecadd.h"

namespace vecadd_op {

namespace {

// dst = a + b, all contiguous, same shape and dtype, on the CPU.
void run_cpu(Tensor& dst, const Tensor& a, const Tensor& b) {
  opscommon::dispatch_floating_and_int(a.scalar_type(), kAdd, [&](auto tag) {
    using T = decltype(tag);
    opscommon::cpu_map(dst.numel(), AddOp<T>{}, dst.mutable_data_ptr<T>(), a.const_data_ptr<T>(),
                       b.const_data_ptr<T>());
  });
}

}  // namespace

Tensor add_cpu(Tensor a, Tensor b) {
  check_inputs(a, b);
  return add_new(a, b, run_cpu);
}

Tensor add_out_cpu(Tensor a, Tensor b, Tensor out) {
  check_inputs(a, b);
  check_out(a, out);
  add_into(a, b, out, run_cpu);
  return out;
}

}  // namespace vecadd_op

STABLE_TORCH_LIBRARY(vecadd_op, m) {
  // The gradient (to both inputs) is registered in Python; it needs no kernel.
  m.def("add(Tensor a, Tensor b) -> Tensor");
  m.def("add.out(Tensor a, Tensor b, *, Tensor(a!) out) -> Tensor(a!)");
}

STABLE_TORCH_LIBRARY_IMPL(vecadd_op, CPU, m) {
  m.impl("add", TORCH_BOX(&vecadd_op::add_cpu));
  m.impl("add.out", TORCH_BOX(&vecadd_op::add_out_cpu));
}
