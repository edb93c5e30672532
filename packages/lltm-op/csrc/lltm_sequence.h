// The LLTM over a whole sequence: what the CPU (lltm_sequence.cpp) and CUDA
// (lltm_sequence_cuda.cu) kernels share. The argument checks, the tensor
// plumbing (views, matrix products through torch's dispatcher) and the two
// drivers, templated on the device's step kernels.
//
// Notation: input [T, B, F], weights [3S, S+F] = [W_h | W_x] (columns
// multiplying [h, x], rows: input gate, output gate, candidate cell),
// bias [3S], old_h / old_cell [B, S].
//
// Forward (the algorithm of fast RNN libraries):
//   P = X W_x^T for all T steps at once        one matrix product [T*B, 3S]
//   per step t:  G_t = P_t + h_{t-1} W_h^T + b  the recurrent product (cuBLAS,
//                                               or fused into the step kernel
//                                               for small sizes on CUDA)
//                h_t, c_t = cell(G_t, c_{t-1})  one kernel; G_t is written
//                                               back over P_t (saved for
//                                               backward), h_t straight into
//                                               outputs[t], c_t into cells[t]
// Backward, steps in reverse, in chunks of K steps (so that dG, the gradient
// of the pre-activations, is held for K steps, not T):
//   per step t:  dh_t = grad_outputs[t] + dG_{t+1} W_h  (+ grad_h_n at T-1)
//                dG_t, dc_{t-1} = cell_backward(dh_t, dc_t, G_t, c_{t-1})
//   per chunk:   dW_h += dG^T H_prev, dW_x += dG^T X, d_input = dG W_x
//                (large products over all the chunk's steps at once)
//   at the end:  d_old_h = dG_0 W_h, d_old_cell = dc_{-1}, d_bias = sum dG
//
// Saved for backward: G [T, B, 3S] and the cell states [T, B, S] (both
// outputs of the forward op), the outputs (the h_t), input, weights, old_h
// and old_cell: 4S values per step and batch row beyond what the caller
// holds anyway.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "lltm.h"
#include "opscommon/checks.h"
#include "opscommon/tensor.h"

namespace lltm_op {
namespace seq {

using torch::stable::Tensor;

constexpr const char* kSeqForward = "lltm_op.sequence_forward";
constexpr const char* kSeqBackward = "lltm_op.sequence_backward";
constexpr const char* kSeqInference = "lltm_op.sequence_inference";

// -- checks -------------------------------------------------------------------

struct Dims {
  int64_t T = 0, B = 0, F = 0, S = 0;
  // The caller allows TF32 tensor cores for float32 recurrent products
  // (torch's float32 matmul precision "high"; the op's allow_tf32).
  bool tf32 = false;
  // Nothing is kept for a backward (sequence_inference): the device may
  // choose a path by the forward's time alone.
  bool inference = false;
};

// a * b, or an error naming the op when it would not fit in int64.
inline int64_t checked_mul(const char* op, int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  OPSCOMMON_CHECK(!__builtin_mul_overflow(a, b, &out), op, ": ", what,
                  " is too large (its element count overflows int64)");
  return out;
}

inline int64_t checked_add(const char* op, int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  OPSCOMMON_CHECK(!__builtin_add_overflow(a, b, &out), op, ": ", what,
                  " is too large (overflows int64)");
  return out;
}

// The element counts of every buffer the ops allocate must fit in int64
// (a tensor with a zero-size dimension can have others of any size).
inline void check_sizes_fit(const char* op, const Dims& d) {
  const int64_t s3 = checked_mul(op, 3, d.S, "the state size");
  checked_add(op, d.S, d.F, "state size + input features");
  const int64_t tb = checked_mul(op, d.T, d.B, "the sequence (T * B)");
  checked_mul(op, tb, s3, "the sequence (T * B * 3S)");
  checked_mul(op, tb, std::max<int64_t>(d.F, 1), "the input (T * B * F)");
  checked_mul(op, s3, checked_add(op, d.S, d.F, "S + F"), "the weights (3S * (S + F))");
}

// input [T, B, F], weights [3S, S+F], bias [3S], old_h [B, S], old_cell
// [B, S]: one floating dtype, one CPU or CUDA device. The Python fake kernel
// (sequence.py) raises the same messages in the same order.
inline Dims check_forward_args(const char* op, const Tensor& input, const Tensor& weights,
                               const Tensor& bias, const Tensor& old_h, const Tensor& old_cell) {
  check_operand(op, "input", input);
  check_operand(op, "weights", weights);
  check_operand(op, "bias", bias);
  check_operand(op, "old_h", old_h);
  check_operand(op, "old_cell", old_cell);
  opscommon::check_shape(op, "input", input, {-1, -1, -1});
  Dims d;
  d.T = input.size(0);
  d.B = input.size(1);
  d.F = input.size(2);
  opscommon::check_shape(op, "old_h", old_h, {d.B, -1});
  d.S = old_h.size(1);
  check_sizes_fit(op, d);
  opscommon::check_shape(op, "old_cell", old_cell, {d.B, d.S});
  opscommon::check_shape(op, "weights", weights, {3 * d.S, d.S + d.F});
  opscommon::check_shape(op, "bias", bias, {3 * d.S});
  opscommon::check_same_dtype(op, "input", input, "weights", weights);
  opscommon::check_same_dtype(op, "input", input, "bias", bias);
  opscommon::check_same_dtype(op, "input", input, "old_h", old_h);
  opscommon::check_same_dtype(op, "input", input, "old_cell", old_cell);
  opscommon::check_same_device(op, "input", input, "weights", weights);
  opscommon::check_same_device(op, "input", input, "bias", bias);
  opscommon::check_same_device(op, "input", input, "old_h", old_h);
  opscommon::check_same_device(op, "input", input, "old_cell", old_cell);
  return d;
}

inline void check_like(const char* op, const char* arg, const Tensor& t, const Tensor& input,
                       std::initializer_list<int64_t> shape) {
  check_operand(op, arg, t);
  opscommon::check_shape(op, arg, t, shape);
  opscommon::check_same_dtype(op, "input", input, arg, t);
  opscommon::check_same_device(op, "input", input, arg, t);
}

inline Dims check_backward_args(const std::optional<Tensor>& grad_outputs,
                                const std::optional<Tensor>& grad_h_n,
                                const std::optional<Tensor>& grad_c_n, const Tensor& input,
                                const Tensor& weights, const Tensor& old_h, const Tensor& old_cell,
                                const Tensor& outputs, const Tensor& gates, const Tensor& cells) {
  const char* op = kSeqBackward;
  check_operand(op, "input", input);
  opscommon::check_shape(op, "input", input, {-1, -1, -1});
  check_operand(op, "old_h", old_h);
  opscommon::check_shape(op, "old_h", old_h, {input.size(1), -1});
  Dims d;
  d.T = input.size(0);
  d.B = input.size(1);
  d.F = input.size(2);
  d.S = old_h.size(1);
  check_sizes_fit(op, d);
  opscommon::check_same_dtype(op, "input", input, "old_h", old_h);
  opscommon::check_same_device(op, "input", input, "old_h", old_h);
  check_like(op, "weights", weights, input, {3 * d.S, d.S + d.F});
  check_like(op, "old_cell", old_cell, input, {d.B, d.S});
  check_like(op, "outputs", outputs, input, {d.T, d.B, d.S});
  check_like(op, "gates", gates, input, {d.T, d.B, 3 * d.S});
  check_like(op, "cells", cells, input, {d.T, d.B, d.S});
  if (grad_outputs) check_like(op, "grad_outputs", *grad_outputs, input, {d.T, d.B, d.S});
  if (grad_h_n) check_like(op, "grad_h_n", *grad_h_n, input, {d.B, d.S});
  if (grad_c_n) check_like(op, "grad_c_n", *grad_c_n, input, {d.B, d.S});
  return d;
}

// The rows each step runs: all B, or (a packed run, PackedSequence's
// batch_sizes) the first batch_sizes[t] at step t: the sequences sorted
// longest first, each stopping after its own length (its h and c then final).
struct StepRows {
  int64_t B = 0;
  std::vector<int64_t> sizes;  // empty: every row every step
  bool packed() const { return !sizes.empty(); }
  int64_t at(int64_t t) const {
    if (!packed()) return B;
    return t < static_cast<int64_t>(sizes.size()) ? sizes[t] : 0;
  }
};

// batch_sizes: absent, or a CPU int64 [T] of non-increasing values in
// [0, B] (as a PackedSequence's).
inline StepRows check_batch_sizes(const char* op, const std::optional<Tensor>& batch_sizes,
                                  const Dims& d) {
  StepRows rows;
  rows.B = d.B;
  if (!batch_sizes) return rows;
  const Tensor& bs = *batch_sizes;
  opscommon::check_defined(op, "batch_sizes", bs);
  OPSCOMMON_CHECK(bs.is_cpu() && bs.scalar_type() == torch::headeronly::ScalarType::Long, op,
                  ": argument 'batch_sizes' must be an int64 CPU tensor (a PackedSequence's "
                  "batch_sizes)");
  opscommon::check_shape(op, "batch_sizes", bs, {d.T});
  const Tensor dense_bs = opscommon::contiguous_of(bs);
  const int64_t* v = dense_bs.const_data_ptr<int64_t>();
  rows.sizes.assign(v, v + d.T);
  int64_t before = d.B;
  for (int64_t t = 0; t < d.T; ++t) {
    OPSCOMMON_CHECK(rows.sizes[t] >= 0 && rows.sizes[t] <= before, op,
                    ": argument 'batch_sizes' must hold non-increasing sizes in [0, ", d.B,
                    "] (the batch), got ", rows.sizes[t], " at step ", t);
    before = rows.sizes[t];
  }
  return rows;
}

// -- tensors --------------------------------------------------------------------

// A fresh contiguous tensor; a failed allocation is an error that names the
// op, the buffer (`what`) and its size.
using opscommon::empty_contiguous;

// A view of base's storage (no dispatcher call): sizes and strides in
// elements, offset in elements from base's own first element (the shim's
// storage offset is an increment over base's).
inline Tensor view_of(const Tensor& base, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                      int64_t offset = 0) {
  AtenTensorHandle handle = nullptr;
  OPSCOMMON_SHIM_CHECK(
      aoti_torch__reinterpret_tensor(base.get(), static_cast<int64_t>(sizes.size()), sizes.data(),
                                     strides.data(), offset, &handle));
  return Tensor(handle);
}

// out = name.out(a, b) through torch's dispatcher (aten::mm, aten::bmm);
// false where it failed (torch printed why).
inline bool dispatch_out(const char* name, const Tensor& a, const Tensor& b, Tensor& out) {
  std::array<StableIValue, 3> stack{torch::stable::detail::from(a), torch::stable::detail::from(b),
                                    torch::stable::detail::from(out)};
  if (torch_call_dispatcher(name, "out", stack.data(), TORCH_ABI_VERSION) != AOTI_TORCH_SUCCESS)
    return false;
  // The returned `out` is a new handle to the same tensor: release it.
  (void)torch::stable::detail::to<Tensor>(stack[0]);
  return true;
}

// out = a @ b through torch's dispatcher (cuBLAS on CUDA, torch's BLAS on the
// CPU; any strides). out must have the right shape already.
inline void mm_out(const char* op, Tensor& out, const Tensor& a, const Tensor& b) {
  OPSCOMMON_CHECK(dispatch_out("aten::mm", a, b, out), op, ": the matrix product ",
                  opscommon::shape_str(a), " @ ", opscommon::shape_str(b), " (aten::mm) failed on ",
                  opscommon::device_str(a),
                  "; torch printed its reason above (out of memory, or arguments that require "
                  "grad: call the op below autograd)");
}

// A step's recurrent product a @ b (a: [M, K], b: [K, N], any strides) in
// `splits` parts of k: parts[z] = a[:, z Kc : (z + 1) Kc] @ b[z Kc : (z + 1)
// Kc, :] (Kc = K / splits) in the first M rows of part z of `parts`
// ([splits, rows, N], contiguous), one aten::bmm over strided views of a
// and b (no copies): where Dev::parts_product does not run them. The
// device's cell kernel adds the partials up.
inline void split_product(const char* op, Tensor& parts, const Tensor& a, const Tensor& b,
                          int64_t splits) {
  const int64_t M = a.size(0), kc = a.size(1) / splits, N = b.size(1);
  const Tensor a3 = view_of(a, {splits, M, kc}, {kc * a.stride(1), a.stride(0), a.stride(1)});
  const Tensor b3 = view_of(b, {splits, kc, N}, {kc * b.stride(0), b.stride(0), b.stride(1)});
  Tensor out = view_of(parts, {splits, M, N}, {parts.stride(0), N, 1});
  OPSCOMMON_CHECK(dispatch_out("aten::bmm", a3, b3, out), op, ": a step's recurrent product in ",
                  splits, " parts of k (", opscommon::shape_str(a3), " @ ",
                  opscommon::shape_str(b3), ", aten::bmm) failed on ", opscommon::device_str(a),
                  "; torch printed its reason above");
}

// A contiguous tensor equal to t (t itself when it already is one).
inline Tensor dense(const Tensor& t) { return opscommon::contiguous_of(t); }

// The environment variable `name` as an integer, or `fallback`.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end != v) ? static_cast<int64_t>(x) : fallback;
}

// How many chunks the backward splits the steps into: its dG buffer holds
// ceil(T / chunks) steps. The fewest chunks (each costs a few more matrix
// products) that keep dG per step below S + F values per batch row, what a
// loop of cells keeps per step ([h, x] for its matrix product) and this op
// does not: so that the sequence never needs more memory than the loop.
// LLTM_OP_SEQUENCE_CHUNKS overrides (tests, tuning).
inline int64_t backward_chunks(const Dims& d) {
  const int64_t wanted = d.S > 0 ? (3 * d.S) / (d.S + d.F) + 1 : 1;  // 3S / chunks < S + F
  const int64_t chunks = env_int("LLTM_OP_SEQUENCE_CHUNKS", wanted);
  return std::max<int64_t>(1, std::min<int64_t>(chunks, d.T));
}

// -- what the device provides ----------------------------------------------------

// One forward step. gates: [B, 3S] holding P_t (x_t W_x^T) on entry and the
// full pre-activation G_t on return. rec: [B, 3S] = h_prev W_h^T, or null
// when the device computes it itself from h_prev and w_hT ([S, 3S],
// contiguous). h_n / c_n: null, or where the last step also writes h and c.
struct ForwardStep {
  int64_t B, S;
  void* gates;
  const void* rec;
  const void* bias;
  const void* h_prev;
  const void* w_hT;
  const void* c_prev;
  void* h;
  void* c;
  void* h_n;
  void* c_n;
  // rec is null because the step product was already added into gates
  // (Dev::step_product), not because the device computes it.
  bool product_in_gates = false;
  // rec holds rec_splits partial products (split_product), rec_stride
  // elements apart, that the cell adds up; 1: rec is the product.
  int64_t rec_splits = 1, rec_stride = 0;
  // false: an inference step, whose pre-activations nothing reads after its
  // cell; the cuBLAS path's cell kernels then leave them out of `gates`
  // (the fused and CPU steps write them either way).
  bool keep_gates = true;
};

// One forward step's recurrent product on the cuBLAS path, added into the
// gates (which hold the input projection): G_t = P_t + h_{t-1} W_h^T, that
// is gates[r, c] += sum over k < S of h[r * S + k] * w_h[c * ldw + k] for
// r < rows, c < 3S (gates rows of stride 3S).
struct StepProduct {
  const char* op;  // for errors
  int64_t rows, S;
  const void* h;
  const void* w_h;
  int64_t ldw;
  void* gates;
  bool tf32;
};

// A step's recurrent product in `splits` parts of k for the device to run
// itself (Dev::parts_product), as split_product: part z, the first M rows
// (row stride N) of `parts` + z * part_stride, = a[:, z Kc : (z + 1) Kc] @
// b[z Kc : (z + 1) Kc, :] (Kc = K / splits), a [M, K] and b [K, N] with the
// strides given (elements).
struct Strided {  // a matrix in memory: its first element, row and column strides
  const void* data;
  int64_t row, col;
};
struct PartsProduct {
  const char* op;  // for errors
  int64_t splits, M, N, K;
  Strided a, b;
  void* parts;
  int64_t part_stride;
  bool tf32;
};

// One backward step. dh = grad_out + rec (+ extra); any of the three may be
// null (zero). rec: [B, S] = dG_{t+1} W_h, or null when the device computes
// it from dG_next ([B, 3S]) and w_h ([3S, S] rows of stride ld). dc_in:
// gradient of c_t (null: zero); dc_out: gradient of c_{t-1} (may equal
// dc_in: each element is read before it is written, by the same thread).
// d_gates: [B, 3S]. bias_partial: where the device adds the bias gradient
// (its own layout; see the device files).
struct BackwardStep {
  int64_t B, S;
  const void* grad_out;
  const void* rec;
  const void* extra;
  const void* dG_next;
  const void* w_h;
  int64_t w_ld;
  const void* dc_in;
  const void* gates;
  const void* c_prev;
  void* d_gates;
  void* dc_out;
  void* bias_partial;
  // rec holds rec_splits partial products, rec_stride elements apart (see
  // ForwardStep).
  int64_t rec_splits = 1, rec_stride = 0;
};

// The slot of step t's cell state in a chunk's cells: t, or t & 1 where the
// slots alternate (an inference run: only the next step reads a cell state).
LLTM_HD int64_t cell_slot(int64_t t, bool alternate) { return alternate ? t & 1 : t; }

// Several steps run by the device in one go (the fused path's persistent
// kernels): step t's pointers are those of step 0 (the first step run) moved
// by t * step_gates / step_state bytes, except where a step reads the
// initial state (h0, c0) or writes the final one (h_n, c_n: forward, last
// step), and the cell states of an inference run (`inference`: step t's in
// slot cell_slot(t, true) of two; the kernels' alternate_cells).
// Backward: the steps t1 - 1 down to t0 of one chunk, as the loop in
// sequence_backward sets them up one by one.
//
// batch_sizes (both): null, every row runs every step; or a packed run's
// sizes (host memory, [T]): step t runs rows below batch_sizes[t] only. The
// caller has zeroed the outputs and cells and set h_n / c_n of rows with no
// step (forward), and set dc to grad_c_n on every row and passed it as
// grad_c_n (backward). The device then writes a row's h_n / c_n at its own
// last step, adds grad_h_n to dh there, writes zero pre-activation
// gradients past a row's end and leaves its dc as it is.
struct ForwardSteps {
  int64_t T, B, S, step_gates, step_state;
  ForwardStep first;  // step 0: h_prev = h0, c_prev = c0; h_n / c_n unused
  void* h_n;
  void* c_n;
  bool tf32;                   // Dims::tf32
  const int64_t* batch_sizes;  // see above
  bool inference = false;      // Dims::inference; two cell-state slots, see above
  // W_h ([3S, S], rows of stride w_ld) for kernels that load it once and
  // read it in place (see steps_read_weights); first.w_hT is null then.
  const void* w_h = nullptr;
  int64_t w_ld = 0;
};

struct BackwardSteps {
  int64_t T, B, S, t0, t1, K, step_gates, step_state, w_ld;
  const void* grad_outputs;  // [T, B, S] or null
  const void* grad_h_n;      // or null
  const void* grad_c_n;      // or null
  void* dG;                  // K + 1 slots of [B, 3S]
  const void* w_h;
  void* dc;           // the running cell-state gradient, in place
  const void* gates;  // [T, B, 3S]
  const void* cells;  // [T, B, S]
  const void* c0;
  void* bias_partial;
  bool tf32;                   // Dims::tf32
  const int64_t* batch_sizes;  // see ForwardSteps
};

// -- the drivers ------------------------------------------------------------------
//
// Dev provides:
//   static bool fused(const Tensor& like, const Dims&): whether the step
//       kernels compute the recurrent product themselves;
//   static void forward_step(const Tensor& like, const ForwardStep&);
//   static void backward_step(const Tensor& like, const BackwardStep&, bool fused);
//   static bool forward_steps(const Tensor& like, const ForwardSteps&),
//   static bool backward_steps(const Tensor& like, const BackwardSteps&):
//       run all the steps (fused path) in one go, or return false for the
//       one-at-a-time loop;
//   static bool step_product(const Tensor& like, const StepProduct&,
//       ProductWorkspace& workspace): add a forward step's product into
//       its gates (workspace: the call's scratch, which the device may
//       allocate or grow up to its bound), or return false for aten::mm;
//   static int64_t step_splits(const Tensor& like, int64_t M, int64_t N,
//       int64_t K, int64_t bound): in how many parts of k a
//       step's recurrent product (M x K @ K x N) runs on the cuBLAS path
//       (split_product; its cell kernels add the parts), with at most
//       `bound` bytes of partials past the one product; 1: one aten::mm;
//   static bool parts_product(const Tensor& like, const PartsProduct&,
//       ProductWorkspace& workspace): run those parts itself, or return
//       false for aten::bmm (split_product);
//   static bool product(const Tensor& like, const char* op, Tensor& out,
//       const Tensor& a, const Tensor& b, bool accumulate, bool tf32,
//       ProductWorkspace& workspace): a chunk's large product, out = a @ b
//       (out += a @ b where accumulate), or return false for aten::mm;
//   static bool steps_read_weights(const Tensor& like, const Dims&): whether
//       forward_steps runs (and never returns false) with kernels that read
//       W_h in place (ForwardSteps::w_h), so that no W_h^T copy is made;
//   static Tensor bias_partial(const Tensor& like, const Dims&, bool fused):
//       zeroed accumulator the backward steps add into;
//   static void zero(Tensor&), copy(const Tensor& like, void* dst, const void* src,
//       int64_t bytes), zero_bytes(const Tensor& like, void* dst, int64_t bytes):
//       stream-ordered memset and copy;
//   static void bias_chunk(const Tensor& like, Tensor& partial, const Tensor& d_gates_2d):
//       called once per chunk with its [rows, 3S] dG (devices whose steps do
//       not accumulate the bias gradient themselves sum it here);
//   static void bias_finish(const Tensor& partial, Tensor& d_bias);
//   static void add_into(Tensor& dst_view, const Tensor& src): dst += src, 2-D.

// Rows r0 .. r1 - 1 of a buffer of `row_bytes` rows set to those of src, or
// to zero where src is null (a packed run's final states and gradients).
template <class Dev>
void set_rows(const Tensor& like, void* dst, const void* src, int64_t r0, int64_t r1,
              int64_t row_bytes) {
  const int64_t off = r0 * row_bytes, bytes = (r1 - r0) * row_bytes;
  if (src != nullptr) {
    Dev::copy(like, static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, bytes);
  } else {
    Dev::zero_bytes(like, static_cast<char*>(dst) + off, bytes);
  }
}

// The scratch a call's device products share (cuBLASLt's workspace, where
// the algorithm wants one): allocated by the device on first need, never
// more than `bound` bytes (the device chooses its algorithms within it).
struct ProductWorkspace {
  std::optional<Tensor> tensor;
  int64_t bound = 0;
};

// A call's workspace bound: an eighth of its outputs' bytes (T x B x S
// elements). The loop of cells keeps at least five such tensors for its
// backward (the gates, the cell states, [h, x]), so the bound is at most a
// fortieth of the loop's peak. Measured (H100, forward+backward, float32
// on TF32 and 16-bit, T2-T64, 14 sizes): 0.46-0.91x the loop's peak with
// the bound, in the time 32 MiB took; 32 MiB (0.6.17) took float32 TF32
// T64 B16 S128 to 1.18x the loop's peak.
inline ProductWorkspace product_workspace(const Dims& d, int64_t element_size) {
  return {std::nullopt, d.T * d.B * d.S * element_size / 8};
}

// The partials past one product that a step's product in parts of k may
// keep (Dev::step_splits, either direction): a quarter of the outputs'
// bytes, twice the workspace bound, so still at most a twentieth of the
// loop of cells' peak. The eighth it was (0.6.42) kept full float32 T64
// B256 S512's forward and T40 B256 S512 to one product a step. Measured
// (H200, GPU time of a call, ms): T64 B256 S512 inference 1.93 against
// 1.70 with 4 parts, T40 B256 S512 forward+backward 3.34 against 3.03,
// whose peak went from 0.91 to 0.93x the loop's.
inline int64_t step_partials_bound(const Dims& d, int64_t element_size) {
  return d.T * d.B * d.S * element_size / 4;
}

// A call's large products (the input projection, the weight and input
// gradients): the device's own (Dev::product) where it takes one, else
// aten::mm; one workspace for the call's device products.
template <class Dev>
struct ChunkProducts {
  const char* op;
  const Tensor& like;
  bool tf32;
  ProductWorkspace workspace;

  void set(Tensor& out, const Tensor& a, const Tensor& b) {
    if (!Dev::product(like, op, out, a, b, false, tf32, workspace)) mm_out(op, out, a, b);
  }
  // out += a @ b where the device adds into out itself; false: not done.
  bool add(Tensor& out, const Tensor& a, const Tensor& b) {
    return Dev::product(like, op, out, a, b, true, tf32, workspace);
  }
};

// dst = the sum of the products added (a weight gradient over the chunks):
// the first written, the next added into it (through a scratch product and
// Dev::add_into where the device does not add itself).
struct GemmAccumulator {
  const char* op;
  Tensor dst;
  std::optional<Tensor> tmp;
  bool written = false;

  template <class Dev>
  void add(ChunkProducts<Dev>& products, const Tensor& a, const Tensor& b) {
    if (!written) {
      products.set(dst, a, b);
      written = true;
      return;
    }
    if (products.add(dst, a, b)) return;
    if (!tmp)
      tmp = empty_contiguous(op, "a weight-gradient partial", products.like,
                             {dst.size(0), dst.size(1)});
    mm_out(op, *tmp, a, b);
    Dev::add_into(dst, *tmp);
  }
};

struct ForwardResult {
  Tensor outputs, h_n, c_n, gates, cells;
};

// How many steps an inference run (sequence_inference: nothing kept for a
// backward) holds the input projection of at once; its cell states take
// two slots whatever the chunk (see sequence_forward). Where the
// projection and cell states of every step (4S values a row and step)
// would take more than kInferenceKeepBytes: a quarter of the steps, so that
// a long run takes less memory than a loop of cells collecting its outputs
// (outputs, then as much again; at T128, four chunks peaked at 0.89-0.93x
// its memory on an H200), but never fewer than kInferenceChunkSteps (a
// chunk costs a product, a launch and the loading of the step kernels'
// weights: at T64 B256 S512 eight chunks of 8 steps made the run 26%
// slower, and on an H200 four chunks of 16 instead of two of 32 took 2-19%
// longer at T16-T64; eight chunks of 32 instead of four of 64, float16
// B16 S1024 T256, 985 against 907 us, S768 881 against 839); below the
// bytes, all steps at once.
// LLTM_OP_SEQUENCE_INFERENCE_CHUNKS=n overrides the count (chunks of T / n
// steps). A chunk of fewer steps than T is a whole number of pairs of steps
// (rounded up), so that its last step's cell state is in the second slot.
constexpr double kInferenceKeepBytes = 16.0 * (1 << 20);
constexpr int64_t kInferenceChunkSteps = 32;
inline int64_t inference_chunk_steps(const Dims& d, int64_t esize) {
  const double all = 4.0 * static_cast<double>(d.T) * d.B * d.S * esize;
  const int64_t chunks =
      env_int("LLTM_OP_SEQUENCE_INFERENCE_CHUNKS",
              all > kInferenceKeepBytes ? std::min<int64_t>(4, d.T / kInferenceChunkSteps) : 1);
  if (chunks <= 1) return d.T;
  const int64_t steps = ((d.T + chunks - 1) / chunks + 1) & ~int64_t{1};
  return std::min(steps, d.T);
}

// inference: gates and cells are scratch, not results: the gates of a
// chunk of steps at a time (inference_chunk_steps), the cell states of two
// steps; the steps run chunk by chunk, each chunk's input projection one
// product.
template <class Dev>
ForwardResult sequence_forward(const Tensor& input_arg, const Tensor& weights_arg,
                               const Tensor& bias_arg, const Tensor& old_h_arg,
                               const Tensor& old_cell_arg, bool tf32 = false,
                               const std::optional<Tensor>& batch_sizes = std::nullopt,
                               bool inference = false) {
  const char* op = inference ? kSeqInference : kSeqForward;
  Dims d = check_forward_args(op, input_arg, weights_arg, bias_arg, old_h_arg, old_cell_arg);
  d.tf32 = tf32;
  d.inference = inference;
  const StepRows rows = check_batch_sizes(op, batch_sizes, d);
  const int64_t T = d.T, B = d.B, F = d.F, S = d.S, S3 = 3 * S, L = S + F;
  const int64_t K =
      inference ? inference_chunk_steps(d, static_cast<int64_t>(input_arg.element_size())) : T;
  // An inference run's cell states alternate between two slots: step t0 + i
  // of a chunk writes slot i & 1 (the slot it reads is the other one), and
  // the next chunk's first step reads the last one's, slot 1 (K is even).
  const int64_t cell_slots = inference ? std::min<int64_t>(K, 2) : K;
  const Tensor& like = input_arg;
  ForwardResult r{empty_contiguous(op, "the outputs", like, {T, B, S}),
                  empty_contiguous(op, "h_n", like, {B, S}),
                  empty_contiguous(op, "c_n", like, {B, S}),
                  empty_contiguous(op, "gates", like, {K, B, S3}),
                  empty_contiguous(op, "cells", like, {cell_slots, B, S})};
  if (B * S == 0) return r;
  if (T == 0) {
    torch::stable::copy_(r.h_n, old_h_arg);
    torch::stable::copy_(r.c_n, old_cell_arg);
    return r;
  }
  const Tensor input = dense(input_arg);
  const Tensor weights = dense(weights_arg);
  const Tensor bias = dense(bias_arg);
  const Tensor old_h = dense(old_h_arg);
  const Tensor old_cell = dense(old_cell_arg);

  const bool fused = Dev::fused(like, d);
  const Tensor w_hT_view = view_of(weights, {S, S3}, {1, L});
  const Tensor w_xT = view_of(weights, {F, S3}, {1, L}, S);
  // The fused step kernels read W_h^T row by row every step: a contiguous
  // copy, made once, where they run. The kernels that load W_h once read it
  // in place (a launch and an allocation less a call: host time at small
  // sizes).
  const bool in_place = fused && Dev::steps_read_weights(like, d);
  std::optional<Tensor> w_hT;
  auto w_hT_ptr = [&]() -> const void* {
    if (!w_hT) w_hT = Dev::transposed(op, weights, S3, S, L);
    return w_hT->const_data_ptr();
  };
  const int64_t esize = static_cast<int64_t>(like.element_size());
  char* gates = static_cast<char*>(r.gates.mutable_data_ptr());
  char* outs = static_cast<char*>(r.outputs.mutable_data_ptr());
  char* cells = static_cast<char*>(r.cells.mutable_data_ptr());
  const int64_t step_gates = B * S3 * esize, step_state = B * S * esize;
  if (rows.packed()) {
    // Rows past their sequence's end are zero (finite, for the weight
    // gradients' products over whole steps); rows with no step keep h0, c0.
    Dev::zero(r.outputs);
    if (!inference) Dev::zero(r.cells);
    set_rows<Dev>(like, r.h_n.mutable_data_ptr(), old_h.const_data_ptr(), rows.at(0), B, S * esize);
    set_rows<Dev>(like, r.c_n.mutable_data_ptr(), old_cell.const_data_ptr(), rows.at(0), B,
                  S * esize);
  }
  // Step by step: the one-step fused kernels run a fixed batch, so a packed
  // run takes the cuBLAS-product path, each step on its leading rows.
  const bool step_fused = fused && !rows.packed();
  std::optional<Tensor> rec;
  ChunkProducts<Dev> products{op, like, tf32,
                              product_workspace(d, static_cast<int64_t>(like.element_size()))};
  const int64_t splits =
      step_fused || rows.packed()
          ? 1
          : Dev::step_splits(like, B, S3, S,
                             step_partials_bound(d, static_cast<int64_t>(like.element_size())));
  for (int64_t t0 = 0; t0 < T && rows.at(t0) > 0; t0 += K) {
    const int64_t t1 = std::min(T, t0 + K), steps = t1 - t0;
    // Chunk slots: step t's gates and cell state at slot t - t0.
    auto slot_gates = [&](int64_t t) { return gates + (t - t0) * step_gates; };
    auto slot = [&](int64_t i) { return cells + cell_slot(i, inference) * step_state; };
    auto slot_cells = [&](int64_t t) { return slot(t - t0); };
    // The cell state before step t0: the previous chunk's last (step K - 1).
    const void* c_before = t0 ? static_cast<const void*>(slot(K - 1)) : old_cell.const_data_ptr();
    {
      // P = X W_x^T for the chunk's steps, straight into its gates slots.
      Tensor g2 = view_of(r.gates, {steps * B, S3}, {S3, 1});
      const Tensor x2 = view_of(input, {steps * B, F}, {F, 1}, t0 * B * F);
      products.set(g2, x2, w_xT);
    }
    if (fused) {
      ForwardSteps all{steps,
                       B,
                       S,
                       step_gates,
                       step_state,
                       {},
                       r.h_n.mutable_data_ptr(),
                       r.c_n.mutable_data_ptr(),
                       tf32,
                       rows.packed() ? rows.sizes.data() + t0 : nullptr};
      all.first.B = B;
      all.first.S = S;
      all.first.gates = gates;
      all.first.bias = bias.const_data_ptr();
      all.first.h_prev =
          t0 ? static_cast<const void*>(outs + (t0 - 1) * step_state) : old_h.const_data_ptr();
      all.first.c_prev = c_before;
      all.first.w_hT = in_place ? nullptr : w_hT_ptr();
      all.w_h = weights.const_data_ptr();
      all.w_ld = L;
      all.inference = inference;
      all.first.h = outs + t0 * step_state;
      all.first.c = cells;
      // A chunk's last step writes h_n / c_n of the rows still running; a
      // later chunk writes them again for the rows that go on.
      if (Dev::forward_steps(like, all)) continue;
    }
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = rows.at(t);
      if (n == 0) break;  // non-increasing: no row runs from here on
      ForwardStep s{};
      s.B = n;
      s.S = S;
      s.gates = slot_gates(t);
      s.bias = bias.const_data_ptr();
      s.h_prev = t ? static_cast<const void*>(outs + (t - 1) * step_state) : old_h.const_data_ptr();
      s.c_prev = t > t0 ? static_cast<const void*>(slot_cells(t - 1)) : c_before;
      s.h = outs + t * step_state;
      s.c = slot_cells(t);
      s.h_n = t == T - 1 && !rows.packed() ? r.h_n.mutable_data_ptr() : nullptr;
      s.c_n = t == T - 1 && !rows.packed() ? r.c_n.mutable_data_ptr() : nullptr;
      s.rec = nullptr;
      s.w_hT = nullptr;
      s.keep_gates = !inference;
      auto h_prev_view = [&] {  // [n, S], for the products through torch
        return t ? view_of(r.outputs, {n, S}, {S, 1}, (t - 1) * B * S)
                 : view_of(old_h, {n, S}, {S, 1});
      };
      if (step_fused) {
        s.w_hT = w_hT_ptr();
      } else if (!rows.packed() &&
                 Dev::step_product(like,
                                   {op, n, S, s.h_prev, weights.const_data_ptr(), L, s.gates, tf32},
                                   products.workspace)) {
        s.product_in_gates = true;  // the cell adds the bias
      } else if (splits > 1) {
        if (!rec) rec = empty_contiguous(op, "a step's recurrent product", like, {splits, B, S3});
        // h_{t-1} [n, S] @ W_h^T [S, 3S] (W_h's rows of stride L).
        const Strided h{s.h_prev, S, 1}, w_hT{weights.const_data_ptr(), 1, L};
        const PartsProduct parts{op,     splits, n, S3, S, h, w_hT, rec->mutable_data_ptr(),
                                 B * S3, tf32};
        if (!Dev::parts_product(like, parts, products.workspace)) {
          split_product(op, *rec, h_prev_view(), w_hT_view, splits);
        }
        s.rec = rec->const_data_ptr();
        s.rec_splits = splits;
        s.rec_stride = B * S3;
      } else {
        if (!rec) rec = empty_contiguous(op, "a step's recurrent product", like, {B, S3});
        Tensor rec_n = view_of(*rec, {n, S3}, {S3, 1});
        mm_out(op, rec_n, h_prev_view(), w_hT_view);
        s.rec = rec->const_data_ptr();
      }
      Dev::forward_step(like, s);
      if (rows.packed()) {
        // Rows at their last step: h and c are final.
        const int64_t done = rows.at(t + 1);
        set_rows<Dev>(like, r.h_n.mutable_data_ptr(), outs + t * step_state, done, n, S * esize);
        set_rows<Dev>(like, r.c_n.mutable_data_ptr(), slot_cells(t), done, n, S * esize);
      }
    }
  }
  return r;
}

struct BackwardResult {
  Tensor d_input, d_weights, d_bias, d_old_h, d_old_cell;
};

template <class Dev>
BackwardResult sequence_backward(const std::optional<Tensor>& grad_outputs_arg,
                                 const std::optional<Tensor>& grad_h_n_arg,
                                 const std::optional<Tensor>& grad_c_n_arg, const Tensor& input_arg,
                                 const Tensor& weights_arg, const Tensor& old_h_arg,
                                 const Tensor& old_cell_arg, const Tensor& outputs_arg,
                                 const Tensor& gates_arg, const Tensor& cells_arg, bool input_grad,
                                 bool tf32 = false,
                                 const std::optional<Tensor>& batch_sizes = std::nullopt) {
  const char* op = kSeqBackward;
  Dims d = check_backward_args(grad_outputs_arg, grad_h_n_arg, grad_c_n_arg, input_arg, weights_arg,
                               old_h_arg, old_cell_arg, outputs_arg, gates_arg, cells_arg);
  d.tf32 = tf32;
  const StepRows rows = check_batch_sizes(op, batch_sizes, d);
  const int64_t T = d.T, B = d.B, F = d.F, S = d.S, S3 = 3 * S, L = S + F;
  const Tensor& like = input_arg;
  BackwardResult r{input_grad ? empty_contiguous(op, "d_input", like, {T, B, F})
                              : empty_contiguous(op, "d_input", like, {0}),
                   empty_contiguous(op, "d_weights", like, {S3, L}),
                   empty_contiguous(op, "d_bias", like, {S3}),
                   empty_contiguous(op, "d_old_h", like, {B, S}),
                   empty_contiguous(op, "d_old_cell", like, {B, S})};
  if (T == 0 || B * S == 0) {
    // No step (or nothing in a step): the weights get no gradient, the
    // initial state gets what came for the final state.
    torch::stable::zero_(r.d_weights);
    torch::stable::zero_(r.d_bias);
    if (input_grad) torch::stable::zero_(r.d_input);
    if (grad_h_n_arg) {
      torch::stable::copy_(r.d_old_h, *grad_h_n_arg);
    } else {
      torch::stable::zero_(r.d_old_h);
    }
    if (grad_c_n_arg) {
      torch::stable::copy_(r.d_old_cell, *grad_c_n_arg);
    } else {
      torch::stable::zero_(r.d_old_cell);
    }
    return r;
  }
  const Tensor input = dense(input_arg);
  const Tensor weights = dense(weights_arg);
  const Tensor old_h = dense(old_h_arg);
  const Tensor old_cell = dense(old_cell_arg);
  const Tensor outputs = dense(outputs_arg);
  const Tensor gates = dense(gates_arg);
  const Tensor cells = dense(cells_arg);
  const bool fused = Dev::fused(like, d);  // see sequence_forward
  const bool step_fused = fused && !rows.packed();
  const int64_t chunks = backward_chunks(d);
  const int64_t K = (T + chunks - 1) / chunks;
  // grad_outputs that is not dense (the expanded gradient of a sum or a
  // mean, a batch_first module's transposed one) is made dense a chunk at a
  // time where the steps run in chunks: K + 2 steps of it, not all T (the
  // kernels read only their chunk's steps; a spare step at each end keeps
  // a read one step past it inside the buffer all the same). Measured
  // (H200, float32, a forward+backward from a sum of the three outputs,
  // peak against the loop of cells'): T64 B16 F32 S128 1.016 to 0.936, T64
  // B256 S512 1.009 to 0.961, T40 B256 S512 1.044 to 1.001.
  const bool go_by_chunk = grad_outputs_arg && chunks > 1 && !grad_outputs_arg->is_contiguous();
  std::optional<Tensor> go, ghn, gcn;
  if (go_by_chunk) {
    go = empty_contiguous(op, "a chunk of grad_outputs", like, {K + 2, B, S});
  } else if (grad_outputs_arg) {
    go = dense(*grad_outputs_arg);
  }
  if (grad_h_n_arg) ghn = dense(*grad_h_n_arg);
  if (grad_c_n_arg) gcn = dense(*grad_c_n_arg);
  // K slots for a chunk's steps and one (slot K) that carries dG of the first
  // step of the chunk after it (in time), which the chunk's last step needs.
  Tensor dG = empty_contiguous(op, "the pre-activation gradients of a chunk", like, {K + 1, B, S3});
  Tensor& dc = r.d_old_cell;  // running gradient of the cell state
  ChunkProducts<Dev> products{op, like, tf32,
                              product_workspace(d, static_cast<int64_t>(like.element_size()))};
  // The steps' products dG_{t+1} W_h in parts of k (Dev::parts_product, else
  // split_product), or one.
  const int64_t splits =
      step_fused || rows.packed()
          ? 1
          : Dev::step_splits(like, B, S, S3,
                             step_partials_bound(d, static_cast<int64_t>(like.element_size())));
  std::optional<Tensor> dh;
  if (!step_fused) {
    dh = splits > 1 ? empty_contiguous(op, "a step's recurrent gradient", like, {splits, B, S})
                    : empty_contiguous(op, "a step's recurrent gradient", like, {B, S});
  }
  Tensor partial = Dev::bias_partial(like, d, fused);
  const Tensor w_h = view_of(weights, {S3, S}, {L, 1});
  const Tensor w_x = view_of(weights, {S3, F}, {L, 1}, S);

  GemmAccumulator acc_h{op, view_of(r.d_weights, {S3, S}, {L, 1})};
  GemmAccumulator acc_x{op, view_of(r.d_weights, {S3, F}, {L, 1}, S)};

  const int64_t esize = static_cast<int64_t>(like.element_size());
  const int64_t step_gates = B * S3 * esize, step_state = B * S * esize;
  if (rows.packed()) {
    // The running cell-state gradient starts as grad_c_n on every row: a row
    // is first reached at its own last step, untouched before.
    set_rows<Dev>(like, dc.mutable_data_ptr(), gcn ? gcn->const_data_ptr() : nullptr, 0, B,
                  S * esize);
  }
  char* dG_ptr = static_cast<char*>(dG.mutable_data_ptr());
  const char* gates_ptr = static_cast<const char*>(gates.const_data_ptr());
  const char* cells_ptr = static_cast<const char*>(cells.const_data_ptr());
  const char* go_ptr = go ? static_cast<const char*>(go->const_data_ptr()) : nullptr;
  auto slot = [&](int64_t k) { return dG_ptr + k * step_gates; };
  auto slot_view = [&](int64_t k, int64_t steps) {
    return view_of(dG, {steps * B, S3}, {S3, 1}, k * B * S3);
  };

  // One step of a packed run, on its first n = batch_sizes[t] rows: dh =
  // grad_outputs[t] + dG_{t+1} W_h on the rows that go on to step t + 1,
  // + grad_h_n on the rows whose last step this is; the cell's backward
  // then reads dc (still grad_c_n on those rows). The slot's rows past n
  // get a zero pre-activation gradient (the weight gradients are products
  // over all B rows of the slots).
  auto packed_backward_step = [&](int64_t t, int64_t t0, int64_t t1) {
    const int64_t n = rows.at(t), next = rows.at(t + 1);
    set_rows<Dev>(like, slot(t - t0), nullptr, n, B, S3 * esize);
    if (n == 0) return;
    const int64_t next_slot = t + 1 < t1 ? t + 1 - t0 : K;
    if (next > 0) {
      Tensor dh_next = view_of(*dh, {next, S}, {S, 1});
      mm_out(op, dh_next, view_of(dG, {next, S3}, {S3, 1}, next_slot * B * S3), w_h);
    }
    set_rows<Dev>(like, dh->mutable_data_ptr(), ghn ? ghn->const_data_ptr() : nullptr, next, n,
                  S * esize);
    BackwardStep s{};
    s.B = n;
    s.S = S;
    s.grad_out = go_ptr ? go_ptr + t * step_state : nullptr;
    s.rec = dh->const_data_ptr();
    s.extra = nullptr;
    s.dG_next = nullptr;
    s.w_h = nullptr;
    s.dc_in = dc.const_data_ptr();
    s.gates = gates_ptr + t * step_gates;
    s.c_prev =
        t ? static_cast<const void*>(cells_ptr + (t - 1) * step_state) : old_cell.const_data_ptr();
    s.d_gates = slot(t - t0);
    s.dc_out = dc.mutable_data_ptr();
    s.bias_partial = partial.mutable_data_ptr();
    Dev::backward_step(like, s, false);
  };

  for (int64_t c = (T - 1) / K; c >= 0; --c) {
    const int64_t t0 = c * K, t1 = std::min(T, t0 + K), n = t1 - t0;
    if (t1 < T) {
      // dG_{t1}, in slot 0 from the chunk before, moves to the carry slot.
      Dev::copy(like, slot(K), slot(0), step_gates);
    }
    if (go_by_chunk) {
      // Steps t0..t1-1 into slots 1..n; go_ptr + t * step_state is then
      // step t's slot (an address computed as an integer: for t0 > 1 the
      // base lies before the buffer, and only slots inside it are read).
      Tensor steps = view_of(*go, {n, B, S}, {B * S, S, 1}, B * S);
      Tensor from = *grad_outputs_arg;
      torch::stable::copy_(steps, torch::stable::narrow(from, 0, t0, n));
      go_ptr = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(go->const_data_ptr()) +
                                             static_cast<uintptr_t>((1 - t0) * step_state));
    }
    BackwardSteps all{T, B, S, t0, t1, K, step_gates, step_state, L, go_ptr,
                      ghn ? ghn->const_data_ptr() : nullptr,
                      // packed: dc holds grad_c_n on every row (above)
                      rows.packed() ? dc.const_data_ptr() : (gcn ? gcn->const_data_ptr() : nullptr),
                      dG_ptr, weights.const_data_ptr(), dc.mutable_data_ptr(), gates_ptr, cells_ptr,
                      old_cell.const_data_ptr(), partial.mutable_data_ptr(), tf32,
                      rows.packed() ? rows.sizes.data() : nullptr};
    const bool ran = fused && Dev::backward_steps(like, all);
    for (int64_t t = t1 - 1; t >= t0 && !ran; --t) {
      if (rows.packed()) {
        packed_backward_step(t, t0, t1);
        continue;
      }
      BackwardStep s{};
      s.B = B;
      s.S = S;
      s.grad_out = go_ptr ? go_ptr + t * step_state : nullptr;
      const bool last = t == T - 1;
      const int64_t next_slot = t + 1 < t1 ? t + 1 - t0 : K;
      s.extra = last && ghn ? ghn->const_data_ptr() : nullptr;
      s.dG_next = nullptr;
      s.rec = nullptr;
      s.w_h = nullptr;
      if (!last) {
        if (step_fused) {
          s.dG_next = slot(next_slot);
          s.w_h = weights.const_data_ptr();
          s.w_ld = L;
        } else if (splits > 1) {
          // dG_{t+1} [B, 3S] @ W_h [3S, S].
          const Strided dG_next{slot(next_slot), S3, 1}, w{weights.const_data_ptr(), L, 1};
          const PartsProduct parts{op,    splits, B, S, S3, dG_next, w, dh->mutable_data_ptr(),
                                   B * S, tf32};
          if (!Dev::parts_product(like, parts, products.workspace)) {
            split_product(op, *dh, slot_view(next_slot, 1), w_h, splits);
          }
          s.rec = dh->const_data_ptr();
          s.rec_splits = splits;
          s.rec_stride = B * S;
        } else {
          mm_out(op, *dh, slot_view(next_slot, 1), w_h);
          s.rec = dh->const_data_ptr();
        }
      }
      s.dc_in = last ? (gcn ? gcn->const_data_ptr() : nullptr) : dc.const_data_ptr();
      s.gates = gates_ptr + t * step_gates;
      s.c_prev = t ? static_cast<const void*>(cells_ptr + (t - 1) * step_state)
                   : old_cell.const_data_ptr();
      s.d_gates = slot(t - t0);
      s.dc_out = dc.mutable_data_ptr();
      s.bias_partial = partial.mutable_data_ptr();
      Dev::backward_step(like, s, step_fused);
    }
    // The chunk's weight and input gradients: products over all its steps.
    const Tensor dG2 = slot_view(0, n);
    const Tensor dG2T = view_of(dG, {S3, n * B}, {1, S3});
    Dev::bias_chunk(like, partial, dG2);
    if (F > 0) {
      acc_x.add(products, dG2T, view_of(input, {n * B, F}, {F, 1}, t0 * B * F));
      if (input_grad) {
        Tensor dx = view_of(r.d_input, {n * B, F}, {F, 1}, t0 * B * F);
        products.set(dx, dG2, w_x);
      }
    }
    if (t0 > 0) {
      acc_h.add(products, dG2T, view_of(outputs, {n * B, S}, {S, 1}, (t0 - 1) * B * S));
    } else {
      if (n > 1) {
        acc_h.add(products, view_of(dG, {S3, (n - 1) * B}, {1, S3}, B * S3),
                  view_of(outputs, {(n - 1) * B, S}, {S, 1}));
      }
      acc_h.add(products, view_of(dG, {S3, B}, {1, S3}), old_h);
    }
  }
  // d_old_h = dG_0 W_h; dG_0 is in slot 0.
  products.set(r.d_old_h, slot_view(0, 1), w_h);
  if (rows.packed()) {
    // Rows with no step (length 0): their final state is the initial one.
    set_rows<Dev>(like, r.d_old_h.mutable_data_ptr(), ghn ? ghn->const_data_ptr() : nullptr,
                  rows.at(0), B, S * esize);
  }
  Dev::bias_finish(partial, r.d_bias);
  return r;
}

}  // namespace seq
}  // namespace lltm_op
