// lltm_op: schemas of the fused LLTM cell ops and their CPU kernels.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lltm.h"
#include "lltm_cpu_math.h"
#include "opscommon/checks.h"
#include "opscommon/cpu.h"
#include "opscommon/dispatch.h"

namespace lltm_op {

using torch::stable::Tensor;

namespace {

// The vectorizable row loops: out of line (their __restrict__ parameters are
// what tells the vectorizer the rows don't alias; inlining would lose that)
// and, with GCC on x86-64 glibc, compiled twice, for the x86-64 baseline
// (SSE2) and for x86-64-v3 (AVX2, FMA), picked at load time by the CPU: the
// wheel stays baseline but runs the cell about 2.5x faster on AVX2 machines.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define LLTM_ROW_FN __attribute__((noinline, target_clones("arch=x86-64-v3", "default")))
#elif defined(__GNUC__)
#define LLTM_ROW_FN __attribute__((noinline))
#else
#define LLTM_ROW_FN
#endif

// Rows per bias-gradient partial sum in the backward.
constexpr int64_t kSumRows = 64;

// Rows of work per parallel chunk: about kCpuGrainSize elements.
int64_t row_grain(int64_t state) {
  return std::max<int64_t>(1, opscommon::kCpuGrainSize / std::max<int64_t>(1, state));
}

template <typename F>
void for_rows(int64_t batch, int64_t state, const F& body) {
  if (batch * state < opscommon::kCpuGrainSize) {
    body(0, batch);
  } else {
    torch::stable::parallel_for(0, batch, row_grain(state), body);
  }
}

// float, float16, bfloat16: vectorizable float math; float64: the C library.
template <typename T>
using CpuMath = std::conditional_t<std::is_same_v<T, double>, AccurateMath, CpuVectorMath>;

// Storage <-> accumulator conversions of the row loops: cpu_math's
// branch-free ones, bit for bit c10's. With c10's own the float16 rows do not
// vectorize (on x86-64 and on aarch64 alike; see lltm_cpu_math.h).
using cpu_math::widen;

// -- forward ------------------------------------------------------------------

// One row, every operand with unit column stride: a loop the compiler
// vectorizes (no calls, no branches, no aliasing the loads can't rule out).
template <typename T>
LLTM_ROW_FN void forward_row_contiguous(int64_t S, const T* __restrict__ g, const T* __restrict__ b,
                                        const T* __restrict__ oc, T* __restrict__ h,
                                        T* __restrict__ c) {
  using A = opscommon::acc_t<T>;
  for (int64_t j = 0; j < S; ++j) {
    A nh, nc;
    cell_forward_math<A, CpuMath<T>>(widen(g[j]) + widen(b[j]), widen(g[S + j]) + widen(b[S + j]),
                                     widen(g[2 * S + j]) + widen(b[2 * S + j]), widen(oc[j]), nh,
                                     nc);
    h[j] = cpu_math::narrow<T>(nh);
    c[j] = cpu_math::narrow<T>(nc);
  }
}

// Any strides.
template <typename T>
void forward_row_strided(int64_t r, int64_t S, Mat<T> g, Mat<T> b, Mat<T> oc, T* h, T* c) {
  using A = opscommon::acc_t<T>;
  const T* gr = g.p + r * g.rs;
  const T* cr = oc.p + r * oc.rs;
  for (int64_t j = 0; j < S; ++j) {
    A pre[3];
    for (int k = 0; k < 3; ++k) {
      const int64_t col = k * S + j;
      pre[k] = widen(gr[col * g.cs]) + widen(b.p[col * b.cs]);
    }
    A nh, nc;
    cell_forward_math<A, CpuMath<T>>(pre[0], pre[1], pre[2], widen(cr[j * oc.cs]), nh, nc);
    h[j] = cpu_math::narrow<T>(nh);
    c[j] = cpu_math::narrow<T>(nc);
  }
}

template <typename T>
void forward_rows(int64_t r0, int64_t r1, int64_t S, Mat<T> g, Mat<T> b, Mat<T> oc, T* new_h,
                  T* new_c) {
  const bool contiguous = g.cs == 1 && b.cs == 1 && oc.cs == 1;
  for (int64_t r = r0; r < r1; ++r) {
    if (contiguous) {
      forward_row_contiguous<T>(S, g.p + r * g.rs, b.p, oc.p + r * oc.rs, new_h + r * S,
                                new_c + r * S);
    } else {
      forward_row_strided<T>(r, S, g, b, oc, new_h + r * S, new_c + r * S);
    }
  }
}

// -- backward -----------------------------------------------------------------

// One row with unit column strides; kGh / kGc: whether grad_h / grad_cell
// exist (absent ones are zero); kNew: oc holds new_cell, not old_cell. Adds
// the row's d_gates (before rounding to T) into acc[0, 3S).
template <typename T, bool kGh, bool kGc, bool kNew>
LLTM_ROW_FN void backward_row_contiguous(int64_t S, const T* __restrict__ gh,
                                         const T* __restrict__ gc, const T* __restrict__ g,
                                         const T* __restrict__ b, const T* __restrict__ oc,
                                         T* __restrict__ dg, T* __restrict__ dc,
                                         opscommon::acc_t<T>* __restrict__ acc) {
  using A = opscommon::acc_t<T>;
  for (int64_t j = 0; j < S; ++j) {
    A d_i, d_o, d_z, d_c;
    cell_backward_math<A, CpuMath<T>, kNew>(
        kGh ? widen(gh[j]) : A(0), kGc ? widen(gc[j]) : A(0), widen(g[j]) + widen(b[j]),
        widen(g[S + j]) + widen(b[S + j]), widen(g[2 * S + j]) + widen(b[2 * S + j]), widen(oc[j]),
        d_i, d_o, d_z, d_c);
    dg[j] = cpu_math::narrow<T>(d_i);
    dg[S + j] = cpu_math::narrow<T>(d_o);
    dg[2 * S + j] = cpu_math::narrow<T>(d_z);
    dc[j] = cpu_math::narrow<T>(d_c);
    acc[j] += d_i;
    acc[S + j] += d_o;
    acc[2 * S + j] += d_z;
  }
}

// Any strides, absent gradients as null pointers.
template <typename T, bool kNew>
void backward_row_strided(int64_t r, int64_t S, Mat<T> gh, Mat<T> gc, Mat<T> g, Mat<T> b, Mat<T> oc,
                          T* dg, T* dc, opscommon::acc_t<T>* acc) {
  using A = opscommon::acc_t<T>;
  const T* gr = g.p + r * g.rs;
  const T* cr = oc.p + r * oc.rs;
  for (int64_t j = 0; j < S; ++j) {
    A pre[3];
    for (int k = 0; k < 3; ++k) {
      const int64_t col = k * S + j;
      pre[k] = widen(gr[col * g.cs]) + widen(b.p[col * b.cs]);
    }
    const A grad_h = gh.p ? widen(gh.p[r * gh.rs + j * gh.cs]) : A(0);
    const A grad_c = gc.p ? widen(gc.p[r * gc.rs + j * gc.cs]) : A(0);
    A d[3], d_c;
    cell_backward_math<A, CpuMath<T>, kNew>(grad_h, grad_c, pre[0], pre[1], pre[2],
                                            widen(cr[j * oc.cs]), d[0], d[1], d[2], d_c);
    for (int k = 0; k < 3; ++k) {
      dg[k * S + j] = cpu_math::narrow<T>(d[k]);
      acc[k * S + j] += d[k];
    }
    dc[j] = cpu_math::narrow<T>(d_c);
  }
}

// d_gates and d_old_cell of rows [r0, r1), their d_gates summed into acc.
template <typename T, bool kNew>
void backward_rows(int64_t r0, int64_t r1, int64_t S, Mat<T> gh, Mat<T> gc, Mat<T> g, Mat<T> b,
                   Mat<T> oc, T* d_gates, T* d_old_c, opscommon::acc_t<T>* acc) {
  const bool unit = g.cs == 1 && b.cs == 1 && oc.cs == 1 && (gh.p == nullptr || gh.cs == 1) &&
                    (gc.p == nullptr || gc.cs == 1);
  for (int64_t r = r0; r < r1; ++r) {
    T* dg = d_gates + r * 3 * S;
    T* dc = d_old_c + r * S;
    if (!unit) {
      backward_row_strided<T, kNew>(r, S, gh, gc, g, b, oc, dg, dc, acc);
      continue;
    }
    const T* ghr = gh.p ? gh.p + r * gh.rs : nullptr;
    const T* gcr = gc.p ? gc.p + r * gc.rs : nullptr;
    const T* gr = g.p + r * g.rs;
    const T* cr = oc.p + r * oc.rs;
    if (ghr && gcr) {
      backward_row_contiguous<T, true, true, kNew>(S, ghr, gcr, gr, b.p, cr, dg, dc, acc);
    } else if (ghr) {
      backward_row_contiguous<T, true, false, kNew>(S, ghr, gcr, gr, b.p, cr, dg, dc, acc);
    } else if (gcr) {
      backward_row_contiguous<T, false, true, kNew>(S, ghr, gcr, gr, b.p, cr, dg, dc, acc);
    } else {
      backward_row_contiguous<T, false, false, kNew>(S, ghr, gcr, gr, b.p, cr, dg, dc, acc);
    }
  }
}

}  // namespace

std::tuple<Tensor, Tensor> cell_forward_cpu(Tensor gates, Tensor bias, Tensor old_cell) {
  int64_t B = 0, S = 0;
  check_cell_args(kCellForward, gates, bias, old_cell, B, S);
  Tensor new_h = opscommon::empty_contiguous(kCellForward, gates, {B, S});
  Tensor new_c = opscommon::empty_contiguous(kCellForward, gates, {B, S});
  if (B == 0 || S == 0) return {new_h, new_c};
  opscommon::dispatch_floating(gates.scalar_type(), kCellForward, [&](auto tag) {
    using T = decltype(tag);
    const Mat<T> g = mat_of<T>(gates), b = row_of<T>(bias), oc = mat_of<T>(old_cell);
    T* h = new_h.mutable_data_ptr<T>();
    T* c = new_c.mutable_data_ptr<T>();
    for_rows(B, S, [&](int64_t r0, int64_t r1) { forward_rows<T>(r0, r1, S, g, b, oc, h, c); });
  });
  return {new_h, new_c};
}

namespace {

// cell_backward (kNew = false: `cell` is old_cell) and
// cell_backward_from_new_cell (kNew = true: `cell` is new_cell).
template <bool kNew>
std::tuple<Tensor, Tensor, Tensor> cell_backward_impl(const std::optional<Tensor>& grad_h,
                                                      const std::optional<Tensor>& grad_cell,
                                                      const Tensor& gates, const Tensor& bias,
                                                      const Tensor& cell) {
  const char* op = kNew ? kCellBackwardFromNewCell : kCellBackward;
  int64_t B = 0, S = 0;
  check_backward_args(grad_h, grad_cell, gates, bias, cell, B, S, kNew);
  Tensor d_gates = opscommon::empty_contiguous(op, gates, {B, 3 * S});
  Tensor d_bias = opscommon::empty_contiguous(op, gates, {3 * S});
  Tensor d_old_c = opscommon::empty_contiguous(op, gates, {B, S});
  // No elements: nothing to compute (a long batch of empty rows included),
  // and d_bias, a sum over no rows, is zero.
  if (S == 0) return {d_gates, d_bias, d_old_c};
  if (B == 0) {
    opscommon::dispatch_floating(gates.scalar_type(), op, [&](auto tag) {
      using T = decltype(tag);
      std::fill_n(d_bias.mutable_data_ptr<T>(), 3 * S, T(0));
    });
    return {d_gates, d_bias, d_old_c};
  }
  opscommon::dispatch_floating(gates.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    using A = opscommon::acc_t<T>;
    const Mat<T> none{nullptr, 0, 0};
    const Mat<T> gh = grad_h ? mat_of<T>(*grad_h) : none;
    const Mat<T> gc = grad_cell ? mat_of<T>(*grad_cell) : none;
    const Mat<T> g = mat_of<T>(gates), b = row_of<T>(bias), oc = mat_of<T>(cell);
    T* dg = d_gates.mutable_data_ptr<T>();
    T* dc = d_old_c.mutable_data_ptr<T>();
    // Rows in chunks of kSumRows, each with its own bias-gradient partial
    // sum (short float sums), the partials then added in chunk order in
    // double. Chunk bounds depend on B only, so d_bias is the same bit for
    // bit whatever the thread count; chunks run in parallel for large work.
    const int64_t chunks = (B + kSumRows - 1) / kSumRows;
    std::vector<A> partial(static_cast<size_t>(chunks * 3 * S), A(0));
    auto run_chunks = [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t r0 = c * kSumRows, r1 = std::min(B, r0 + kSumRows);
        backward_rows<T, kNew>(r0, r1, S, gh, gc, g, b, oc, dg, dc, partial.data() + c * 3 * S);
      }
    };
    if (B * S < opscommon::kCpuGrainSize) {
      run_chunks(0, chunks);
    } else {
      const int64_t grain = std::max<int64_t>(1, row_grain(S) / kSumRows);
      torch::stable::parallel_for(0, chunks, grain, run_chunks);
    }
    std::vector<double> total(static_cast<size_t>(3 * S), 0.0);
    for (int64_t c = 0; c < chunks; ++c) {
      const A* pc = partial.data() + c * 3 * S;
      for (int64_t col = 0; col < 3 * S; ++col) total[col] += static_cast<double>(pc[col]);
    }
    T* db = d_bias.mutable_data_ptr<T>();
    for (int64_t col = 0; col < 3 * S; ++col) db[col] = static_cast<T>(static_cast<A>(total[col]));
  });
  return {d_gates, d_bias, d_old_c};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> cell_backward_cpu(std::optional<Tensor> grad_h,
                                                     std::optional<Tensor> grad_cell, Tensor gates,
                                                     Tensor bias, Tensor old_cell) {
  return cell_backward_impl<false>(grad_h, grad_cell, gates, bias, old_cell);
}

std::tuple<Tensor, Tensor, Tensor> cell_backward_from_new_cell_cpu(std::optional<Tensor> grad_h,
                                                                   std::optional<Tensor> grad_cell,
                                                                   Tensor gates, Tensor bias,
                                                                   Tensor new_cell) {
  return cell_backward_impl<true>(grad_h, grad_cell, gates, bias, new_cell);
}

}  // namespace lltm_op

STABLE_TORCH_LIBRARY(lltm_op, m) {
  // gates: [B, 3S], the matrix product [old_h, input] @ weights.t() before
  // the bias, columns in the order input gate, output gate, candidate cell;
  // bias: [3S]; old_cell: [B, S].
  m.def(
      "cell_forward(Tensor gates, Tensor bias, Tensor old_cell) "
      "-> (Tensor new_h, Tensor new_cell)");
  // Gradients of gates, bias and old_cell; an absent (None) incoming
  // gradient counts as zero. Differentiable (ops.py registers the same math
  // in torch ops as its derivative).
  m.def(
      "cell_backward(Tensor? grad_h, Tensor? grad_cell, Tensor gates, Tensor bias, "
      "Tensor old_cell) -> (Tensor d_gates, Tensor d_bias, Tensor d_old_cell)");
  // The same gradients from new_cell (cell_forward's output) instead of
  // old_cell: what the autograd of cell_forward saves and calls, so that the
  // caller may overwrite old_cell (a state buffer) in place after the step.
  m.def(
      "cell_backward_from_new_cell(Tensor? grad_h, Tensor? grad_cell, Tensor gates, "
      "Tensor bias, Tensor new_cell) -> (Tensor d_gates, Tensor d_bias, Tensor d_old_cell)");
}

STABLE_TORCH_LIBRARY_IMPL(lltm_op, CPU, m) {
  m.impl("cell_forward", TORCH_BOX(&lltm_op::cell_forward_cpu));
  m.impl("cell_backward", TORCH_BOX(&lltm_op::cell_backward_cpu));
  m.impl("cell_backward_from_new_cell", TORCH_BOX(&lltm_op::cell_backward_from_new_cell_cpu));
}
