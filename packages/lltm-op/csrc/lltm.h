// LLTM cell math shared by the CPU and CUDA kernels, and the argument checks
// both kernels run.
//
// The cell takes the matrix product P = X W^T (X = [old_h, input], computed by
// torch/cuBLAS) and the bias b; the pre-activation gates are G = P + b,
// chunked along the columns in the order input gate, output gate, candidate
// cell:
//
//   i = sigmoid(G[:, 0:S])   o = sigmoid(G[:, S:2S])   z = elu(G[:, 2S:3S])
//   new_cell = old_cell + z * i
//   new_h    = tanh(new_cell) * o
//
// The backward recomputes G, i, o, z and tanh(new_cell) from P, b and
// new_cell (cell_backward_from_new_cell: what autograd saves, so that the
// caller may overwrite old_cell in place after the step) or old_cell
// (cell_backward), and returns dG (the gradient of P, ready for torch's mm
// backward), db = sum of dG over the batch (reduced in the same pass, so dG
// is not read again) and d_old_cell.
#pragma once

#include <optional>

#include <cmath>
#include <cstdint>

#include <torch/csrc/stable/tensor.h>

#include "opscommon/checks.h"
#include "opscommon/dispatch.h"
#include "opscommon/tensor.h"

#ifdef __CUDACC__
#define LLTM_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Always inlined into the element loops: a call left in a loop stops the
// compiler from vectorizing it (see lltm_cpu_math.h).
#define LLTM_HD inline __attribute__((always_inline))
#else
#define LLTM_HD inline
#endif

namespace lltm_op {

constexpr const char* kCellForward = "lltm_op.cell_forward";
constexpr const char* kCellBackward = "lltm_op.cell_backward";
constexpr const char* kCellBackwardFromNewCell = "lltm_op.cell_backward_from_new_cell";

// -- math in the accumulation type (float for float16/bfloat16/float32, double
// -- for float64) --------------------------------------------------------------

// The C library's functions: what float32 and float64 use everywhere.
struct AccurateMath {
  static LLTM_HD float exp(float v) { return ::expf(v); }
  static LLTM_HD double exp(double v) { return ::exp(v); }
  static LLTM_HD float expm1(float v) { return ::expm1f(v); }
  static LLTM_HD double expm1(double v) { return ::expm1(v); }
  static LLTM_HD float tanh(float v) { return ::tanhf(v); }
  static LLTM_HD double tanh(double v) { return ::tanh(v); }
  template <typename A>
  static LLTM_HD A sigmoid(A x) {
    return A(1) / (A(1) + exp(-x));
  }
  template <typename A>
  static LLTM_HD A select(bool c, A a, A b) {
    return c ? a : b;
  }
};

#ifdef __CUDACC__
// float16 and bfloat16 on the GPU: the hardware exp2 and reciprocal
// (rcp.approx: within 1 ulp of float, subnormal results kept). Their error
// (about 1e-6 relative, 1e-7 absolute for expm1 and tanh near 0) is far below
// the precision of the stored result (2^-11, 2^-8), and they keep the
// half-type kernels bound by memory, not by math: the correctly rounded
// __frcp_rn (0.5 ulp) is a multi-instruction sequence with a slow path,
// which cost the cell forward 10% on an H100. NaN, +-inf and overflow come
// out as from AccurateMath. kFtz: the same instructions flushing subnormal
// inputs and results to zero (.ftz), without the range check and rescale
// each otherwise carries (see TcMath in lltm_sequence_tc.cuh).
template <bool kFtz>
struct HardwareMath {
  static __device__ __forceinline__ float exp(float v) {
    if constexpr (kFtz) {
      float r;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v * 1.4426950408889634f));
      return r;
    } else {
      return __expf(v);
    }
  }
  static __device__ __forceinline__ float rcp(float v) {
    float r;
    if constexpr (kFtz) {
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    } else {
      asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
    }
    return r;
  }
  static __device__ __forceinline__ float expm1(float v) { return exp(v) - 1.0f; }
  static __device__ __forceinline__ float tanh(float v) {
    return 1.0f - 2.0f * rcp(exp(2.0f * v) + 1.0f);
  }
  static __device__ __forceinline__ float sigmoid(float x) { return rcp(1.0f + exp(-x)); }
  static __device__ __forceinline__ float select(bool c, float a, float b) { return c ? a : b; }
};
using FastMath = HardwareMath<false>;
#endif

// Forward of one element: pre-activations gi, go, gz and the old cell state.
template <typename A, typename M = AccurateMath>
LLTM_HD void cell_forward_math(A gi, A go, A gz, A old_c, A& new_h, A& new_c) {
  const A i = M::sigmoid(gi);
  const A o = M::sigmoid(go);
  const A z = M::select(gz > A(0), gz, M::expm1(gz));  // ELU, alpha = 1
  new_c = old_c + z * i;
  new_h = M::tanh(new_c) * o;
}

// Backward of one element. grad_h / grad_c are the incoming gradients of
// new_h / new_cell (zero where autograd has none); `cell` is old_cell, or
// new_cell with kFromNewCell. Writes the gradients of the three
// pre-activations and of old_cell.
template <typename A, typename M = AccurateMath, bool kFromNewCell = false>
LLTM_HD void cell_backward_math(A grad_h, A grad_c, A gi, A go, A gz, A cell, A& d_gi, A& d_go,
                                A& d_gz, A& d_old_c) {
  const A i = M::sigmoid(gi);
  const A o = M::sigmoid(go);
  const bool positive = gz > A(0);
  const A em1 = M::expm1(M::select(positive, A(0), gz));
  const A z = M::select(positive, gz, em1);
  const A dz = M::select(positive, A(1), em1 + A(1));  // elu'(x) = exp(x) for x <= 0
  const A t = M::tanh(kFromNewCell ? cell : cell + z * i);
  const A d_new_c = grad_c + grad_h * o * (A(1) - t * t);
  d_old_c = d_new_c;
  d_gi = d_new_c * z * (i * (A(1) - i));
  d_go = grad_h * t * (o * (A(1) - o));
  d_gz = d_new_c * i * dz;
}

// A read-only 2-D operand: element (r, j) at p[r * rs + j * cs]. Any strides
// (transposed, sliced, expanded with stride 0) are allowed; p == nullptr
// stands for an all-zero operand (a gradient autograd did not materialize).
template <typename T>
struct Mat {
  const T* p;
  int64_t rs;
  int64_t cs;
};

template <typename T>
inline Mat<T> mat_of(const torch::stable::Tensor& t) {
  return {t.const_data_ptr<T>(), t.stride(0), t.stride(1)};
}

// A 1-D tensor as a one-row Mat (row stride 0).
template <typename T>
inline Mat<T> row_of(const torch::stable::Tensor& t) {
  return {t.const_data_ptr<T>(), 0, t.stride(0)};
}

// -- argument checks (the fake kernels in ops.py raise the same messages) ----

inline void check_operand(const char* op, const char* arg, const torch::stable::Tensor& t) {
  opscommon::check_defined(op, arg, t);
  opscommon::check_floating(op, arg, t);
  opscommon::check_cpu_or_cuda(op, arg, t);
}

// The largest state size S whose 3 * S fits in int64 (the gates' width).
constexpr int64_t kMaxStateSize = INT64_MAX / 3;

// cell (old_cell, or new_cell for cell_backward_from_new_cell; its name in
// messages is cell_arg): [B, S]; gates: [B, 3S]; bias: [3S]; one dtype and
// device. Sets batch = B, state = S.
inline void check_cell_args(const char* op, const torch::stable::Tensor& gates,
                            const torch::stable::Tensor& bias, const torch::stable::Tensor& cell,
                            int64_t& batch, int64_t& state, const char* cell_arg = "old_cell") {
  check_operand(op, "gates", gates);
  check_operand(op, "bias", bias);
  check_operand(op, cell_arg, cell);
  opscommon::check_shape(op, cell_arg, cell, {-1, -1});
  batch = cell.size(0);
  state = cell.size(1);
  // 3 * state must not wrap around (a negative size would match any).
  OPSCOMMON_CHECK(state <= kMaxStateSize, op, ": argument '", cell_arg, "' has ", state,
                  " columns (the state size); 3 times that overflows int64");
  opscommon::check_shape(op, "gates", gates, {batch, 3 * state});
  opscommon::check_shape(op, "bias", bias, {3 * state});
  opscommon::check_same_dtype(op, "gates", gates, "bias", bias);
  opscommon::check_same_dtype(op, "gates", gates, cell_arg, cell);
  opscommon::check_same_device(op, "gates", gates, "bias", bias);
  opscommon::check_same_device(op, "gates", gates, cell_arg, cell);
}

// An optional incoming gradient: absent, or [B, S] like old_cell.
inline void check_grad_arg(const char* op, const char* arg, const torch::stable::Tensor& g,
                           const torch::stable::Tensor& gates, int64_t batch, int64_t state) {
  check_operand(op, arg, g);
  opscommon::check_shape(op, arg, g, {batch, state});
  opscommon::check_same_dtype(op, "gates", gates, arg, g);
  opscommon::check_same_device(op, "gates", gates, arg, g);
}

// The arguments of cell_backward (or, with from_new_cell, of
// cell_backward_from_new_cell); sets B (batch) and S (state size).
inline void check_backward_args(const std::optional<torch::stable::Tensor>& grad_h,
                                const std::optional<torch::stable::Tensor>& grad_cell,
                                const torch::stable::Tensor& gates,
                                const torch::stable::Tensor& bias,
                                const torch::stable::Tensor& cell, int64_t& B, int64_t& S,
                                bool from_new_cell = false) {
  const char* op = from_new_cell ? kCellBackwardFromNewCell : kCellBackward;
  check_cell_args(op, gates, bias, cell, B, S, from_new_cell ? "new_cell" : "old_cell");
  if (grad_h) check_grad_arg(op, "grad_h", *grad_h, gates, B, S);
  if (grad_cell) check_grad_arg(op, "grad_cell", *grad_cell, gates, B, S);
}

}  // namespace lltm_op
