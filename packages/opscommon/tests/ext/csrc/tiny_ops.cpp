// A tiny stable-ABI extension built in the test run against opscommon's
// headers: proves they compile and behave (checks, dispatch, CPU map).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "opscommon/checks.h"
#include "opscommon/cpu.h"
#include "opscommon/dispatch.h"
#include "opscommon/tensor.h"

namespace {

using torch::stable::Tensor;
constexpr const char* kOp = "opscommon_tiny.axpy";

template <typename T>
struct Axpy {
  inline T operator()(T x, T y) const {
    using acc = opscommon::acc_t<T>;
    return static_cast<T>(acc(2) * static_cast<acc>(x) + static_cast<acc>(y));
  }
};

// 2 * x + y, same shape, dtype and device.
Tensor axpy(Tensor x, Tensor y) {
  opscommon::check_same_device(kOp, "x", x, "y", y);
  opscommon::check_same_dtype(kOp, "x", x, "y", y);
  opscommon::check_same_shape(kOp, "x", x, "y", y);
  opscommon::check_dtype_in(
      kOp, "x", x,
      {opscommon::ScalarType::Float, opscommon::ScalarType::Double, opscommon::ScalarType::Half,
       opscommon::ScalarType::BFloat16, opscommon::ScalarType::Int, opscommon::ScalarType::Long});
  const Tensor xc = opscommon::contiguous_of(x);
  const Tensor yc = opscommon::contiguous_of(y);
  Tensor out = opscommon::empty_contiguous_like(xc);
  opscommon::dispatch_floating_and_int(xc.scalar_type(), kOp, [&](auto tag) {
    using T = decltype(tag);
    opscommon::cpu_map(xc.numel(), Axpy<T>{}, out.mutable_data_ptr<T>(), xc.const_data_ptr<T>(),
                       yc.const_data_ptr<T>());
  });
  return out;
}

// Raises unless x has shape [*, 3].
Tensor rows_of_three(Tensor x) {
  opscommon::check_shape("opscommon_tiny.rows_of_three", "x", x, {-1, 3});
  return x;
}

// Raises a fixed message: the exception path without any tensor query.
Tensor raise_plain(Tensor x) {
  OPSCOMMON_CHECK(false, "opscommon_tiny.raise_plain: plain [message]");
  return x;
}

// Raises a message that queries the tensor's sizes.
Tensor raise_with_size(Tensor x) {
  OPSCOMMON_CHECK(false, "opscommon_tiny.raise_with_size: size ", x.size(0), " shape ",
                  opscommon::shape_str(x));
  return x;
}

// A fresh [x.size(0), ...sizes] tensor of x's dtype and device (values unset).
Tensor empty_rows(Tensor x, int64_t a, int64_t b) {
  return opscommon::empty_contiguous("opscommon_tiny.empty_rows", "the rows", x, {x.size(0), a, b});
}

}  // namespace

STABLE_TORCH_LIBRARY(opscommon_tiny, m) {
  m.def("axpy(Tensor x, Tensor y) -> Tensor");
  m.def("rows_of_three(Tensor x) -> Tensor");
  m.def("raise_plain(Tensor x) -> Tensor");
  m.def("raise_with_size(Tensor x) -> Tensor");
  m.def("empty_rows(Tensor x, int a, int b) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(opscommon_tiny, CPU, m) {
  m.impl("axpy", TORCH_BOX(&axpy));
  m.impl("rows_of_three", TORCH_BOX(&rows_of_three));
  m.impl("raise_plain", TORCH_BOX(&raise_plain));
  m.impl("raise_with_size", TORCH_BOX(&raise_with_size));
  m.impl("empty_rows", TORCH_BOX(&empty_rows));
}
