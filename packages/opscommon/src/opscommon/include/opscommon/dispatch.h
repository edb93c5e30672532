// dtype dispatch: calls f(T{}) with T the C++ type of the tensor's dtype, so a
// generic lambda gets the type as `using scalar_t = decltype(tag);`.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>

#include "checks.h"

namespace opscommon {

using Half = torch::headeronly::Half;
using BFloat16 = torch::headeronly::BFloat16;

// float16, bfloat16, float32, float64.
template <typename F>
void dispatch_floating(ScalarType t, const char* op, F&& f) {
  switch (t) {
    case ScalarType::Half:
      f(Half{});
      return;
    case ScalarType::BFloat16:
      f(BFloat16{});
      return;
    case ScalarType::Float:
      f(float{});
      return;
    case ScalarType::Double:
      f(double{});
      return;
    default:
      OPSCOMMON_CHECK(false, op, ": unsupported dtype ", dtype_name(t),
                      " (expected float16, bfloat16, float32 or float64)");
  }
}

// The floating types plus int32 and int64.
template <typename F>
void dispatch_floating_and_int(ScalarType t, const char* op, F&& f) {
  switch (t) {
    case ScalarType::Int:
      f(int32_t{});
      return;
    case ScalarType::Long:
      f(int64_t{});
      return;
    default:
      dispatch_floating(t, op, f);
  }
}

// Arithmetic type for a storage type: half types compute in float.
template <typename T>
struct acc_type {
  using type = T;
};
template <>
struct acc_type<Half> {
  using type = float;
};
template <>
struct acc_type<BFloat16> {
  using type = float;
};
template <typename T>
using acc_t = typename acc_type<T>::type;

}  // namespace opscommon
