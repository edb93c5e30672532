// Tensor helpers that save a dispatcher round trip on the hot path of small
// ops: the stable ops look aten ops up by name and call them boxed.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

#include "checks.h"

namespace opscommon {

using torch::stable::Tensor;

// A C shim call that must succeed (portable across torch >= 2.10 headers).
#define OPSCOMMON_SHIM_CHECK(expr) \
  OPSCOMMON_CHECK((expr) == AOTI_TORCH_SUCCESS, "torch C shim call failed: ", #expr)

// t itself when already contiguous, else a contiguous copy.
inline Tensor contiguous_of(const Tensor& t) {
  // Skips a dispatcher round trip on the common, contiguous path.
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// A fresh contiguous tensor of t's shape, dtype and device. Through the C
// shim's empty_strided: torch::stable::new_empty/empty_like look the aten op
// up by name and call it boxed, about 1 us more per call, which a small add
// would otherwise spend mostly there.
inline Tensor empty_contiguous_like(const Tensor& t) {
  const int64_t ndim = t.dim();
  std::vector<int64_t> sizes(ndim), strides(ndim);
  int64_t step = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    sizes[d] = t.size(d);
    strides[d] = step;
    step *= sizes[d] > 1 ? sizes[d] : 1;  // torch's contiguous strides
  }
  int32_t dtype = 0, device_type = 0, device_index = 0;
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_dtype(t.get(), &dtype));
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_device_type(t.get(), &device_type));
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_device_index(t.get(), &device_index));
  AtenTensorHandle handle = nullptr;
  OPSCOMMON_SHIM_CHECK(aoti_torch_empty_strided(ndim, sizes.data(), strides.data(), dtype,
                                                device_type, device_index, &handle));
  return Tensor(handle);
}

}  // namespace opscommon
