// Argument checks for stable-ABI kernels. Every message names the op and the
// argument, so a user sees e.g. "round_op.round_ste: argument 'x' must be ...".
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace opscommon {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace detail {
// Messages are built with std::string and std::to_string, not iostreams:
// formatting numbers through an ostringstream in a kernel crashed inside
// some torch builds (libstdc++ locale facets shared across libraries).
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
}  // namespace detail

// Throws std::runtime_error (RuntimeError in Python) when cond is false.
#define OPSCOMMON_CHECK(cond, ...)                                        \
  do {                                                                    \
    if (!(cond)) {                                                        \
      throw std::runtime_error(::opscommon::detail::concat(__VA_ARGS__)); \
    }                                                                     \
  } while (0)

inline std::string dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Half:
      return "float16";
    case ScalarType::BFloat16:
      return "bfloat16";
    case ScalarType::Float:
      return "float32";
    case ScalarType::Double:
      return "float64";
    case ScalarType::Int:
      return "int32";
    case ScalarType::Long:
      return "int64";
    case ScalarType::Short:
      return "int16";
    case ScalarType::Char:
      return "int8";
    case ScalarType::Byte:
      return "uint8";
    case ScalarType::Bool:
      return "bool";
    default:
      return torch::headeronly::toString(t);
  }
}

inline std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

inline std::string device_str(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  if (t.is_cuda()) return "cuda:" + std::to_string(static_cast<int>(t.get_device()));
  return "an unsupported device";
}

inline bool is_floating(ScalarType t) {
  return t == ScalarType::Half || t == ScalarType::BFloat16 || t == ScalarType::Float ||
         t == ScalarType::Double;
}

inline void check_defined(const char* op, const char* arg, const Tensor& t) {
  OPSCOMMON_CHECK(t.defined(), op, ": argument '", arg, "' must be a tensor, got None");
}

// float16, bfloat16, float32, float64.
inline void check_floating(const char* op, const char* arg, const Tensor& t) {
  OPSCOMMON_CHECK(is_floating(t.scalar_type()), op, ": argument '", arg,
                  "' must be a floating-point tensor (float16, bfloat16, float32 or float64), got ",
                  dtype_name(t.scalar_type()));
}

inline void check_dtype_in(const char* op, const char* arg, const Tensor& t,
                           std::initializer_list<ScalarType> allowed) {
  for (ScalarType a : allowed) {
    if (t.scalar_type() == a) return;
  }
  std::string names;
  for (ScalarType a : allowed) names += (names.empty() ? "" : ", ") + dtype_name(a);
  OPSCOMMON_CHECK(false, op, ": argument '", arg, "' has dtype ", dtype_name(t.scalar_type()),
                  "; supported dtypes are ", names);
}

inline void check_same_dtype(const char* op, const char* arg_a, const Tensor& a, const char* arg_b,
                             const Tensor& b) {
  OPSCOMMON_CHECK(a.scalar_type() == b.scalar_type(), op, ": arguments '", arg_a, "' and '", arg_b,
                  "' must have the same dtype, got ", dtype_name(a.scalar_type()), " and ",
                  dtype_name(b.scalar_type()));
}

inline void check_cpu_or_cuda(const char* op, const char* arg, const Tensor& t) {
  OPSCOMMON_CHECK(t.is_cpu() || t.is_cuda(), op, ": argument '", arg,
                  "' must be on a CPU or CUDA device");
}

inline void check_same_device(const char* op, const char* arg_a, const Tensor& a, const char* arg_b,
                              const Tensor& b) {
  const bool same =
      a.is_cpu() ? b.is_cpu() : (b.is_cuda() && a.is_cuda() && a.get_device() == b.get_device());
  OPSCOMMON_CHECK(same, op, ": arguments '", arg_a, "' and '", arg_b,
                  "' must be on the same device, got ", device_str(a), " and ", device_str(b));
}

inline bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  return true;
}

inline void check_same_shape(const char* op, const char* arg_a, const Tensor& a, const char* arg_b,
                             const Tensor& b) {
  OPSCOMMON_CHECK(same_shape(a, b), op, ": arguments '", arg_a, "' and '", arg_b,
                  "' must have the same shape, got ", shape_str(a), " and ", shape_str(b));
}

inline void check_dim(const char* op, const char* arg, const Tensor& t, int64_t dim) {
  OPSCOMMON_CHECK(t.dim() == dim, op, ": argument '", arg, "' must be ", dim,
                  "-dimensional, got shape ", shape_str(t));
}

// expected: sizes; a negative entry matches any size.
inline void check_shape(const char* op, const char* arg, const Tensor& t,
                        std::initializer_list<int64_t> expected) {
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  int64_t d = 0;
  for (int64_t e : expected) {
    if (ok && e >= 0 && t.size(d) != e) ok = false;
    ++d;
  }
  std::string want = "[";
  d = 0;
  for (int64_t e : expected) {
    want += (d++ ? ", " : "") + (e >= 0 ? std::to_string(e) : std::string("*"));
  }
  want += "]";
  OPSCOMMON_CHECK(ok, op, ": argument '", arg, "' must have shape ", want, ", got ", shape_str(t));
}

inline void check_contiguous(const char* op, const char* arg, const Tensor& t) {
  OPSCOMMON_CHECK(t.is_contiguous(), op, ": argument '", arg, "' must be contiguous");
}

}  // namespace opscommon
