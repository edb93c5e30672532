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

// One row of a forward step: g holds P + (on return) the full pre-activation.
template <typename T>
LLTM_SEQ_ROW_FN void forward_row(int64_t S, T* __restrict__ g, const T* __restrict__ rec,
                                 const T* __restrict__ b, const T* __restrict__ oc,
                                 T* __restrict__ h, T* __restrict__ c) {
  using A = opscommon::acc_t<T>;
  for (int64_t j = 0; j < S; ++j) {
    // The pre-activation is rounded to T once, as stored for the backward,
    // so that both passes see the same value.
    const T gi =
        static_cast<T>(static_cast<A>(g[j]) + static_cast<A>(rec[j]) + static_cast<A>(b[j]));
    const T go = static_cast<T>(static_cast<A>(g[S + j]) + static_cast<A>(rec[S + j]) +
                                static_cast<A>(b[S + j]));
    const T gz = static_cast<T>(static_cast<A>(g[2 * S + j]) + static_cast<A>(rec[2 * S + j]) +
                                static_cast<A>(b[2 * S + j]));
    g[j] = gi;
    g[S + j] = go;
    g[2 * S + j] = gz;
    A nh, nc;
    cell_forward_math<A, CpuMath<T>>(static_cast<A>(gi), static_cast<A>(go), static_cast<A>(gz),
                                     static_cast<A>(oc[j]), nh, nc);
    h[j] = static_cast<T>(nh);
    c[j] = static_cast<T>(nc);
  }
}

// One row of a backward step. kGo / kOther / kDc: whether grad_out, the
// other h-gradient (rec or extra) and dc_in exist. dc_in may equal dc_out.
template <typename T, bool kGo, bool kOther, bool kDc>
LLTM_SEQ_ROW_FN void backward_row(int64_t S, const T* __restrict__ go, const T* __restrict__ other,
                                  const T* dc_in, const T* __restrict__ g, const T* __restrict__ oc,
                                  T* __restrict__ dg, T* dc_out) {
  using A = opscommon::acc_t<T>;
  for (int64_t j = 0; j < S; ++j) {
    A grad_h = A(0);
    if (kGo) grad_h += static_cast<A>(go[j]);
    if (kOther) grad_h += static_cast<A>(other[j]);
    const A grad_c = kDc ? static_cast<A>(dc_in[j]) : A(0);
    A d_i, d_o, d_z, d_c;
    cell_backward_math<A, CpuMath<T>>(grad_h, grad_c, static_cast<A>(g[j]),
                                      static_cast<A>(g[S + j]), static_cast<A>(g[2 * S + j]),
                                      static_cast<A>(oc[j]), d_i, d_o, d_z, d_c);
    dg[j] = static_cast<T>(d_i);
    dg[S + j] = static_cast<T>(d_o);
    dg[2 * S + j] = static_cast<T>(d_z);
    dc_out[j] = static_cast<T>(d_c);
  }
}

template <typename T, bool kGo, bool kOther>
void backward_rows_dc(bool dc, int64_t r0, int64_t r1, int64_t S, const T* go, const T* other,
                      const T* dc_in, const T* g, const T* oc, T* dg, T* dc_out) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* gor = kGo ? go + r * S : nullptr;
    const T* otr = kOther ? other + r * S : nullptr;
    const T* dcr = dc ? dc_in + r * S : nullptr;
    if (dc) {
      backward_row<T, kGo, kOther, true>(S, gor, otr, dcr, g + r * 3 * S, oc + r * S,
                                         dg + r * 3 * S, dc_out + r * S);
    } else {
      backward_row<T, kGo, kOther, false>(S, gor, otr, dcr, g + r * 3 * S, oc + r * S,
                                          dg + r * 3 * S, dc_out + r * S);
    }
  }
}

struct CpuDev {
  static bool fused(const Tensor&, const Dims&) { return false; }
  static bool forward_steps(const Tensor&, const ForwardSteps&) { return false; }
  static bool backward_steps(const Tensor&, const BackwardSteps&) { return false; }

  static void forward_step(const Tensor& like, const ForwardStep& s) {
    opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
      using T = decltype(tag);
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
          forward_row<T>(S, g + r * 3 * S, rec + r * 3 * S, b, oc + r * S, h + r * S, c + r * S);
          if (h_n) std::memcpy(h_n + r * S, h + r * S, sizeof(T) * S);
          if (c_n) std::memcpy(c_n + r * S, c + r * S, sizeof(T) * S);
        }
      });
    });
  }

  static void backward_step(const Tensor& like, const BackwardStep& s, bool /*fused*/) {
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
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
          backward_rows_dc<T, true, true>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
        } else if (go) {
          backward_rows_dc<T, true, false>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
        } else if (other) {
          backward_rows_dc<T, false, true>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
        } else {
          backward_rows_dc<T, false, false>(dc, r0, r1, S, go, other, dc_in, g, oc, dg, dc_out);
        }
      });
    });
  }

  // The bias gradient: float64 column sums, chunk by chunk (fixed order).
  static Tensor bias_partial(const Tensor& like, const Dims& d, bool) {
    Tensor p =
        alloc(kSeqBackward, "the bias-gradient sums", like, {3 * d.S}, aoti_torch_dtype_float64());
    zero(p);
    return p;
  }

  static void zero(Tensor& t) {
    if (t.numel() > 0) std::memset(t.mutable_data_ptr(), 0, t.numel() * t.element_size());
  }

  static void copy(const Tensor&, void* dst, const void* src, int64_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
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
          for (int64_t c = c0; c < c1; ++c) acc[c] += static_cast<double>(row[c]);
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
      using A = opscommon::acc_t<T>;
      const int64_t rows = dst.size(0), cols = dst.size(1), ld = dst.stride(0);
      T* out = dst.mutable_data_ptr<T>();
      const T* in = src.const_data_ptr<T>();
      for_rows(rows, cols, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            out[r * ld + c] =
                static_cast<T>(static_cast<A>(out[r * ld + c]) + static_cast<A>(in[r * cols + c]));
          }
        }
      });
    });
  }
};

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sequence_forward_cpu(Tensor input,
                                                                        Tensor weights, Tensor bias,
                                                                        Tensor old_h,
                                                                        Tensor old_cell) {
  ForwardResult r = sequence_forward<CpuDev>(input, weights, bias, old_h, old_cell);
  return {r.outputs, r.h_n, r.c_n, r.gates, r.cells};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sequence_backward_cpu(
    std::optional<Tensor> grad_outputs, std::optional<Tensor> grad_h_n,
    std::optional<Tensor> grad_c_n, Tensor input, Tensor weights, Tensor old_h, Tensor old_cell,
    Tensor outputs, Tensor gates, Tensor cells, bool input_grad) {
  BackwardResult r = sequence_backward<CpuDev>(grad_outputs, grad_h_n, grad_c_n, input, weights,
                                               old_h, old_cell, outputs, gates, cells, input_grad);
  return {r.d_input, r.d_weights, r.d_bias, r.d_old_h, r.d_old_cell};
}

}  // namespace seq
}  // namespace lltm_op

STABLE_TORCH_LIBRARY_FRAGMENT(lltm_op, m) {
  // The LLTM over a sequence. input [T, B, F], weights [3S, S+F], bias [3S],
  // old_h and old_cell [B, S]. outputs [T, B, S] holds the h of every step;
  // h_n and c_n are the final state. gates [T, B, 3S] (the pre-activations)
  // and cells [T, B, S] (the cell state of every step) are what the backward
  // needs: outputs for autograd to save, not for users.
  m.def(
      "sequence_forward(Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell) "
      "-> (Tensor outputs, Tensor h_n, Tensor c_n, Tensor gates, Tensor cells)");
  // Gradients of input (an empty [0] tensor unless input_grad), weights,
  // bias, old_h and old_cell; an absent (None) incoming gradient counts as
  // zero. The autograd of sequence_forward (sequence.py) calls this; it has
  // no derivative of its own.
  m.def(
      "sequence_backward(Tensor? grad_outputs, Tensor? grad_h_n, Tensor? grad_c_n, Tensor input, "
      "Tensor weights, Tensor old_h, Tensor old_cell, Tensor outputs, Tensor gates, Tensor cells, "
      "bool input_grad) -> (Tensor d_input, Tensor d_weights, Tensor d_bias, Tensor d_old_h, "
      "Tensor d_old_cell)");
}

STABLE_TORCH_LIBRARY_IMPL(lltm_op, CPU, m) {
  m.impl("sequence_forward", TORCH_BOX(&lltm_op::seq::sequence_forward_cpu));
  m.impl("sequence_backward", TORCH_BOX(&lltm_op::seq::sequence_backward_cpu));
}
