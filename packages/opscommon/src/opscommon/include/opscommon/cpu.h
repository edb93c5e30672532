// CPU elementwise map over contiguous buffers, parallel over chunks
// for large tensors, a plain loop the compiler vectorizes inside each chunk.
// No __restrict__: out may alias an input (add(a, b, out=a)).
#pragma once

#include <torch/csrc/stable/ops.h>

#include <cstdint>

namespace opscommon {

// Below this many elements a single thread is faster than waking the pool.
constexpr int64_t kCpuGrainSize = 32768;

template <typename T, typename Op, typename... In>
void cpu_map(int64_t n, Op op, T* out, const In*... in) {
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = op(in[i]...);
  };
  if (n < kCpuGrainSize) {
    body(0, n);
  } else {
    torch::stable::parallel_for(0, n, kCpuGrainSize, body);
  }
}

}  // namespace opscommon
