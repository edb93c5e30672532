// Tensor helpers that save a dispatcher round trip on the hot path of small
// ops: the stable ops look aten ops up by name and call them boxed.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
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

// A fresh contiguous tensor of the given sizes on like's device, with like's
// dtype or `dtype` (an aoti_torch_dtype_*() code). Through the C shim's
// empty_strided: torch::stable::new_empty/empty_like look the aten op up by
// name and call it boxed, which costs a launch-bound op several microseconds
// per output.
inline Tensor empty_contiguous(const Tensor& like, const std::vector<int64_t>& sizes,
                               std::optional<int32_t> dtype = std::nullopt) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    strides[d] = step;
    step *= sizes[d] > 1 ? sizes[d] : 1;  // torch's contiguous strides
  }
  int32_t like_dtype = 0, device_type = 0, device_index = 0;
  if (!dtype) OPSCOMMON_SHIM_CHECK(aoti_torch_get_dtype(like.get(), &like_dtype));
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle handle = nullptr;
  OPSCOMMON_SHIM_CHECK(aoti_torch_empty_strided(ndim, sizes.data(), strides.data(),
                                                dtype.value_or(like_dtype), device_type,
                                                device_index, &handle));
  return Tensor(handle);
}

// A fresh contiguous tensor of t's shape, dtype and device.
inline Tensor empty_contiguous_like(const Tensor& t) {
  std::vector<int64_t> sizes(static_cast<size_t>(t.dim()));
  for (int64_t d = 0; d < t.dim(); ++d) sizes[d] = t.size(d);
  return empty_contiguous(t, sizes);
}

}  // namespace opscommon
