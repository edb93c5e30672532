// vecadd_op::add: the elementwise functor, the argument checks and the
// layout/aliasing logic shared by the CPU and CUDA kernels. Each kernel file
// only supplies `run(dst, a, b)`, which adds two contiguous tensors into a
// contiguous `dst` of the same shape and dtype on its device.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "opscommon/checks.h"
#include "opscommon/dispatch.h"
#include "opscommon/tensor.h"

#ifdef __CUDACC__
#define VECADD_OP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define VECADD_OP_HOST_DEVICE inline
#endif

namespace vecadd_op {

using torch::stable::Tensor;

constexpr const char* kAdd = "vecadd_op.add";

// a + b. Half types add in float and round once; integers wrap around on
// overflow (two's complement, as torch.add does) instead of signed-overflow UB.
template <typename T>
struct AddOp {
  VECADD_OP_HOST_DEVICE T operator()(T x, T y) const {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(x) + static_cast<U>(y));
    } else {
      using acc = opscommon::acc_t<T>;
      return static_cast<T>(static_cast<acc>(x) + static_cast<acc>(y));
    }
  }
};

// a and b: defined, a supported dtype, the same dtype, device and shape.
// The fake kernel (ops.py) checks the same things in the same order.
inline void check_inputs(const Tensor& a, const Tensor& b) {
  using opscommon::ScalarType;
  opscommon::check_defined(kAdd, "a", a);
  opscommon::check_defined(kAdd, "b", b);
  opscommon::check_dtype_in(kAdd, "a", a,
                            {ScalarType::Half, ScalarType::BFloat16, ScalarType::Float,
                             ScalarType::Double, ScalarType::Int, ScalarType::Long});
  opscommon::check_same_dtype(kAdd, "a", a, "b", b);
  opscommon::check_same_device(kAdd, "a", a, "b", b);
  opscommon::check_same_shape(kAdd, "a", a, "b", b);
}

inline bool same_device(const Tensor& x, const Tensor& y) {
  return x.is_cpu() ? y.is_cpu() : (y.is_cuda() && x.get_device() == y.get_device());
}

// out: defined, a's dtype, device and shape (never resized), and no two of
// its elements at one address (a stride-0, e.g. expanded, dimension). Runs
// before anything is written, so a rejected out= is left unchanged.
inline void check_out(const Tensor& a, const Tensor& out) {
  opscommon::check_defined(kAdd, "out", out);
  OPSCOMMON_CHECK(out.scalar_type() == a.scalar_type(), kAdd,
                  ": argument 'out' must have the dtype of 'a' and 'b' (",
                  opscommon::dtype_name(a.scalar_type()), "), got ",
                  opscommon::dtype_name(out.scalar_type()));
  OPSCOMMON_CHECK(same_device(a, out), kAdd,
                  ": argument 'out' must be on the device of 'a' and 'b' (",
                  opscommon::device_str(a), "), got ", opscommon::device_str(out));
  OPSCOMMON_CHECK(opscommon::same_shape(a, out), kAdd,
                  ": argument 'out' must have the shape of 'a' and 'b' (", opscommon::shape_str(a),
                  "), got ", opscommon::shape_str(out), " (out= is never resized)");
  for (int64_t d = 0; d < out.dim(); ++d) {
    OPSCOMMON_CHECK(!(out.size(d) > 1 && out.stride(d) == 0), kAdd,
                    ": argument 'out' has elements that share memory (dimension ", d,
                    " has stride 0, e.g. an expanded tensor); pass a tensor whose elements "
                    "do not overlap");
  }
}

// Whether the memory spans of x and y (numel > 0, strides >= 0) intersect.
inline bool spans_overlap(const Tensor& x, const Tensor& y) {
  auto span = [](const Tensor& t, std::uintptr_t& lo, std::uintptr_t& hi) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    lo = reinterpret_cast<std::uintptr_t>(t.data_ptr());
    hi = lo + static_cast<std::uintptr_t>(last + 1) * t.element_size();
  };
  std::uintptr_t xlo, xhi, ylo, yhi;
  span(x, xlo, xhi);
  span(y, ylo, yhi);
  return xlo < yhi && ylo < xhi;
}

// out can be written elementwise while reading `in` (contiguous, same shape)
// when they share no memory or are the very same elements (add(a, b, out=a)):
// each element is read before it is written, by the same thread.
inline bool writable_in_place(const Tensor& out, const Tensor& in) {
  return out.data_ptr() == in.data_ptr() || !spans_overlap(out, in);
}

// The functional overload, after check_inputs: a new contiguous tensor.
template <typename Run>
Tensor add_new(const Tensor& a, const Tensor& b, Run&& run) {
  Tensor result = opscommon::empty_contiguous_like(kAdd, a);
  if (result.numel() == 0) return result;
  run(result, opscommon::contiguous_of(kAdd, "a", a), opscommon::contiguous_of(kAdd, "b", b));
  return result;
}

// The out= overload, after check_inputs and check_out. A non-contiguous out,
// or one that partly overlaps an input (say out=a[1:] with a[:-1]), gets
// the result through a temporary and copy_, so it always holds a + b of
// the values before the call.
template <typename Run>
void add_into(const Tensor& a, const Tensor& b, Tensor& out, Run&& run) {
  if (out.numel() == 0) return;
  const Tensor ac = opscommon::contiguous_of(kAdd, "a", a);
  const Tensor bc = opscommon::contiguous_of(kAdd, "b", b);
  if (out.is_contiguous() && writable_in_place(out, ac) && writable_in_place(out, bc)) {
    run(out, ac, bc);
    return;
  }
  Tensor tmp = opscommon::empty_contiguous_like(kAdd, ac);
  run(tmp, ac, bc);
  torch::stable::copy_(out, tmp);
}

}  // namespace vecadd_op
