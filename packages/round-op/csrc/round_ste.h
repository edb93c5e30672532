// Round half up, shared by the CPU and CUDA kernels.
#pragma once

#include <cmath>

#include "opscommon/dispatch.h"

#ifdef __CUDACC__
#define ROUND_OP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ROUND_OP_HOST_DEVICE inline
#endif

namespace round_op {

constexpr const char* kRoundSte = "round_op.round_ste";

ROUND_OP_HOST_DEVICE float floor_of(float v) { return ::floorf(v); }
ROUND_OP_HOST_DEVICE double floor_of(double v) { return ::floor(v); }

// floor(x + 0.5) of the stored value, computed without forming x + 0.5: that
// sum can round up (0.49999997f + 0.5f == 1.0f). x - floor(x) is exact, so
// the comparison is too. The result's zero is +0.0, as floor(x + 0.5) gives
// for x in [-0.5, 0.5) (-0.0 included: floor(-0.0) is -0.0, and adding +0.0
// turns it into +0.0; this needs IEEE addition, not -ffast-math, which
// would drop the + 0). NaN and +-inf come back unchanged.
template <typename T>
struct RoundHalfUp {
  ROUND_OP_HOST_DEVICE T operator()(T x) const {
    using acc = opscommon::acc_t<T>;
    const acc v = static_cast<acc>(x);
    const acc r = floor_of(v);
    return static_cast<T>(v - r >= acc(0.5) ? r + acc(1) : r + acc(0));
  }
};

}  // namespace round_op
