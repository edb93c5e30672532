// lltm_op: the LLTM over whole sequences. Schemas of the sequence ops and
// their CPU kernels (the drivers are in lltm_sequence.h; the matrix products
// go through torch's dispatcher to its BLAS).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

#include "lltm.h"
#include "lltm_cpu_math.h"
#include "lltm_sequence.h"
#include "opscommon/checks.h"
#include "opscommon/cpu.h"
#include "opscommon/dispatch.h"

namespace lltm_op {
namespace seq {
namespace {

// Out of line (their __restrict__ parameters tell the vectorizer the rows
// don't alias) and, with GCC on x86-64 glibc, also compiled for x86-64-v3,
// picked at load time (as the cell's row loops in lltm.cpp).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define LLTM_SEQ_ROW_FN __attribute__((noinline, target_clones("arch=x86-64-v3", "default")))
#elif defined(__GNUC__)
#define LLTM_SEQ_ROW_FN __attribute__((noinline))
#else
#define LLTM_SEQ_ROW_FN
#endif

template <typename T>
using CpuMath = std::conditional_t<std::is_same_v<T, double>, AccurateMath, CpuVectorMath>;

template <typename F>
void for_rows(int64_t rows, int64_t cols, const F& body) {
  if (rows * cols < opscommon::kCpuGrainSize) {
    body(0, rows);
  } else {
    const int64_t grain =
        std::max<int64_t>(1, opscommon::kCpuGrainSize / std::max<int64_t>(1, cols));
    torch::stable::parallel_for(0, rows, grain, body);
  }
}

// v rounded to R's precision, stored as T: R = T (the native path), or
// T = float holding values of a half type R (the float32-products path, see
// CpuDevF32 below).
template <typename T, typename R>
LLTM_HD T round_as(opscommon::acc_t<T> v) {
  if constexpr (std::is_same_v<T, R>) {
    return cpu_math::narrow<T>(v);
  } else {
    static_assert(std::is_same_v<T, float>, "half-type values are held in float");
    return cpu_math::widen(cpu_math::narrow<R>(v));
  }
}

// One row of a forward step: g holds P + (on return) the full pre-activation.
// The storage conversions are cpu_math's branch-free ones: with c10's, GCC
// does not vectorize the half-type rows (see lltm_cpu_math.h).
template <typename T, typename R>
LLTM_SEQ_ROW_FN void forward_row(int64_t S, T* __restrict__ g, const T* __restrict__ rec,
                                 const T* __restrict__ b, const T* __restrict__ oc,
                                 T* __restrict__ h, T* __restrict__ c) {
  using A = opscommon::acc_t<T>;
  using cpu_math::widen;
  for (int64_t j = 0; j < S; ++j) {
    // The pre-activation is rounded to R once, as stored for the backward,
    // so that both passes see the same value. (Stored, then read back: a
    // local copy of a half-type value is an aggregate copy, which the
    // vectorizer refuses.)
    g[j] = round_as<T, R>(widen(g[j]) + widen(rec[j]) + widen(b[j]));
    g[S + j] = round_as<T, R>(widen(g[S + j]) + widen(rec[S + j]) + widen(b[S + j]));
    g[2 * S + j] =
        round_as<T, R>(widen(g[2 * S + j]) + widen(rec[2 * S + j]) + widen(b[2 * S + j]));
    A nh, nc;
    cell_forward_math<A, CpuMath<T>>(widen(g[j]), widen(g[S + j]), widen(g[2 * S + j]),
                                     widen(oc[j]), nh, nc);
    h[j] = round_as<T, R>(nh);
    c[j] = round_as<T, R>(nc);
  }
}

// One row of a backward step. kGo / kOther / kDc: whether grad_out, the
// other h-gradient (rec or extra) and dc_in exist. dc_in may equal dc_out.
template <typename T, typename R, bool kGo, bool kOther, bool kDc>
LLTM_SEQ_ROW_FN void backward_row(int64_t S, const T* __restrict__ go, const T* __restrict__ other,
                                  const T* dc_in, const T* __restrict__ g, const T* __restrict__ oc,
                                  T* __restrict__ dg, T* dc_out) {
  using A = opscommon::acc_t<T>;
  using cpu_math::widen;
  for (int64_t j = 0; j < S; ++j) {
    A grad_h = A(0);
    if (kGo) grad_h += widen(go[j]);
    if (kOther) grad_h += widen(other[j]);
    const A grad_c = kDc ? widen(dc_in[j]) : A(0);
    A d_i, d_o, d_z, d_c;
    cell_backward_math<A, CpuMath<T>>(grad_h, grad_c, widen(g[j]), widen(g[S + j]),
                                      widen(g[2 * S + j]), widen(oc[j]), d_i, d_o, d_z, d_c);
    dg[j] = round_as<T, R>(d_i);
    dg[S + j] = round_as<T, R>(d_o);
    dg[2 * S + j] = round_as<T, R>(d_z);
    dc_out[j] = round_as<T, R>(d_c);
  }
}

template <typename T, typename R, bool kGo, bool kOther>
void backward_rows_dc(bool dc, int64_t r0, int64_t r1, int64_t S, const T* go, const T* other,
                      const T* dc_in, const T* g, const T* oc, T* dg, T* dc_out) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* gor = kGo ? go + r * S : nullptr;
    const T* otr = kOther ? other + r * S : nullptr;
    const T* dcr = dc ? dc_in + r * S : nullptr;
    if (dc) {
      backward_row<T, R, kGo, kOther, true>(S, gor, otr, dcr, g + r * 3 * S, oc + r * S,
                                            dg + r * 3 * S, dc_out + r * S);
    } else {
      backward_row<T, R, kGo, kOther, false>(S, gor, otr, dcr, g + r * 3 * S, oc + r * S,
                                             dg + r * 3 * S, dc_out + r * S);
    }
  }
}

// One forward / backward step: storage T, values rounded to R.
template <typename T, typename R>
void forward_step_as(const ForwardStep& s) {
  const int64_t S = s.S;
  T* g = static_cast<T*>(s.gates);
  const T* rec = static_cast<const T*>(s.rec);
  const T* b = static_cast<const T*>(s.bias);
  const T* oc = static_cast<const T*>(s.c_prev);
  T* h = static_cast<T*>(s.h);
  T* c = static_cast<T*>(s.c);
  T* h_n = static_cast<T*>(s.h_n);
  T* c_n = static_cast<T*>(s.c_n);
  for_rows(s.B, S, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      forward_row<T, R>(S, g + r * 3 * S, rec + r * 3 * S, b, oc + r * S, h + r * S, c + r * S);
      if (h_n) std::memcpy(h_n + r * S, h + r * S, sizeof(T) * S);
      if (c_n) std::memcpy(c_n + r * S, c + r * S, sizeof(T) * S);
    }
  });
}

template <typename T, typename R>
void backward_step_as(const BackwardStep& s) {
  const T* go = static_cast<const T*>(s.grad_out);
  // On the CPU the recurrent product always comes precomputed (rec);
  // extra (grad_h_n) only comes at the last step, where rec is absent.
  const T* other = static_cast<const T*>(s.rec ? s.rec : s.extra);
  const T* dc_in = static_cast<const T*>(s.dc_in);
  const T* g = static_cast<const T*>(s.gates);
  const T* oc = static_cast<const T*>(s.c_prev);
  T* dg = static_cast<T*>(s.d_gates);
  T* dc_out = static_cast<T*>(s.dc_out);
  const bool dc = dc_in != nullptr;
  const int64_t S = s.S;
  for_rows(s.B, S, [&](int64_t r0, int64_t r1) {
    if (go && other) {
      backward_rows_dc<T, R, true, true>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
    } else if (go) {
      backward_rows_dc<T, R, true, false>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
    } else if (other) {
      backward_rows_dc<T, R, false, true>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
    } else {
      backward_rows_dc<T, R, false, false>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
    }
  });
}

struct CpuDev {
  static bool fused(const Tensor&, const Dims&) { return false; }
  static bool forward_steps(const Tensor&, const ForwardSteps&) { return false; }
  static bool steps_read_weights(const Tensor&, const Dims&) { return false; }
  static bool step_product(const Tensor&, const StepProduct&, ProductWorkspace&) {
    return false;  // aten::mm (torch's BLAS)
  }
  static bool product(const Tensor&, const char*, Tensor&, const Tensor&, const Tensor&, bool, bool,
                      ProductWorkspace&) {
    return false;  // aten::mm
  }
  static int64_t step_splits(const Tensor&, int64_t, int64_t, int64_t, int64_t) {
    return 1;  // one aten::mm; forward_step_as / backward_step_as read one product
  }
  static bool parts_product(const Tensor&, const PartsProduct&, ProductWorkspace&) {
    return false;  // never reached: no parts (step_splits)
  }
  static bool backward_steps(const Tensor&, const BackwardSteps&) { return false; }

  static void forward_step(const Tensor& like, const ForwardStep& s) {
    opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
      using T = decltype(tag);
      forward_step_as<T, T>(s);
    });
  }

  static void backward_step(const Tensor& like, const BackwardStep& s, bool /*fused*/) {
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      backward_step_as<T, T>(s);
    });
  }

  // The bias gradient: float64 column sums, chunk by chunk (fixed order).
  static Tensor bias_partial(const Tensor& like, const Dims& d, bool) {
    Tensor p = empty_contiguous(kSeqBackward, "the bias-gradient sums", like, {3 * d.S},
                                aoti_torch_dtype_float64());
    zero(p);
    return p;
  }

  // (Never fused on the CPU: the template's call only.)
  static Tensor transposed(const char*, const Tensor& t, int64_t rows, int64_t cols, int64_t ld) {
    return torch::stable::contiguous(view_of(t, {cols, rows}, {1, ld}));
  }

  static void zero(Tensor& t) {
    if (t.numel() > 0) std::memset(t.mutable_data_ptr(), 0, t.numel() * t.element_size());
  }

  static void copy(const Tensor&, void* dst, const void* src, int64_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
  static void zero_bytes(const Tensor&, void* dst, int64_t bytes) {
    if (bytes > 0) std::memset(dst, 0, static_cast<size_t>(bytes));
  }

  static void bias_chunk(const Tensor& like, Tensor& partial, const Tensor& dG2) {
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      const int64_t rows = dG2.size(0), cols = dG2.size(1);
      const T* src = dG2.const_data_ptr<T>();
      double* acc = partial.mutable_data_ptr<double>();
      // Columns in parallel, rows in order: the same sums for any thread count.
      auto body = [&](int64_t c0, int64_t c1) {
        for (int64_t r = 0; r < rows; ++r) {
          const T* row = src + r * cols;
          for (int64_t c = c0; c < c1; ++c) acc[c] += static_cast<double>(cpu_math::widen(row[c]));
        }
      };
      if (rows * cols < opscommon::kCpuGrainSize) {
        body(0, cols);
      } else {
        torch::stable::parallel_for(0, cols, 256, body);
      }
    });
  }

  static void bias_finish(const Tensor& partial, Tensor& d_bias) {
    opscommon::dispatch_floating(d_bias.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      using A = opscommon::acc_t<T>;
      const double* acc = partial.const_data_ptr<double>();
      T* out = d_bias.mutable_data_ptr<T>();
      for (int64_t c = 0; c < d_bias.numel(); ++c) out[c] = static_cast<T>(static_cast<A>(acc[c]));
    });
  }

  // dst (rows of stride dst.stride(0), unit columns) += src (contiguous).
  static void add_into(Tensor& dst, const Tensor& src) {
    opscommon::dispatch_floating(dst.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      const int64_t rows = dst.size(0), cols = dst.size(1), ld = dst.stride(0);
      T* out = dst.mutable_data_ptr<T>();
      const T* in = src.const_data_ptr<T>();
      for_rows(rows, cols, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            out[r * ld + c] = cpu_math::narrow<T>(cpu_math::widen(out[r * ld + c]) +
                                                  cpu_math::widen(in[r * cols + c]));
          }
        }
      });
    });
  }
};

// Half types with the matrix products in float32. torch's CPU matrix
// product in float16/bfloat16 is, on CPUs without bf16/fp16 matrix
// instructions, a scalar dot-product loop about 10x slower than its float32
// one (T64 B16 F32 S128 on an AVX2 machine: 260 us for a step's recurrent
// product against 25 us), and the sequence does more of them than a loop of
// cells (X W_x^T and h W_h^T apart, where a cell does [h, x] W^T once). Here
// the driver runs on float32 buffers that hold values of R: every value the
// native path stores in R (pre-activations, h, c, their gradients) is
// rounded to R's precision as it is stored, so the results are the native
// path's except that the products are no longer rounded to R before they
// are added (one rounding fewer: P + rec + bias is rounded once, and the
// weight gradient's chunk partial sums are not rounded).
template <typename R>
struct CpuDevF32 : CpuDev {
  static void forward_step(const Tensor&, const ForwardStep& s) { forward_step_as<float, R>(s); }
  static void backward_step(const Tensor&, const BackwardStep& s, bool) {
    backward_step_as<float, R>(s);
  }
};

// Whether the half-type sequence ops run their products in float32:
// LLTM_OP_SEQUENCE_CPU_FLOAT32=1 / 0 forces it either way (tests, tuning);
// by default yes, except on x86 CPUs with the bf16 / fp16 matrix
// instructions (AVX512-BF16, AMX-BF16 / AVX512-FP16) that torch's half-type
// products use (through oneDNN), where those are the faster ones.
bool float32_products(opscommon::ScalarType dtype) {
  if (dtype != opscommon::ScalarType::BFloat16 && dtype != opscommon::ScalarType::Half) {
    return false;
  }
  const int64_t forced = env_int("LLTM_OP_SEQUENCE_CPU_FLOAT32", -1);
  if (forced >= 0) return forced != 0;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if (dtype == opscommon::ScalarType::BFloat16) {
    return !(__builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16"));
  }
  return !__builtin_cpu_supports("avx512fp16");
#else
  (void)dtype;
  return true;
#endif
}

// t (any strides) converted to a contiguous tensor of dtype `To`, element by
// element (cpu_math's conversions: exact from a half type to float, rounded
// to nearest even back).
template <typename To, typename From>
Tensor converted(const char* op, const char* what, const Tensor& t, int32_t to_dtype) {
  std::vector<int64_t> sizes(t.dim());
  for (int64_t k = 0; k < t.dim(); ++k) sizes[k] = t.size(k);
  Tensor out = empty_contiguous(op, what, t, sizes, to_dtype);
  const int64_t n = t.numel();
  if (n == 0) return out;
  const Tensor src = dense(t);
  const From* in = src.const_data_ptr<From>();
  To* o = out.mutable_data_ptr<To>();
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) o[i] = cpu_math::narrow<To>(cpu_math::widen(in[i]));
  };
  if (n < opscommon::kCpuGrainSize) {
    body(0, n);
  } else {
    torch::stable::parallel_for(0, n, opscommon::kCpuGrainSize, body);
  }
  return out;
}

template <typename R>
Tensor to_f32(const char* op, const char* what, const Tensor& t) {
  return converted<float, R>(op, what, t, aoti_torch_dtype_float32());
}

template <typename R>
std::optional<Tensor> to_f32(const char* op, const char* what, const std::optional<Tensor>& t) {
  if (!t) return std::nullopt;
  return to_f32<R>(op, what, *t);
}

template <typename R>
Tensor from_f32(const char* op, const char* what, const Tensor& t) {
  const int32_t dtype = std::is_same_v<R, opscommon::BFloat16> ? aoti_torch_dtype_bfloat16()
                                                               : aoti_torch_dtype_float16();
  return converted<R, float>(op, what, t, dtype);
}

// f(R{}) with R the half type of dtype (bfloat16 or float16).
template <typename F>
void dispatch_half(opscommon::ScalarType dtype, const F& f) {
  if (dtype == opscommon::ScalarType::BFloat16) {
    f(opscommon::BFloat16{});
  } else {
    f(opscommon::Half{});
  }
}

}  // namespace

// allow_tf32: the CPU products have no TF32 mode (the argument is for CUDA).
// batch_sizes: see StepRows (lltm_sequence.h).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sequence_forward_cpu(
    Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell, bool allow_tf32,
    std::optional<Tensor> batch_sizes) {
  const auto dtype = input.scalar_type();
  if (!float32_products(dtype)) {
    ForwardResult r =
        sequence_forward<CpuDev>(input, weights, bias, old_h, old_cell, allow_tf32, batch_sizes);
    return {r.outputs, r.h_n, r.c_n, r.gates, r.cells};
  }
  // Checked before anything is converted (the same messages as the driver's).
  const char* op = kSeqForward;
  check_forward_args(op, input, weights, bias, old_h, old_cell);
  std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> out;
  dispatch_half(dtype, [&](auto tag) {
    using R = decltype(tag);
    ForwardResult r = sequence_forward<CpuDevF32<R>>(
        to_f32<R>(op, "input", input), to_f32<R>(op, "weights", weights),
        to_f32<R>(op, "bias", bias), to_f32<R>(op, "old_h", old_h),
        to_f32<R>(op, "old_cell", old_cell), allow_tf32, batch_sizes);
    out = {from_f32<R>(op, "outputs", r.outputs), from_f32<R>(op, "h_n", r.h_n),
           from_f32<R>(op, "c_n", r.c_n), from_f32<R>(op, "gates", r.gates),
           from_f32<R>(op, "cells", r.cells)};
  });
  return out;
}

// The forward with nothing kept for a backward (see sequence_forward).
std::tuple<Tensor, Tensor, Tensor> sequence_inference_cpu(Tensor input, Tensor weights, Tensor bias,
                                                          Tensor old_h, Tensor old_cell,
                                                          bool allow_tf32,
                                                          std::optional<Tensor> batch_sizes) {
  const auto dtype = input.scalar_type();
  if (!float32_products(dtype)) {
    ForwardResult r = sequence_forward<CpuDev>(input, weights, bias, old_h, old_cell, allow_tf32,
                                               batch_sizes, /*inference=*/true);
    return {r.outputs, r.h_n, r.c_n};
  }
  const char* op = kSeqInference;
  check_forward_args(op, input, weights, bias, old_h, old_cell);
  std::tuple<Tensor, Tensor, Tensor> out;
  dispatch_half(dtype, [&](auto tag) {
    using R = decltype(tag);
    ForwardResult r = sequence_forward<CpuDevF32<R>>(
        to_f32<R>(op, "input", input), to_f32<R>(op, "weights", weights),
        to_f32<R>(op, "bias", bias), to_f32<R>(op, "old_h", old_h),
        to_f32<R>(op, "old_cell", old_cell), allow_tf32, batch_sizes, /*inference=*/true);
    out = {from_f32<R>(op, "outputs", r.outputs), from_f32<R>(op, "h_n", r.h_n),
           from_f32<R>(op, "c_n", r.c_n)};
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sequence_backward_cpu(
    std::optional<Tensor> grad_outputs, std::optional<Tensor> grad_h_n,
    std::optional<Tensor> grad_c_n, Tensor input, Tensor weights, Tensor old_h, Tensor old_cell,
    Tensor outputs, Tensor gates, Tensor cells, bool input_grad, bool allow_tf32,
    std::optional<Tensor> batch_sizes) {
  const auto dtype = input.scalar_type();
  if (!float32_products(dtype)) {
    BackwardResult r =
        sequence_backward<CpuDev>(grad_outputs, grad_h_n, grad_c_n, input, weights, old_h, old_cell,
                                  outputs, gates, cells, input_grad, allow_tf32, batch_sizes);
    return {r.d_input, r.d_weights, r.d_bias, r.d_old_h, r.d_old_cell};
  }
  const char* op = kSeqBackward;
  check_backward_args(grad_outputs, grad_h_n, grad_c_n, input, weights, old_h, old_cell, outputs,
                      gates, cells);
  std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> out;
  dispatch_half(dtype, [&](auto tag) {
    using R = decltype(tag);
    BackwardResult r = sequence_backward<CpuDevF32<R>>(
        to_f32<R>(op, "grad_outputs", grad_outputs), to_f32<R>(op, "grad_h_n", grad_h_n),
        to_f32<R>(op, "grad_c_n", grad_c_n), to_f32<R>(op, "input", input),
        to_f32<R>(op, "weights", weights), to_f32<R>(op, "old_h", old_h),
        to_f32<R>(op, "old_cell", old_cell), to_f32<R>(op, "outputs", outputs),
        to_f32<R>(op, "gates", gates), to_f32<R>(op, "cells", cells), input_grad, allow_tf32,
        batch_sizes);
    out = {from_f32<R>(op, "d_input", r.d_input), from_f32<R>(op, "d_weights", r.d_weights),
           from_f32<R>(op, "d_bias", r.d_bias), from_f32<R>(op, "d_old_h", r.d_old_h),
           from_f32<R>(op, "d_old_cell", r.d_old_cell)};
  });
  return out;
}

}  // namespace seq
}  // namespace lltm_op

STABLE_TORCH_LIBRARY_FRAGMENT(lltm_op, m) {
  // The LLTM over a sequence. input [T, B, F], weights [3S, S+F], bias [3S],
  // old_h and old_cell [B, S]. outputs [T, B, S] holds the h of every step;
  // h_n and c_n are the final state. gates [T, B, 3S] (the pre-activations)
  // and cells [T, B, S] (the cell state of every step) are what the backward
  // needs: outputs for autograd to save, not for users. allow_tf32: float32
  // recurrent products may run on TF32 tensor cores (CUDA, sm_80+), what
  // torch's float32 matmul precision "high" allows its own products; the
  // Python wrapper passes torch's setting. batch_sizes: a packed run
  // (LLTMSequence on a PackedSequence, padded to [T, B, F], sequences sorted
  // longest first): step t runs the first batch_sizes[t] rows, each row's
  // h_n / c_n are those of its own last step, and rows past their end are
  // zero in outputs and cells.
  m.def(
      "sequence_forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell, "
      "bool allow_tf32=False, Tensor? batch_sizes=None) -> (Tensor outputs, Tensor h_n, "
      "Tensor c_n, Tensor gates, Tensor cells)");
  // sequence_forward's outputs, h_n and c_n with nothing kept for a
  // backward (inference): the cell states of two steps, and past 16 MiB the
  // input projection of a quarter of the steps (at least 32) at a time, so
  // that a long run takes less memory than a loop of cells
  // (inference_chunk_steps). Not differentiable (an error if a gradient is
  // asked for).
  m.def(
      "sequence_inference(Tensor input, Tensor weights, Tensor bias, Tensor old_h, "
      "Tensor old_cell, bool allow_tf32=False, Tensor? batch_sizes=None) -> (Tensor outputs, "
      "Tensor h_n, Tensor c_n)");
  // Gradients of input (an empty [0] tensor unless input_grad), weights,
  // bias, old_h and old_cell; an absent (None) incoming gradient counts as
  // zero. The autograd of sequence_forward (sequence.py) calls this; it has
  // no derivative of its own.
  m.def(
      "sequence_backward(Tensor? grad_outputs, Tensor? grad_h_n, Tensor? grad_c_n, Tensor input, "
      "Tensor weights, Tensor old_h, Tensor old_cell, Tensor outputs, Tensor gates, Tensor cells, "
      "bool input_grad, bool allow_tf32=False, Tensor? batch_sizes=None) -> (Tensor d_input, "
      "Tensor d_weights, Tensor d_bias, Tensor d_old_h, Tensor d_old_cell)");
}

STABLE_TORCH_LIBRARY_IMPL(lltm_op, CPU, m) {
  m.impl("sequence_forward", TORCH_BOX(&lltm_op::seq::sequence_forward_cpu));
  m.impl("sequence_inference", TORCH_BOX(&lltm_op::seq::sequence_inference_cpu));
  m.impl("sequence_backward", TORCH_BOX(&lltm_op::seq::sequence_backward_cpu));
}
