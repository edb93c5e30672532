// Tensor helpers that save a dispatcher round trip on the hot path of small
// ops: the stable ops look aten ops up by name and call them boxed.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
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

namespace detail {

// Name and element size of an aoti_torch_dtype_*() code.
inline void dtype_code_info(int32_t code, std::string& name, int64_t& size) {
  struct Known {
    int32_t (*code)();
    const char* name;
    int64_t size;
  };
  static const Known known[] = {
      {aoti_torch_dtype_float16, "float16", 2}, {aoti_torch_dtype_bfloat16, "bfloat16", 2},
      {aoti_torch_dtype_float32, "float32", 4}, {aoti_torch_dtype_float64, "float64", 8},
      {aoti_torch_dtype_int32, "int32", 4},     {aoti_torch_dtype_int64, "int64", 8},
      {aoti_torch_dtype_int16, "int16", 2},     {aoti_torch_dtype_int8, "int8", 1},
      {aoti_torch_dtype_uint8, "uint8", 1},     {aoti_torch_dtype_bool, "bool", 1},
  };
  for (const Known& k : known) {
    if (k.code() == code) {
      name = k.name;
      size = k.size;
      return;
    }
  }
  name = "dtype code " + std::to_string(code);
  size = 0;
}

// "[2, 3] (24 bytes)": the sizes and, unless it overflows, the byte count.
inline std::string sizes_and_bytes(const std::vector<int64_t>& sizes, int64_t element_size) {
  std::string s = "[";
  int64_t n = element_size;
  bool overflow = element_size <= 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    s += (d ? ", " : "") + std::to_string(sizes[d]);
    if (!overflow && __builtin_mul_overflow(n, sizes[d], &n)) overflow = true;
  }
  s += "]";
  if (element_size > 0)
    s += overflow ? " (more than 2^63 bytes)" : " (" + std::to_string(n) + " bytes)";
  return s;
}

// The message of a failed allocation: the op, what it asked for, where.
inline std::string allocation_failure(const char* op, const std::string& what,
                                      const std::vector<int64_t>& sizes, const std::string& dtype,
                                      int64_t element_size, const std::string& device) {
  return std::string(op) + ": could not allocate " + what + ", a " + dtype + " tensor of shape " +
         sizes_and_bytes(sizes, element_size) + " on " + device + " (out of memory?)";
}

inline std::vector<int64_t> sizes_of(const Tensor& t) {
  std::vector<int64_t> sizes(static_cast<size_t>(t.dim()));
  for (int64_t d = 0; d < t.dim(); ++d) sizes[d] = t.size(d);
  return sizes;
}

}  // namespace detail

// The strides of a contiguous tensor of these sizes, as torch makes them (a
// dimension of size 0 or 1 steps as if it were absent), or nullopt when the
// element count overflows int64.
inline std::optional<std::vector<int64_t>> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = step;
    if (__builtin_mul_overflow(step, sizes[d] > 1 ? sizes[d] : 1, &step)) return std::nullopt;
  }
  return strides;
}

// A fresh contiguous tensor of the given sizes on like's device, with like's
// dtype or `dtype` (an aoti_torch_dtype_*() code). Through the C shim's
// empty_strided: torch::stable::new_empty/empty_like look the aten op up by
// name and call it boxed, which costs a launch-bound op several microseconds
// per output. A failed allocation (out of memory, or sizes whose element
// count overflows) raises an error that names `op`, the buffer (`what`, as
// in "could not allocate <what>") and the size asked for.
inline Tensor empty_contiguous(const char* op, const char* what, const Tensor& like,
                               const std::vector<int64_t>& sizes,
                               std::optional<int32_t> dtype = std::nullopt) {
  const std::optional<std::vector<int64_t>> strides = contiguous_strides(sizes);
  int32_t like_dtype = 0, device_type = 0, device_index = 0;
  if (!dtype) OPSCOMMON_SHIM_CHECK(aoti_torch_get_dtype(like.get(), &like_dtype));
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  OPSCOMMON_SHIM_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle handle = nullptr;
  if (!strides || aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(),
                                           strides->data(), dtype.value_or(like_dtype), device_type,
                                           device_index, &handle) != AOTI_TORCH_SUCCESS) {
    std::string name;
    int64_t size = 0;
    detail::dtype_code_info(dtype.value_or(like_dtype), name, size);
    throw std::runtime_error(
        detail::allocation_failure(op, what, sizes, name, size, device_str(like)));
  }
  return Tensor(handle);
}

// The same for an op's output.
inline Tensor empty_contiguous(const char* op, const Tensor& like,
                               const std::vector<int64_t>& sizes,
                               std::optional<int32_t> dtype = std::nullopt) {
  return empty_contiguous(op, "an output", like, sizes, dtype);
}

// The same, for callers that name no op.
inline Tensor empty_contiguous(const Tensor& like, const std::vector<int64_t>& sizes,
                               std::optional<int32_t> dtype = std::nullopt) {
  return empty_contiguous("opscommon.empty_contiguous", like, sizes, dtype);
}

// A fresh contiguous tensor of t's shape, dtype and device.
inline Tensor empty_contiguous_like(const char* op, const Tensor& t) {
  return empty_contiguous(op, t, detail::sizes_of(t));
}

inline Tensor empty_contiguous_like(const Tensor& t) {
  return empty_contiguous("opscommon.empty_contiguous", t, detail::sizes_of(t));
}

// contiguous_of(t), with a failed allocation of the copy reported as an
// error that names `op`, the argument `arg` and the size.
inline Tensor contiguous_of(const char* op, const char* arg, const Tensor& t) {
  if (t.is_contiguous()) return t;
  try {
    return torch::stable::contiguous(t);
  } catch (const std::exception&) {
    throw std::runtime_error(detail::allocation_failure(
        op, std::string("a contiguous copy of argument '") + arg + "'", detail::sizes_of(t),
        dtype_name(t.scalar_type()), static_cast<int64_t>(t.element_size()), device_str(t)));
  }
}

}  // namespace opscommon
