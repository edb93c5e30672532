// lltm_op: schemas of the fused LLTM cell ops and their CPU kernels.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "lltm.h"
#include "opscommon/checks.h"
#include "opscommon/cpu.h"
#include "opscommon/dispatch.h"

namespace lltm_op {

using torch::stable::Tensor;

namespace {

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

template <typename T>
void forward_rows(int64_t r0, int64_t r1, int64_t S, Mat<T> g, Mat<T> b, Mat<T> oc, T* new_h,
                  T* new_c) {
  using A = opscommon::acc_t<T>;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gr = g.p + r * g.rs;
    const T* cr = oc.p + r * oc.rs;
    T* hr = new_h + r * S;
    T* nr = new_c + r * S;
    for (int64_t j = 0; j < S; ++j) {
      A pre[3];
      for (int k = 0; k < 3; ++k) {
        const int64_t col = k * S + j;
        pre[k] = static_cast<A>(gr[col * g.cs]) + static_cast<A>(b.p[col * b.cs]);
      }
      A h, c;
      cell_forward_math<A>(pre[0], pre[1], pre[2], static_cast<A>(cr[j * oc.cs]), h, c);
      hr[j] = static_cast<T>(h);
      nr[j] = static_cast<T>(c);
    }
  }
}

// d_gates and d_old_cell of rows [r0, r1); adds the rows' d_gates (before
// rounding to T) into d_bias_acc[0, 3S) when it is not null.
template <typename T>
void backward_rows(int64_t r0, int64_t r1, int64_t S, Mat<T> gh, Mat<T> gc, Mat<T> g, Mat<T> b,
                   Mat<T> oc, T* d_gates, T* d_old_c, opscommon::acc_t<T>* d_bias_acc) {
  using A = opscommon::acc_t<T>;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gr = g.p + r * g.rs;
    const T* cr = oc.p + r * oc.rs;
    T* dg = d_gates + r * 3 * S;
    T* dc = d_old_c + r * S;
    for (int64_t j = 0; j < S; ++j) {
      A pre[3];
      for (int k = 0; k < 3; ++k) {
        const int64_t col = k * S + j;
        pre[k] = static_cast<A>(gr[col * g.cs]) + static_cast<A>(b.p[col * b.cs]);
      }
      const A grad_h = gh.p ? static_cast<A>(gh.p[r * gh.rs + j * gh.cs]) : A(0);
      const A grad_c = gc.p ? static_cast<A>(gc.p[r * gc.rs + j * gc.cs]) : A(0);
      A d[3], d_c;
      cell_backward_math<A>(grad_h, grad_c, pre[0], pre[1], pre[2], static_cast<A>(cr[j * oc.cs]),
                            d[0], d[1], d[2], d_c);
      for (int k = 0; k < 3; ++k) {
        dg[k * S + j] = static_cast<T>(d[k]);
        if (d_bias_acc) d_bias_acc[k * S + j] += d[k];
      }
      dc[j] = static_cast<T>(d_c);
    }
  }
}

}  // namespace

std::tuple<Tensor, Tensor> cell_forward_cpu(Tensor gates, Tensor bias, Tensor old_cell) {
  int64_t B = 0, S = 0;
  check_cell_args(kCellForward, gates, bias, old_cell, B, S);
  Tensor new_h = torch::stable::new_empty(gates, {B, S});
  Tensor new_c = torch::stable::new_empty(gates, {B, S});
  if (B * S == 0) return {new_h, new_c};
  opscommon::dispatch_floating(gates.scalar_type(), kCellForward, [&](auto tag) {
    using T = decltype(tag);
    const Mat<T> g = mat_of<T>(gates), b = row_of<T>(bias), oc = mat_of<T>(old_cell);
    T* h = new_h.mutable_data_ptr<T>();
    T* c = new_c.mutable_data_ptr<T>();
    for_rows(B, S, [&](int64_t r0, int64_t r1) { forward_rows<T>(r0, r1, S, g, b, oc, h, c); });
  });
  return {new_h, new_c};
}

std::tuple<Tensor, Tensor, Tensor> cell_backward_cpu(std::optional<Tensor> grad_h,
                                                     std::optional<Tensor> grad_cell,
                                                     Tensor gates, Tensor bias,
                                                     Tensor old_cell) {
  int64_t B = 0, S = 0;
  check_cell_args(kCellBackward, gates, bias, old_cell, B, S);
  if (grad_h) check_grad_arg(kCellBackward, "grad_h", *grad_h, gates, B, S);
  if (grad_cell) check_grad_arg(kCellBackward, "grad_cell", *grad_cell, gates, B, S);
  Tensor d_gates = torch::stable::new_empty(gates, {B, 3 * S});
  Tensor d_bias = torch::stable::new_empty(gates, {3 * S});
  Tensor d_old_c = torch::stable::new_empty(gates, {B, S});
  opscommon::dispatch_floating(gates.scalar_type(), kCellBackward, [&](auto tag) {
    using T = decltype(tag);
    using A = opscommon::acc_t<T>;
    const Mat<T> none{nullptr, 0, 0};
    const Mat<T> gh = grad_h ? mat_of<T>(*grad_h) : none;
    const Mat<T> gc = grad_cell ? mat_of<T>(*grad_cell) : none;
    const Mat<T> g = mat_of<T>(gates), b = row_of<T>(bias), oc = mat_of<T>(old_cell);
    T* dg = d_gates.mutable_data_ptr<T>();
    T* dc = d_old_c.mutable_data_ptr<T>();
    // Rows in parallel chunks, each with its own bias-gradient partial sum,
    // added in chunk order afterwards. Chunk bounds depend on B and S only,
    // so d_bias is the same bit for bit whatever the thread count.
    const int64_t grain = B * S < opscommon::kCpuGrainSize ? std::max<int64_t>(B, 1) : row_grain(S);
    const int64_t chunks = B == 0 ? 0 : (B + grain - 1) / grain;
    std::vector<A> partial(static_cast<size_t>(chunks * 3 * S), A(0));
    auto run_chunk = [&](int64_t c) {
      const int64_t r0 = c * grain, r1 = std::min(B, r0 + grain);
      backward_rows<T>(r0, r1, S, gh, gc, g, b, oc, dg, dc, partial.data() + c * 3 * S);
    };
    if (chunks <= 1) {
      for (int64_t c = 0; c < chunks; ++c) run_chunk(c);
    } else {
      torch::stable::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) run_chunk(c);
      });
    }
    T* db = d_bias.mutable_data_ptr<T>();
    for (int64_t col = 0; col < 3 * S; ++col) {
      A sum = A(0);
      for (int64_t c = 0; c < chunks; ++c) sum += partial[c * 3 * S + col];
      db[col] = static_cast<T>(sum);
    }
  });
  return {d_gates, d_bias, d_old_c};
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
  // gradient counts as zero. The autograd of cell_forward (ops.py) calls
  // this; it has no derivative of its own.
  m.def(
      "cell_backward(Tensor? grad_h, Tensor? grad_cell, Tensor gates, Tensor bias, "
      "Tensor old_cell) -> (Tensor d_gates, Tensor d_bias, Tensor d_old_cell)");
}

STABLE_TORCH_LIBRARY_IMPL(lltm_op, CPU, m) {
  m.impl("cell_forward", TORCH_BOX(&lltm_op::cell_forward_cpu));
  m.impl("cell_backward", TORCH_BOX(&lltm_op::cell_backward_cpu));
}
