// lltm_op: CUDA kernels of the LLTM over whole sequences (the drivers, time
// loop and matrix products included, are in lltm_sequence.h).
//
// Two ways to run a step:
//
// * cuBLAS path (large batch or state): the recurrent product is one cuBLAS
//   matrix product per step (through torch's dispatcher), then one
//   elementwise kernel: per step, forward
//     rec = h_{t-1} W_h^T;  G_t = P_t + rec + b;  h_t, c_t = cell(G_t, c_{t-1})
//   and backward
//     rec = dG_{t+1} W_h;  dG_t, dc_{t-1} = cell_backward(grad_out[t] + rec, dc_t, ...)
//   Threads take consecutive state columns of a row (coalesced); the backward
//   kernel also sums dG over its rows into per-block-row partial sums of the
//   bias gradient (each (block row, column) is owned by one block, added in
//   step order: deterministic), finished once at the end.
//
// * fused path (small batch and state, where a step is a few microseconds of
//   launch-bound work): one kernel per step computes the recurrent product
//   itself (each block: 32 state columns x 4 batch rows, the product's
//   k-dimension split over its 8 warps, reduced in shared memory) and then
//   the cell: one launch per step each way instead of a cuBLAS call plus a
//   kernel. The forward reads W_h^T as a contiguous [S, 3S] copy (made once
//   per call) so that a warp's 32 columns are one coalesced load; the
//   backward reads W_h rows in place.
//
//   Where the grid fits in one wave of the GPU, the fused path's steps run in
//   persistent kernels instead: one launch for the whole forward and one per
//   backward chunk, the blocks of a batch row block meeting at a barrier
//   between steps (see "persistent fused path" below). float32 with S a
//   multiple of 4 runs the resident-weight kernels there instead, which
//   keep each block's slice of W_h in shared memory for every step
//   (lltm_sequence_resident.cuh; resident_plan).
//
// * tensor-core path (float16 / bfloat16 on sm_80+, and float32 on TF32
//   tensor cores when the call allows TF32, S a multiple of 8, all blocks
//   resident): persistent kernels with each block's slice of W_h in shared
//   memory for all steps and the product on mma.sync
//   (lltm_sequence_tc.cuh); taken first wherever it applies (tc_plan).
//   Other state sizes run it padded to a multiple of 8 where the call is
//   small (padded_state).
//
// LLTM_OP_SEQUENCE_FUSED=0/1 forces a path (tests, benchmarks); unset, the
// fused path runs when B * 3S * S <= 2^26 multiply-adds per step.
// LLTM_OP_SEQUENCE_PERSISTENT=0 launches the fused kernel step by step;
// LLTM_OP_SEQUENCE_TENSOR_CORES=0 turns the tensor-core path off.
#include <cuda_fp16.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lltm.h"
#include "lltm_dependent_launch.cuh"
#include "lltm_sequence.h"
#include "lltm_sequence_cublaslt.h"
#include "opscommon/checks.h"
#include "opscommon/cuda.h"
#include "opscommon/dispatch.h"
#include "opscommon/vectorized.h"

namespace lltm_op {
namespace seq {
namespace {

template <typename T>
using Acc = opscommon::acc_t<T>;

template <typename T>
__device__ __forceinline__ Acc<T> to_acc(T v) {
  return static_cast<Acc<T>>(v);
}
template <>
__device__ __forceinline__ float to_acc<opscommon::Half>(opscommon::Half v) {
  return __half2float(__ushort_as_half(v.x));
}
template <typename T>
__device__ __forceinline__ T to_storage(Acc<T> v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ opscommon::Half to_storage<opscommon::Half>(float v) {
  return opscommon::Half(__half_as_ushort(__float2half_rn(v)), opscommon::Half::from_bits());
}

template <typename T>
using MathFor = std::conditional_t<sizeof(T) == 2, FastMath, AccurateMath>;

constexpr unsigned int kThreads = 256;
// Fused kernels: 8 warps split the product's k-dimension (short dependent
// load chains: a step is latency-bound); 4 batch rows per block, the first 4
// warps finishing one (row, column) of the cell each.
constexpr int kWarps = 8;
constexpr int kRows = 4;
static_assert(kRows <= kWarps, "one epilogue warp per row");
// cuBLAS-path backward kernel: blocks of 32 columns x 8 rows.
constexpr int kBwdRows = 8;
// Fused path by default up to this many multiply-adds per step (B * 3S * S).
// Measured (H100, float32, T256): fused beats a cuBLAS product a step up
// to B64 S512 / B256 S256 / B8 S1024 (5.9 vs 18.4 ms at B64 S256), loses at
// B64 S1024 (29.7 vs 22.4 ms, 2^27.6 multiply-adds).
constexpr int64_t kFusedMaxMacs = int64_t(1) << 26;
// float32's resident-weight kernels past kFusedMaxMacs up to B S^2 of this
// (a third of a step's multiply-adds) where the batch is narrow
// (resident_size).
constexpr int64_t kResidentMaxBSS = int64_t(1) << 25;
// The partial products a step's product in parts of k may take
// (CudaDev::step_splits).
constexpr int64_t kStepSplitBytes = int64_t(8) << 20;
// Shared memory the persistent kernels may stage a step's state in (a block's
// static shared memory for the reductions comes on top; 48 KB needs no opt-in).
constexpr size_t kMaxStageBytes = 32 * 1024;
// The most workspace a cuBLASLt product's algorithm is chosen with (a
// split-K algorithm's partial sums; allocated once a call, what the chosen
// algorithm needs, and used only within the call's bound: see
// ProductWorkspace). Measured (H100, T256, float32 on TF32, B256 S1024):
// with none the heuristic chose a slower algorithm (forward 31.1 against
// 23.7 us a step); 4 MiB and 32 (torch's cuBLAS workspace on sm_90) gave
// the same; 16-bit products ran as fast with none.
constexpr size_t kCublasLtWorkspaceBytes = size_t(32) << 20;
// The largest chunk product (multiply-adds) that CudaDev::product sends to
// cuBLASLt: about 11 us of tensor-core time on an H100 at 400 TFLOP/s, so
// that the 5-10 us of host time saved is what matters, not a kernel choice.
constexpr int64_t kLtProductMaxMacs = int64_t(1) << 31;
// Full float32 chunk products with a long inner dimension (K past twice
// the larger of M and N: the weight gradients, K = steps x B) go to
// cuBLASLt only up to this many multiply-adds, where they take a few
// microseconds whatever the kernel. Past it the heuristic's first
// algorithm was a SIMT kernel without split-K, 2.6-3.7x the GPU time of
// aten::mm's split-K kernels (H100, T64-T1024, B8-B256, S128: 227 against
// 103 us for a T256 B64 backward's four) and slower calls, where the
// products that were not long-K matched aten::mm's. On TF32 they stay in
// cuBLASLt: its kernel there is a 64 x 64 one without split-K too (H200,
// T256 B64 S128: the four 104 us against aten::mm's 53), but with them in
// aten::mm the calls were not faster, and at T64 B256 S128 slower (0.81-0.84
// against 1.15-1.33 ms forward+backward, its host time;
// bench/results-h200/lltm_sequence_exchange_and_products_0.6.29.md).
constexpr int64_t kLtFullF32LongKMaxMacs = int64_t(1) << 25;

// A value another block of this launch wrote: from L2, past this SM's L1.
template <typename T>
__device__ __forceinline__ T load_state_cg(const T* p) {
  if constexpr (sizeof(T) == 2) {
    const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
    T v;
    memcpy(&v, &bits, sizeof(T));
    return v;
  } else {
    return __ldcg(p);
  }
}

// Rows r0 .. r0 + kRows - 1 (clamped to the batch) of a [B, width] state
// that other blocks of this launch wrote, copied into this block's shared
// memory (`stage`, kRows x width) through L2: the product then reads them
// from shared memory. Every thread of the block takes part.
template <typename T>
__device__ __forceinline__ const T* stage_rows(T* stage, const T* src, int64_t B, int64_t r0,
                                               int64_t width) {
  for (int64_t e = threadIdx.x; e < kRows * width; e += blockDim.x) {
    const int64_t r = e / width;
    stage[e] = load_state_cg(src + std::min<int64_t>(r0 + r, B - 1) * width + (e - r * width));
  }
  __syncthreads();
  return stage;
}

// The persistent kernels' dynamic shared memory.
template <typename T>
__device__ __forceinline__ T* stage_memory() {
  extern __shared__ __align__(16) unsigned char stage_bytes[];
  return reinterpret_cast<T*>(stage_bytes);
}

// -- cuBLAS path -------------------------------------------------------------------

// The cell kernels are launched as programmatic dependents of the step
// product ahead of them (launch_after_prior, lltm_dependent_launch.cuh):
// each waits before its first read until that product has completed, then
// lets the next kernel (the next step's product) launch, which waits the
// same way before it reads: what it overlaps is its launch, not its work.

// kKeepGates false (an inference step, ForwardStep::keep_gates): the
// pre-activations are not stored back (3 B x S elements a step fewer
// written; nothing reads them after the cell).
template <typename T, bool kKeepGates>
__global__ void __launch_bounds__(kThreads)
    forward_cell_kernel(int64_t B, int64_t S, T* __restrict__ gates, const T* __restrict__ rec,
                        int64_t rec_splits, int64_t rec_stride, const T* __restrict__ bias,
                        const T* __restrict__ c_prev, T* __restrict__ h, T* __restrict__ c,
                        T* __restrict__ h_n, T* __restrict__ c_n) {
  using A = Acc<T>;
  const int64_t n = B * S;
  wait_for_grid_dependencies();
  grid_dependents_may_launch();
  OPSCOMMON_KERNEL_LOOP(i, n) {
    const int64_t r = i / S;
    const int64_t j = i - r * S;
    T* g = gates + r * 3 * S;
    A pre[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int64_t col = k * S + j;
      // rec null: the product was added into the gates already; else
      // rec_splits partial products (split_product), added in order.
      A product = A(0);
      if (rec != nullptr) {
        for (int64_t z = 0; z < rec_splits; ++z) {
          product += to_acc(rec[z * rec_stride + r * 3 * S + col]);
        }
      }
      const T v = to_storage<T>(to_acc(g[col]) + product + to_acc(bias[col]));
      if constexpr (kKeepGates) g[col] = v;
      pre[k] = to_acc(v);
    }
    A nh, nc;
    cell_forward_math<A, MathFor<T>>(pre[0], pre[1], pre[2], to_acc(c_prev[i]), nh, nc);
    const T hv = to_storage<T>(nh), cv = to_storage<T>(nc);
    h[i] = hv;
    c[i] = cv;
    if (h_n != nullptr) {
      h_n[i] = hv;
      c_n[i] = cv;
    }
  }
}

// forward_cell_kernel for a float32 step whose product comes in parts of k
// (CudaDev::step_splits), in 16-byte accesses (forward_cell_vectorizes): a
// thread runs 4 consecutive cells of a row, the grid's y strides over the
// rows (no division a cell), and the loads of all parts (up to
// kLoadedParts) are in flight before the first sum. The same sums in the
// same order: the same bits. Full float32 B256 S512 inference, four parts a
// step (H200, T256): 7.72-7.82 ms through forward_cell_kernel, 7.31-7.48
// through this one, 6.55 with the cells left out (a timing build).
constexpr int kCellVecThreads = 128;
// Parts (up to 8 by the rule) whose loads a thread issues together.
constexpr int kLoadedParts = 8;
template <bool kKeepGates>
__global__ void __launch_bounds__(kCellVecThreads)
    forward_cell_vec_kernel(int64_t B, int64_t S, float* __restrict__ gates,
                            const float* __restrict__ parts, int64_t splits, int64_t stride,
                            const float* __restrict__ bias, const float* __restrict__ c_prev,
                            float* __restrict__ h, float* __restrict__ c, float* __restrict__ h_n,
                            float* __restrict__ c_n) {
  using Vec = opscommon::AlignedVector<float, 4>;
  auto load = [](const float* p) { return opscommon::load_vector<4>(p, 0); };
  auto store = [](float* p, const Vec& v) { opscommon::store_vector<4>(p, 0, v); };
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kCellVecThreads + threadIdx.x) * 4;
  wait_for_grid_dependencies();
  grid_dependents_may_launch();
  if (j >= S) return;
  for (int64_t r = blockIdx.y; r < B; r += gridDim.y) {
    float* g = gates + r * 3 * S;
    const float* row_parts = parts + r * 3 * S + j;
    Vec gv[3], bv[3], product[3] = {};
    Vec pv[kLoadedParts][3];
#pragma unroll
    for (int z = 0; z < kLoadedParts; ++z) {
      if (z < splits) {
#pragma unroll
        for (int k = 0; k < 3; ++k) pv[z][k] = load(row_parts + z * stride + k * S);
      }
    }
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      gv[k] = load(g + k * S + j);
      bv[k] = load(bias + k * S + j);
    }
    const Vec cv = load(c_prev + r * S + j);
    auto add_part = [&](const Vec(&part)[3]) {
#pragma unroll
      for (int k = 0; k < 3; ++k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) product[k].val[e] += part[k].val[e];
      }
    };
#pragma unroll
    for (int z = 0; z < kLoadedParts; ++z) {
      if (z < splits) add_part(pv[z]);
    }
    for (int64_t z = kLoadedParts; z < splits; ++z) {
      Vec more[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) more[k] = load(row_parts + z * stride + k * S);
      add_part(more);
    }
    Vec hv, cv_out;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float pre[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        pre[k] = gv[k].val[e] + product[k].val[e] + bv[k].val[e];
        gv[k].val[e] = pre[k];
      }
      cell_forward_math<float, MathFor<float>>(pre[0], pre[1], pre[2], cv.val[e], hv.val[e],
                                               cv_out.val[e]);
    }
    if constexpr (kKeepGates) {
#pragma unroll
      for (int k = 0; k < 3; ++k) store(g + k * S + j, gv[k]);
    }
    const int64_t i = r * S + j;
    store(h + i, hv);
    store(c + i, cv_out);
    if (h_n != nullptr) {
      store(h_n + i, hv);
      store(c_n + i, cv_out);
    }
  }
}

// Block (32, kBwdRows): threadIdx.x a column, threadIdx.y and blockIdx.y
// stride over rows, kCellRows rows a thread a pass: every load of the pass
// is issued before its first store (dc_out may be dc_in, so the compiler
// could not move a later row's loads above an earlier row's stores), so a
// thread waits on memory once a pass, not once a row. partial: [gridDim.y,
// 3S], this block row's bias sums.
constexpr int kCellRows = 2;
template <typename T>
__global__ void __launch_bounds__(32 * kBwdRows)
    backward_cell_kernel(int64_t B, int64_t S, const T* __restrict__ go,
                         const T* __restrict__ other, int64_t other_splits, int64_t other_stride,
                         const T* dc_in, const T* __restrict__ gates, const T* __restrict__ c_prev,
                         T* __restrict__ dg, T* dc_out, Acc<T>* __restrict__ partial) {
  using A = Acc<T>;
  __shared__ A red[kBwdRows][3][32];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  A sum[3] = {A(0), A(0), A(0)};
  wait_for_grid_dependencies();
  grid_dependents_may_launch();
  if (j < S) {
    const int64_t stride = static_cast<int64_t>(gridDim.y) * kBwdRows * kCellRows;
    for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBwdRows * kCellRows + threadIdx.y; r0 < B;
         r0 += stride) {
      A grad_h[kCellRows], grad_c[kCellRows], g[kCellRows][3], cell[kCellRows];
#pragma unroll
      for (int q = 0; q < kCellRows; ++q) {
        const int64_t r = r0 + q * kBwdRows;
        const bool in = r < B;
        const int64_t i = r * S + j;
        grad_h[q] = A(0);
        if (in && go != nullptr) grad_h[q] += to_acc(go[i]);
        if (in && other != nullptr) {
          // other_splits partial products of dG W_h (split_product), or one
          // term; added in order.
          A o = A(0);
          for (int64_t z = 0; z < other_splits; ++z) o += to_acc(other[z * other_stride + i]);
          grad_h[q] += o;
        }
        grad_c[q] = in && dc_in != nullptr ? to_acc(dc_in[i]) : A(0);
#pragma unroll
        for (int k = 0; k < 3; ++k) g[q][k] = in ? to_acc(gates[r * 3 * S + k * S + j]) : A(0);
        cell[q] = in ? to_acc(c_prev[i]) : A(0);
      }
#pragma unroll
      for (int q = 0; q < kCellRows; ++q) {
        const int64_t r = r0 + q * kBwdRows;
        if (r >= B) break;
        const int64_t i = r * S + j;
        A d_i, d_o, d_z, d_c;
        cell_backward_math<A, MathFor<T>>(grad_h[q], grad_c[q], g[q][0], g[q][1], g[q][2], cell[q],
                                          d_i, d_o, d_z, d_c);
        T* d = dg + r * 3 * S;
        d[j] = to_storage<T>(d_i);
        d[S + j] = to_storage<T>(d_o);
        d[2 * S + j] = to_storage<T>(d_z);
        dc_out[i] = to_storage<T>(d_c);
        sum[0] += d_i;
        sum[1] += d_o;
        sum[2] += d_z;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) red[threadIdx.y][k][threadIdx.x] = sum[k];
  __syncthreads();
  if (threadIdx.y == 0 && j < S) {
    A* row = partial + static_cast<int64_t>(blockIdx.y) * 3 * S;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      A s = A(0);
      for (int y = 0; y < kBwdRows; ++y) s += red[y][k][threadIdx.x];
      row[k * S + j] += s;
    }
  }
}

// -- fused path -------------------------------------------------------------------------

// Block: kWarps warps; grid (ceil(S / 32), ceil(B / kRows)). Lane = column
// j of the block's 32, warp = a quarter of the k range for the product and,
// after the reduction, the row of the cell this thread finishes.
// kStaged: h_prev is this block's kRows rows of the previous h, staged in
// shared memory (the persistent kernel; see stage_rows). Rows below n run
// (a packed run's batch size; B otherwise); of those, rows from n_next on
// (the next step's size) also write h_n / c_n, where these are given.
template <typename T, bool kStaged>
__device__ __forceinline__ void forward_fused_step(int64_t B, int64_t S, T* __restrict__ gates,
                                                   const T* __restrict__ bias,
                                                   const T* __restrict__ h_prev,
                                                   const T* __restrict__ w_hT,
                                                   const T* __restrict__ c_prev, T* __restrict__ h,
                                                   T* __restrict__ c, T* __restrict__ h_n,
                                                   T* __restrict__ c_n, int64_t n, int64_t n_next) {
  using A = Acc<T>;
  __shared__ A red[kWarps][3][kRows][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  A acc[3][kRows];
#pragma unroll
  for (int g = 0; g < 3; ++g) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[g][r] = A(0);
  }
  if (j < S) {
    const T* hr[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      hr[r] = kStaged ? h_prev + r * S : h_prev + std::min<int64_t>(r0 + r, B - 1) * S;
    }
    const int64_t per = (S + kWarps - 1) / kWarps;
    const int64_t k0 = warp * per;
    const int64_t k1 = std::min<int64_t>(S, k0 + per);
#pragma unroll 8
    for (int64_t k = k0; k < k1; ++k) {
      const T* wr = w_hT + k * 3 * S;
      const A w0 = to_acc(wr[j]);
      const A w1 = to_acc(wr[S + j]);
      const A w2 = to_acc(wr[2 * S + j]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const A hv = to_acc(hr[r][k]);
        acc[0][r] += w0 * hv;
        acc[1][r] += w1 * hv;
        acc[2][r] += w2 * hv;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < 3; ++g) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) red[warp][g][r][lane] = acc[g][r];
  }
  __syncthreads();
  const int64_t row = r0 + warp;
  if (warp < kRows && j < S && row < n) {
    T* gr = gates + row * 3 * S;
    A pre[3];
#pragma unroll
    for (int g = 0; g < 3; ++g) {
      A s = A(0);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w][g][warp][lane];
      const int64_t col = g * S + j;
      const T v = to_storage<T>(to_acc(gr[col]) + s + to_acc(bias[col]));
      gr[col] = v;
      pre[g] = to_acc(v);
    }
    const int64_t i = row * S + j;
    A nh, nc;
    cell_forward_math<A, MathFor<T>>(pre[0], pre[1], pre[2], to_acc(c_prev[i]), nh, nc);
    const T hv = to_storage<T>(nh), cv = to_storage<T>(nc);
    h[i] = hv;
    c[i] = cv;
    if (h_n != nullptr && row >= n_next) {
      h_n[i] = hv;
      c_n[i] = cv;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarps)
    forward_fused_kernel(int64_t B, int64_t S, T* __restrict__ gates, const T* __restrict__ bias,
                         const T* __restrict__ h_prev, const T* __restrict__ w_hT,
                         const T* __restrict__ c_prev, T* __restrict__ h, T* __restrict__ c,
                         T* __restrict__ h_n, T* __restrict__ c_n) {
  forward_fused_step<T, false>(B, S, gates, bias, h_prev, w_hT, c_prev, h, c, h_n, c_n, B, 0);
}

// dh = grad_out + extra + dG_next W_h (W_h: rows of stride ld), then the
// cell's backward; partial: [gridDim.y, 3S], this block's bias sums.
// kStaged: dG_next is this block's kRows rows, staged in shared memory.
// Rows below n run (a packed run's batch size; B otherwise), extra added on
// those from n_next on (the next step's size); the other rows get a zero dg
// and keep their dc (dc_in is dc_out then). n, n_next: ints (B is at most
// kRows * 65535 on this path), one register each less across the product.
template <typename T, bool kStaged>
__device__ __forceinline__ void backward_fused_step(
    int64_t B, int64_t S, const T* __restrict__ go, const T* __restrict__ extra,
    const T* __restrict__ dG_next, const T* __restrict__ w_h, int64_t ld, const T* dc_in,
    const T* __restrict__ gates, const T* __restrict__ c_prev, T* __restrict__ dg, T* dc_out,
    Acc<T>* __restrict__ partial, int n, int n_next) {
  using A = Acc<T>;
  __shared__ A red[kWarps][kRows][32];
  __shared__ A bsum[kRows][3][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int64_t S3 = 3 * S;
  A acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = A(0);
  if (dG_next != nullptr && j < S) {
    const T* dr[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      dr[r] = kStaged ? dG_next + r * S3 : dG_next + std::min<int64_t>(r0 + r, B - 1) * S3;
    }
    const int64_t per = (S3 + kWarps - 1) / kWarps;
    const int64_t k0 = warp * per;
    const int64_t k1 = std::min<int64_t>(S3, k0 + per);
#pragma unroll 8
    for (int64_t k = k0; k < k1; ++k) {
      const A w = to_acc(w_h[k * ld + j]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] += w * to_acc(dr[r][k]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) red[warp][r][lane] = acc[r];
  __syncthreads();
  const int64_t row = r0 + warp;
  A d3[3] = {A(0), A(0), A(0)};
  if (warp < kRows && j < S && row < B && row >= n) {
    T* d = dg + row * S3;
    d[j] = d[S + j] = d[2 * S + j] = to_storage<T>(A(0));
  }
  if (warp < kRows && j < S && row < n) {
    const int64_t i = row * S + j;
    A grad_h = A(0);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) grad_h += red[w][warp][lane];
    if (go != nullptr) grad_h += to_acc(go[i]);
    if (extra != nullptr && row >= n_next) grad_h += to_acc(extra[i]);
    const A grad_c = dc_in != nullptr ? to_acc(dc_in[i]) : A(0);
    const T* g = gates + row * S3;
    A d_c;
    cell_backward_math<A, MathFor<T>>(grad_h, grad_c, to_acc(g[j]), to_acc(g[S + j]),
                                      to_acc(g[2 * S + j]), to_acc(c_prev[i]), d3[0], d3[1], d3[2],
                                      d_c);
    T* d = dg + row * S3;
    d[j] = to_storage<T>(d3[0]);
    d[S + j] = to_storage<T>(d3[1]);
    d[2 * S + j] = to_storage<T>(d3[2]);
    dc_out[i] = to_storage<T>(d_c);
  }
  if (warp < kRows) {
#pragma unroll
    for (int g = 0; g < 3; ++g) bsum[warp][g][lane] = d3[g];
  }
  __syncthreads();
  if (warp == 0 && j < S) {
    A* prow = partial + static_cast<int64_t>(blockIdx.y) * S3;
#pragma unroll
    for (int g = 0; g < 3; ++g) {
      A s = A(0);
#pragma unroll
      for (int r = 0; r < kRows; ++r) s += bsum[r][g][lane];
      prow[g * S + j] += s;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarps)
    backward_fused_kernel(int64_t B, int64_t S, const T* __restrict__ go,
                          const T* __restrict__ extra, const T* __restrict__ dG_next,
                          const T* __restrict__ w_h, int64_t ld, const T* dc_in,
                          const T* __restrict__ gates, const T* __restrict__ c_prev,
                          T* __restrict__ dg, T* dc_out, Acc<T>* __restrict__ partial) {
  backward_fused_step<T, false>(B, S, go, extra, dG_next, w_h, ld, dc_in, gates, c_prev, dg, dc_out,
                                partial, B, 0);
}

// -- persistent fused path ------------------------------------------------------------------
//
// One launch runs every step (the forward) or every step of a backward chunk:
// on a host that needs about 6 us per kernel launch, the 64 + 64 launches of
// a T = 64 sequence at batch 16, state 128 cost more than the GPU's work. A
// step of block row y (batch rows 4y..4y+3) needs the previous step's h (or
// dG) of those rows only, all columns: written by the gridDim.x blocks of row
// y. So the blocks of a row meet at a barrier between steps (an arrival
// counter per row; a thread's writes are fenced before its block arrives),
// then copy that state's kRows rows from L2 into shared memory, where the
// product reads it. The barrier needs every block of the grid
// resident at once: the launch is only made when the grid fits in one wave
// of the GPU (occupancy times multiprocessors), else the steps are launched
// one by one. Each thread keeps its (row, column) of the cell state, as in
// the one-step kernels: results are identical.

// The barrier of a block's row between steps, in two halves, so that a
// block can arrive as soon as it wrote what the others wait for and do the
// rest of its step (stores nobody waits for, the next step's loads) before
// it waits. row_arrive: the block's threads meet (bar.sync orders their
// writes before the arrival), then one thread arrives with a release add
// (the block's writes visible device-wide first). row_wait: that thread
// spins on acquire loads until all gridDim.x blocks of the row arrived
// `target` times (what they wrote before arriving visible after), then the
// block meets again. Release and acquire at GPU scope instead of two full
// fences: a step of the persistent kernels is a few microseconds, and the
// fences were a large part of it. The arriving thread is the last warp's
// first: the first warps own the cells and fetch the next step's inputs
// around the arrival, and the release (which waits until the block's writes
// are visible) stays out of their instruction streams.
__device__ __forceinline__ bool row_signaller() { return threadIdx.x == blockDim.x - 32; }
__device__ __forceinline__ void row_arrive(unsigned long long* arrivals) {
  __syncthreads();
  if (row_signaller()) {
    unsigned long long* counter = arrivals + blockIdx.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(counter), "l"(1ull) : "memory");
#else
    __threadfence();
    atomicAdd(counter, 1ull);
#endif
  }
}
__device__ __forceinline__ void row_wait(unsigned long long* arrivals, unsigned long long target) {
  if (row_signaller()) {
    unsigned long long* counter = arrivals + blockIdx.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    unsigned long long seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
    } while (seen < target);
#else
    while (*static_cast<volatile unsigned long long*>(counter) < target) {
    }
    __threadfence();
#endif
  }
  __syncthreads();
}
// Both halves at once.
__device__ __forceinline__ void row_barrier(unsigned long long* arrivals,
                                            unsigned long long target) {
  row_arrive(arrivals);
  row_wait(arrivals, target);
}

// The rows step t runs: a packed run's batch size (bs, [T] in device
// memory), or B; none past the last step.
__device__ __forceinline__ int64_t rows_at(const int64_t* bs, int64_t B, int64_t T_, int64_t t) {
  return t >= T_ ? 0 : bs != nullptr ? bs[t] : B;
}

// Step t of a backward chunk (steps t1 - 1 down to t0 of T_, set up as
// sequence_backward's loop sets them up, lltm_sequence.h): the rows that
// run at t and at t + 1 (kPacked: a packed run's, see rows_at; else B and
// 0), and the slot of dG_{t+1}: in the chunk, or slot K, which carries the
// next chunk's first.
template <bool kPacked>
struct ChunkStep {
  bool last;  // the sequence's last step: grad_h_n and grad_c_n come in
  int64_t n, n_next, next_slot;
  __device__ __forceinline__ ChunkStep(const int64_t* bs, int64_t B, int64_t T_, int64_t t0,
                                       int64_t t1, int64_t K, int64_t t)
      : last(t == T_ - 1),
        n(kPacked ? rows_at(bs, B, T_, t) : B),
        n_next(kPacked ? rows_at(bs, B, T_, t + 1) : 0),
        next_slot(t + 1 < t1 ? t + 1 - t0 : K) {}
  // Whether a block of rows from `row` on has a recurrent gradient: some of
  // them go on to step t + 1.
  __device__ __forceinline__ bool product_from(int64_t row) const {
    return kPacked ? row < n_next : !last;
  }
};

// kPacked: bs holds a packed run's batch sizes (see rows_at), which do
// not increase: a block row whose rows have all ended is done. Without it
// the kernel is the whole batch's (see backward_persistent_kernel).
// alternate_cells: step t's cell state in slot t & 1 (an inference run,
// ForwardSteps).
template <typename T, bool kPacked>
__global__ void __launch_bounds__(32 * kWarps)
    forward_persistent_kernel(int64_t steps, int64_t B, int64_t S, T* gates, const T* bias,
                              const T* h0, const T* w_hT, const T* c0, T* outs, T* cells,
                              bool alternate_cells, T* h_n, T* c_n, const int64_t* bs,
                              unsigned long long* arrivals) {
  const int64_t step_gates = B * 3 * S, step_state = B * S;
  auto cells_at = [&](int64_t t) { return cells + cell_slot(t, alternate_cells) * step_state; };
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  T* stage = stage_memory<T>();
  for (int64_t t = 0; t < steps; ++t) {
    const int64_t n = kPacked ? rows_at(bs, B, steps, t) : B;
    const int64_t n_next = kPacked ? rows_at(bs, B, steps, t + 1) : 0;
    if (kPacked && r0 >= n) break;
    const bool last = t == steps - 1;
    const bool final_state = kPacked || last;  // h_n / c_n written at rows from n_next
    const T* h_prev = stage_rows(stage, t ? outs + (t - 1) * step_state : h0, B, r0, S);
    forward_fused_step<T, true>(B, S, gates + t * step_gates, bias, h_prev, w_hT,
                                t ? cells_at(t - 1) : c0, outs + t * step_state, cells_at(t),
                                final_state ? h_n : nullptr, final_state ? c_n : nullptr, n,
                                n_next);
    if (!last) row_barrier(arrivals, static_cast<unsigned long long>(t + 1) * gridDim.x);
  }
}

// Steps t1 - 1 down to t0 of a backward chunk, set up as sequence_backward's
// loop sets them up (lltm_sequence.h): dG of step t goes to slot t - t0, the
// last step of the chunk reads the next chunk's first dG from slot K.
// kPacked: bs holds a packed run's batch sizes (see rows_at). Without it
// the step keeps only what a whole batch needs live across the product
// (n and n_next cost registers, and the kernel would spill at 64).
template <typename T, bool kPacked>
__global__ void __launch_bounds__(32 * kWarps)
    backward_persistent_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                               const T* go, const T* ghn, const T* gcn, T* dG, const T* w_h,
                               int64_t ld, T* dc, const T* gates, const T* cells, const T* c0,
                               Acc<T>* partial, const int64_t* bs, unsigned long long* arrivals) {
  const int64_t step_gates = B * 3 * S, step_state = B * S;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  T* stage = stage_memory<T>();
  for (int64_t t = t1 - 1; t >= t0; --t) {
    // Whole batch: every row runs, grad_h_n comes at the last step.
    const ChunkStep<kPacked> step_at(bs, B, T_, t0, t1, K, t);
    // No row of the block goes on to step t + 1: no recurrent gradient.
    const T* dG_next = step_at.product_from(r0)
                           ? stage_rows(stage, dG + step_at.next_slot * step_gates, B, r0, 3 * S)
                           : nullptr;
    backward_fused_step<T, true>(B, S, go ? go + t * step_state : nullptr,
                                 kPacked || step_at.last ? ghn : nullptr, dG_next, w_h, ld,
                                 step_at.last ? gcn : dc, gates + t * step_gates,
                                 t ? cells + (t - 1) * step_state : c0, dG + (t - t0) * step_gates,
                                 dc, partial, step_at.n, step_at.n_next);
    if (t > t0) row_barrier(arrivals, static_cast<unsigned long long>(t1 - t) * gridDim.x);
  }
}

#include "lltm_sequence_tc.cuh"
#include "lltm_sequence_tc_local.cuh"
#include "lltm_sequence_tc_ksplit.cuh"
#include "lltm_sequence_resident.cuh"

// -- small helpers -------------------------------------------------------------------------

// d_bias[c] = sum over p of partial[p, c], in order, in double.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    bias_finish_kernel(int64_t cols, int64_t parts, const Acc<T>* __restrict__ partial,
                       T* __restrict__ d_bias) {
  OPSCOMMON_KERNEL_LOOP(c, cols) {
    double s = 0.0;
    for (int64_t p = 0; p < parts; ++p) s += static_cast<double>(partial[p * cols + c]);
    d_bias[c] = to_storage<T>(static_cast<Acc<T>>(s));
  }
}

// dst[r, c] (row stride ld) += src[r, c] (contiguous).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    add_into_kernel(int64_t rows, int64_t cols, int64_t ld, T* __restrict__ dst,
                    const T* __restrict__ src) {
  const int64_t n = rows * cols;
  OPSCOMMON_KERNEL_LOOP(i, n) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    T* p = dst + r * ld + c;
    *p = to_storage<T>(to_acc(*p) + to_acc(src[i]));
  }
}

// One tensor of a pad_columns_kernel launch: dst [rows, n_dst]
// (contiguous) from src (row stride ld_src): dst row g * group_dst + i is
// src row g * group_src + i for i < live, zero past it; its columns are that
// row's with `insert` zero columns at column `at` (insert < 0: -insert of
// src's columns there left out). Pads a state size to a multiple of 8 and
// cuts it back (see padded_state).
struct PadJob {
  void* dst;
  const void* src;
  int64_t rows, n_dst, group_dst, group_src, live, at, insert, ld_src;
};
// The most tensors a launch takes: the backward's padded inputs.
constexpr int kMaxPadJobs = 9;
struct PadJobs {
  PadJob job[kMaxPadJobs];
};

// Tensor blockIdx.y of `jobs` (one launch for all the tensors of a padded
// call's inputs or results: each launch and allocation costs host time,
// which such small calls are mostly made of).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    pad_columns_kernel(const __grid_constant__ PadJobs jobs) {
  const PadJob& j = jobs.job[blockIdx.y];
  T* __restrict__ dst = static_cast<T*>(j.dst);
  const T* __restrict__ src = static_cast<const T*>(j.src);
  const int64_t n = j.rows * j.n_dst;
  OPSCOMMON_KERNEL_LOOP(e, n) {
    const int64_t r = e / j.n_dst, c = e - r * j.n_dst;
    const int64_t g = r / j.group_dst, i = r - g * j.group_dst;
    T v = to_storage<T>(Acc<T>(0));
    if (i < j.live && (c < j.at || c >= j.at + j.insert)) {
      v = src[(g * j.group_src + i) * j.ld_src + (c < j.at ? c : c - j.insert)];
    }
    dst[e] = v;
  }
}

// out[c, r] = in[r * ld + c] (r < rows, c < cols; out contiguous): the
// fused kernels' W_h^T from the weights' first S columns, by element
// bytes (U: an unsigned integer of the element's size), 32 x 32 tiles
// through shared memory so that reads and writes are both coalesced.
// torch's own transposing copy (contiguous through the dispatcher: clone,
// empty_like, a TensorIterator copy) was about a quarter of the forward
// op's host time in a sampled profile (H100 machine, float16 T64 B8 S128).
constexpr int kTransposeTile = 32, kTransposeRows = 8;
template <typename U>
__global__ void __launch_bounds__(kTransposeTile* kTransposeRows)
    transpose_kernel(int64_t rows, int64_t cols, int64_t ld, const U* __restrict__ in,
                     U* __restrict__ out) {
  __shared__ U tile[kTransposeTile][kTransposeTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * ld + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][i];
  }
}

// Rows of bias partial sums of the cuBLAS-path backward kernel: about one
// wave of blocks (of 8 a multiprocessor), rows covered by the grid-stride
// loop, kCellRows a thread a pass.
int64_t backward_block_rows(int64_t B, int64_t S, int device) {
  const int64_t grid_x = (S + 31) / 32;
  const int64_t wave = static_cast<int64_t>(opscommon::multiprocessor_count(device)) * 8;
  const int64_t per_block = kBwdRows * kCellRows;
  const int64_t want = std::max<int64_t>(1, (B + per_block - 1) / per_block);
  return std::min<int64_t>({want, std::max<int64_t>(1, wave / grid_x), 65535});
}

// kernel<<<grid, block, 0, stream>>>(args...), allowed to launch before the
// kernel ahead of it in the stream completes (programmatic dependent launch)
// on sm_90+: the cuBLAS path's cell kernels, which wait for it at their
// start (wait_for_grid_dependencies). It takes away part of the gap between a
// step's kernels, which the GPU otherwise spends idle. On older GPUs, and
// with LLTM_OP_SEQUENCE_PDL=0 (A/B), a plain launch.
template <typename... Params, typename... Args>
void launch_after_prior(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                        int device, Args... args) {
  launch_dependent(kernel, grid, block, stream, device, env_int("LLTM_OP_SEQUENCE_PDL", 1) != 0,
                   args...);
}

int64_t fused_block_rows(int64_t B) { return std::max<int64_t>(1, (B + kRows - 1) / kRows); }

unsigned int grid_dim(int64_t v, const char* what) {
  OPSCOMMON_CHECK(v >= 1 && v <= 0x7fffffff, kSeqForward, ": ", what, " too large for one grid");
  return static_cast<unsigned int>(v);
}

// tc::backward_partial's shape: kb tiles a block, nto column tiles a warp
// (kb 0: not that kernel).
struct PartialShape {
  int kb = 0, nto = 0;
};

// A block-local kernel's launch (lltm_sequence_tc_local.cuh): 16 rows (8
// where fma) and every column a cluster of grid.x blocks (one block where
// grid.x is 1) of `threads` threads, grid (grid.x, ceil(B / rows)), `smem`
// bytes of shared memory a block; fma: full float32's kernels, the product
// on the FMA units.
struct LocalLaunch {
  bool ok = false;
  bool fma = false;
  // The backward by partial sums, for whole batches (a packed one runs
  // backward_local): see use_partial_sums.
  PartialShape partial;
  int split = 1;  // warps a column tile (fma; the tensor cores' cluster forward)
  // Batch rows a cluster: 16, or 8 (see tc::kLocalEightRows).
  int rows = static_cast<int>(tc::kLocalRows);
  int threads = 0;
  dim3 grid;
  size_t smem = 0;
};

// The tensor-core path (ok): each direction runs the block-local kernel
// where its launch is ok, the global-barrier kernel otherwise, whose
// backward launch is NJ = 8q columns and bm rows a block, grid (ceil(S /
// NJ), ceil(B / bm)), smem_backward bytes of shared memory, and whose
// forward launch is forward_shape's, smem_forward bytes.
struct TcPlan {
  bool ok = false;
  LocalLaunch local_forward, local_backward;
  bool global = false;  // the global-barrier launches below fit
  int q = 0;
  int64_t bm = 0;
  dim3 grid;
  // The forward's block shape: the backward's, but where a 16-bit forward
  // runs on wgmma in another shape of as many blocks (see compute_tc_plan).
  struct Shape {
    int q = 0;
    int64_t bm = 0;
    dim3 grid;
  } forward_shape;
  size_t smem_forward = 0, smem_backward = 0;
  // The forward spreads its cells over the block's threads (kSpread, with
  // the shared memory that takes) where a row tile has 4 or 8 warps (bm 16
  // or 32) and it fits (LLTM_OP_SEQUENCE_SPREAD_CELLS=0: never; A/B).
  // Measured (H100, T256, us a forward step, spread / the tiles' first
  // warps): float16 B8 S1024 3.33 / 3.50, B32 5.11 / 5.63, B64 6.86 / 6.86;
  // float32 TF32 B64 S512 5.08 / 5.42; with 2 warps a tile (bm 64) slower:
  // float32 TF32 B64 S1024 9.98 / 9.63.
  bool spread = false;
  size_t smem_forward_spread = 0;
  // The forward's product on wgmma (kWgmma, see lltm_sequence_tc.cuh):
  // 16-bit types on an sm_90 device (the kernels run it where the build has
  // sm_90a code), blocks of 4 or 8 row tiles (every warp of both warpgroups
  // busy) whose warpgroups' k shares are whole groups (wgmma_whole_groups),
  // not spread (LLTM_OP_SEQUENCE_WGMMA=0: never; A/B).
  bool wgmma = false;
  // The backward with k split over clusters of tc::kKsParts blocks
  // (lltm_sequence_tc_ksplit.cuh): padded batches of 16-bit types on sm_90
  // with the build's sm_90a code (wgmma) past one block row (B > 64),
  // where its parts are whole groups of chunks (S = 1024), its weights fit
  // and every cluster is resident at once (LLTM_OP_SEQUENCE_KSPLIT=0:
  // never; A/B).
  struct KSplit {
    bool ok = false;
    dim3 grid;
    size_t smem = 0;
  } ksplit;
  // The forward's cluster variant (sm_90; see lltm_sequence_tc.cuh): its own
  // block shape, the clusters being the grid's rows.
  struct Cluster {
    bool ok = false;
    int q = 0;
    int64_t bm = 0;
    dim3 grid;
    size_t smem = 0;
  } cluster;
  // Blocks rows of the backward's grid (rows of its bias-gradient partial sums).
  int64_t backward_rows() const {
    if (local_backward.ok) return local_backward.grid.y;
    return std::max<int64_t>(grid.y, ksplit.ok ? ksplit.grid.y : 0);
  }
};

// cudaFuncSetAttribute(kernel, attr, value) on the current device, once a
// (kernel, device, attr, value): a call costs 1.5-3 us of host time, and a
// call of a sequence op launches up to three kernels.
template <typename Kernel>
void set_attribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  static std::mutex mutex;
  static std::set<std::tuple<const void*, int, int, int>> done;
  int device = 0;
  OPSCOMMON_CUDA_CHECK(cudaGetDevice(&device));
  const auto key =
      std::make_tuple(reinterpret_cast<const void*>(kernel), device, static_cast<int>(attr), value);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (done.count(key) != 0) return;
  }
  OPSCOMMON_CUDA_CHECK(cudaFuncSetAttribute(kernel, attr, value));
  std::lock_guard<std::mutex> lock(mutex);
  done.insert(key);
}

// A cluster launch of `kernel` (grid.x blocks a cluster).
template <typename Kernel>
cudaLaunchConfig_t cluster_config(Kernel, const dim3& grid, size_t smem, cudaStream_t stream,
                                  cudaLaunchAttribute* attr, int threads = tc::kTcThreads,
                                  unsigned int cluster_x = 0) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster_x != 0 ? cluster_x : grid.x;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// The cluster variant's shape on sm_90+: the global-barrier kernel's own
// (q, bm), where its column blocks make one cluster (at most 16, what sm_90
// allows beyond the portable 8) and every cluster is resident at once. With
// the same work a block, it only trades the counter barrier and the L2
// reads of h for the cluster's. A cluster shape of its own (fewer, wider
// blocks) was slower wherever it differed.
template <typename T>
TcPlan::Cluster compute_cluster_plan(int64_t B, int64_t S, int q, int64_t bm, int device,
                                     int optin) {
  TcPlan::Cluster best;
  if (opscommon::compute_capability_major(device) < 9) return best;
  const int64_t gx = (S + 8 * q - 1) / (8 * q), gy = (B + bm - 1) / bm;
  if (gx > 16) return best;
  with_q(q, [&](auto qc) {
    constexpr int Q = decltype(qc)::value;
    auto kernel = tc::forward_tc_kernel<T, Q, false, true>;
    set_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    set_attribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    const size_t smem = tc::forward_smem<T>(S, Q, bm) + tc::cluster_state_bytes<T>(Q, bm);
    if (smem > static_cast<size_t>(optin)) return;
    const dim3 grid(static_cast<unsigned int>(gx), static_cast<unsigned int>(gy));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config(kernel, grid, smem, nullptr, &attr);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // not launchable here: no cluster variant
      return;
    }
    if (clusters >= gy) best = {true, Q, bm, grid, smem};
  });
  return best;
}

// Whether the code loaded for the current device has wgmma (see
// tc::wgmma_build_probe_kernel).
bool wgmma_loaded() {
  cudaFuncAttributes marked = {}, unmarked = {};
  if (cudaFuncGetAttributes(&marked, tc::wgmma_build_probe_kernel<true>) != cudaSuccess ||
      cudaFuncGetAttributes(&unmarked, tc::wgmma_build_probe_kernel<false>) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return marked.sharedSizeBytes > unmarked.sharedSizeBytes;
}

// The k-split backward's launch (see TcPlan::KSplit), or none.
template <typename T>
TcPlan::KSplit compute_ksplit_plan(int64_t B, int64_t S, int device, int optin) {
  TcPlan::KSplit best;
  if constexpr (sizeof(T) == 2) {
    constexpr int P = tc::kKsParts;
    const int64_t gy = (B + tc::kKsRows - 1) / tc::kKsRows;
    const int64_t chunks = tc::ksplit_chunks<T>(S, P);
    const size_t smem = tc::ksplit_smem<T>(S, P);
    // The size's checks first: the driver's (the loaded code, the clusters)
    // only for a size the kernel takes.
    if (opscommon::compute_capability_major(device) < 9 || gy < 2 || gy > 65535 ||
        S % (tc::kKsOwn * P) != 0 || chunks == 0 || chunks % tc::kWgmmaGroups != 0 ||
        smem > static_cast<size_t>(optin) || !wgmma_loaded()) {
      return best;
    }
    auto kernel = tc::backward_ksplit_kernel<T, P>;
    set_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    const dim3 grid(static_cast<unsigned int>(S / tc::kKsOwn), static_cast<unsigned int>(gy));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg =
        cluster_config(kernel, grid, smem, nullptr, &attr, tc::kTcThreads, P);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // not launchable here
      return best;
    }
    if (static_cast<int64_t>(clusters) * P >= static_cast<int64_t>(grid.x) * gy) {
      best = {true, grid, smem};
    }
  }
  return best;
}

template <typename F>
void with_bool(bool b, F&& f) {
  if (b) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// f(kCluster, kSmallK, kSplit) for the block-local kernels (the tensor
// cores' and full float32's): one block or a cluster, in a cluster whether
// the product fits the smaller register chunks (`small_k`: tc::local_small_k
// or tc::fma_small_k; a block alone has one variant), and past
// them the warps a column tile (`split`, 1 or 2: local_forward_split,
// compute_fma_local_launch).
template <typename F>
void with_local_variant(bool cluster, bool small_k, int split, F&& f) {
  using One = std::integral_constant<int, 1>;
  with_bool(cluster, [&](auto kc) {
    if constexpr (decltype(kc)::value) {
      with_bool(small_k, [&](auto ks) {
        if constexpr (decltype(ks)::value) {
          f(kc, ks, One{});
        } else if (split == 2) {
          f(kc, ks, std::integral_constant<int, 2>{});
        } else {
          f(kc, ks, One{});
        }
      });
    } else {
      f(kc, std::false_type{}, One{});
    }
  });
}

// f(kRows) for a tensor-core block-local kernel of `rows` rows a cluster
// (LocalLaunch::rows): 8 in a cluster (kCluster), else 16.
template <bool kCluster, typename F>
void with_local_rows(int rows, F&& f) {
  if constexpr (kCluster) {
    if (rows == tc::kLocalEightRows) {
      f(std::integral_constant<int, tc::kLocalEightRows>{});
      return;
    }
  }
  f(std::integral_constant<int, static_cast<int>(tc::kLocalRows)>{});
}

// with_local_variant for full float32's backward, whose cluster variant
// past the small K also comes with 4 warps a tile (split 4).
template <typename F>
void with_fma_variant(bool cluster, bool small_k, int split, F&& f) {
  if (cluster && !small_k && split == 4) {
    f(std::true_type{}, std::false_type{}, std::integral_constant<int, 4>{});
    return;
  }
  with_local_variant(cluster, small_k, split, f);
}

// f(KB, NTo) for the tc::backward_partial shapes built: full float32's
// (kFma) KB 2 or 4 tiles a block, 2 column tiles a warp (clusters of 8
// blocks of 2 tiles, or of 4 of 4, at S = 128); the tensor cores' 4 and
// 4, or 8 and 2 (clusters of 4 or 2 at S = 128), and in 16-bit types 4
// and 8 (clusters of 8 blocks of 4 warps at S = 256, each warp's columns
// two blocks').
template <typename T, bool kFma, typename F>
void with_partial_shape(const PartialShape& p, F&& f) {
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  if constexpr (kFma) {
    if (p.kb == 2) {
      f(Two{}, Two{});
    } else {
      f(Four{}, Two{});
    }
  } else {
    if constexpr (sizeof(T) == 2) {
      if (p.kb == 4 && p.nto == 8) {
        f(Four{}, std::integral_constant<int, 8>{});
        return;
      }
    }
    if (p.kb == 4) {
      f(Four{}, Four{});
    } else {
      f(std::integral_constant<int, 8>{}, Two{});
    }
  }
}
// The shape of a cluster backward of C blocks of `warps` warps at state
// size S, where it is built (`wide`: a 16-bit type's): every block the
// same tiles, every warp the same columns, a whole number of blocks' or
// a part of one block's.
PartialShape partial_shape(int64_t S, int C, int warps, bool fma, bool wide) {
  PartialShape p;
  if (C < 2 || S % (8 * C) != 0 || (S / 8) % warps != 0) return p;
  const int kb = static_cast<int>(S / 8 / C), nto = static_cast<int>(S / 8 / warps);
  const bool built =
      fma ? nto == 2 && (kb == 2 || kb == 4)
          : (kb == 4 && nto == 4) || (kb == 8 && nto == 2) || (wide && kb == 4 && nto == 8);
  if (built) {
    p.kb = kb;
    p.nto = nto;
  }
  return p;
}

template <typename F>
void with_q(int q, F&& f) {
  if (q == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (q == 2) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 4>{});
  }
}

// Blocks of `kernel` resident per multiprocessor with `smem` bytes each
// (after allowing it the device's opt-in shared memory).
template <typename Kernel>
int resident_blocks(Kernel kernel, size_t smem, int smem_optin, int threads = tc::kTcThreads) {
  set_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin);
  int per_sm = 0;
  OPSCOMMON_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return per_sm;
}

// The rule: float16 / bfloat16 on sm_80+ (float32 too where the caller allows
// TF32: torch's float32 matmul precision), S a multiple of 8, and a grid of
// at most kTcMaxRows rows a block whose blocks (each with its weight slice in
// shared memory) are all resident at once. Among the block shapes that fit,
// the one with the most blocks (parallelism), then the order of tie_rank
// (at most 64 rows a block, then at most kTieMaxStateRows elements of state
// rows a block, then 16 columns a block before 32, then 8). A 16-bit
// forward takes, among shapes of as many blocks, one whose product runs on
// wgmma first (its own shape: see compute_tc_plan).
// LLTM_OP_SEQUENCE_TENSOR_CORES=0 turns the path off; forcing the cuBLAS
// path or the per-step launches (LLTM_OP_SEQUENCE_FUSED=0,
// LLTM_OP_SEQUENCE_PERSISTENT=0) does too. `shape` (tc_plan's
// LLTM_OP_SEQUENCE_TC_SHAPE=1000 q + bm, or 0) asks for one block shape
// (tests, benchmarks; none where it does not fit).
//
// Every column block re-reads its rows' whole state each step (from L2):
// column blocks x B x S elements forward, three times that backward. Past
// kTcMaxStateReread bytes a forward step the cuBLAS products win. Measured
// (H100, T256, forward): float32 on TF32 at B256 S1024 re-reads 64 MiB a
// step and took 10.1 ms against 7.1 for the cuBLAS path; at 32 MiB (B64
// S1024, B256 S512; bfloat16 B256 S1024) the tensor-core kernels win
// (3.5 vs 5.1, 3.6 vs 7.5, 3.8 vs 5.0 ms).
constexpr int64_t kTcMaxStateReread = int64_t(32) << 20;

// Which of two block shapes with as many blocks the rule takes: the higher
// rank. First those of at most 64 rows a block (4 row tiles), then those
// whose rows hold at most kTieMaxStateRows elements of state (bm x S: what a
// block re-reads each step, three times that backward), then q = 2, then 4,
// then 1, in every dtype. Measured (H200, T256, kernel time of a
// forward+backward call, us, q x 8 columns and bm rows a block): bfloat16
// B256 S384 2396 at q2 bm64 against 2998 at q4 bm32 and 3061 at q1 bm128;
// B128 S384 1643 at q2 bm32 against 1887 at q4 bm16; B64 S768 2447 at q2
// bm32 against 2744 at q4 bm16; but B256 S1024 5201 at q4 bm64 against
// 6338 at q2 bm128, B192 S768 4292 at q4 bm48 against 4816 at q2 bm96, and
// B128 S768's backward 1905 at q4 bm32 against 1990 at q2 bm64 (bm x S 48
// Ki). float32 on TF32: B256 S256 backward 1422 at q2 bm32 against 1860 at
// q4 bm16 and 1547 at q1 bm64; B256 S384 forward 1483 / backward 2278 at
// q2 bm64 against 1760 / 2419 at q4 bm32 and 1854 / 2947 at q1 bm128.
constexpr int64_t kTieMaxStateRows = int64_t(32) << 10;
constexpr int tie_rank(int q, int64_t bm, int64_t S) {
  const int by_q = q == 2 ? 3 : q == 4 ? 2 : 1;
  return (bm <= 64 ? 8 : 0) + (bm * S <= kTieMaxStateRows ? 4 : 0) + by_q;
}

// The block-local kernels (sm_80+; clusters of them on sm_90+) where the
// whole recurrent matrix fits in the shared memory of one block, or of a
// cluster of C = 2 to 16 blocks (forward: its slices of W_h^T and two state
// buffers; backward: of W_h and two dG buffers), and the ceil(B / 16)
// clusters fit in one wave. No block waits for another cluster: a step
// costs a __syncthreads (the cluster's exchange) instead of a round trip
// through L2 and a grid-wide barrier.
//
// C: one block up to 8 column tiles (S <= 64; the forward 4, see below),
// past that the fewest blocks of at most 4 warps, or of at most 8 where
// those clusters would take more than half the multiprocessors. A
// cluster's step exchange (mbarriers, see the kernels) costs more than a
// __syncthreads, so one block is faster while a block's warps are few;
// past that a block's step (every warp's product, then its cell) grows
// with its warps, and clusters share them. Measured (H100, T256, 16-bit,
// us a step, forward / backward): S = 128 at C = 2 / 4 / 8: 1.45 / 1.15 /
// 1.22 and 2.25 / 2.05 / 2.19 (B8); S = 256 B256 at C = 4 / 8: 2.52 / 2.91
// and 4.45 / 5.07 (global kernels 5.91 / 5.94), at B8 2.14 / 1.68 and 3.67
// / 3.22. Up to local_max_s (forward, backward) per dtype, measured against
// the global-barrier kernels (T256, B 8 / 64 / 256;
// bench_lltm_sequence_variants.py --table local): 16-bit S = 512 forward
// at C = 16 3.02 / 3.20 us at B8 / B64 against 3.04 / 4.19; float32 on
// TF32 (with ldmatrix and the straight prefetch) S = 256 forward at C = 8
// / 8 / 4 3.25 / 3.39 / 3.99 us against 3.42 / 4.33 / 6.40 (B 8 / 64 /
// 256), S = 128 backward at C = 4 3.85 / 3.99 / 4.05 against 3.91 / 4.75
// / 6.14. Past the bounds slower: 16-bit backward at S = 512 (C = 16)
// 5.9-6.3 against 3.5-5.2, float32 backward at S = 256 (C = 8 / 16)
// 7.3-8.1 against 4.9-5.9.
// LLTM_OP_SEQUENCE_LOCAL_CLUSTER=C asks for C blocks wherever they fit,
// past local_max_s too.
constexpr int kLocalOneBlockTiles = 8;
constexpr int kLocalClusterWarps = 4;
template <typename T>
int64_t local_max_s(bool forward) {
  if (sizeof(T) == 2) return forward ? 512 : 256;
  return forward ? 256 : 128;
}

// Clusters of `kernel` (C blocks of `threads`, `smem` bytes each) resident at
// once; blocks for C = 1.
template <typename Kernel>
int resident_clusters(Kernel kernel, int C, int threads, size_t smem, int optin, int sms) {
  if (C == 1) return resident_blocks(kernel, smem, optin, threads) * sms;
  set_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  set_attribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(kernel, dim3(C), smem, nullptr, &attr, threads);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not launchable here
    return 0;
  }
  return clusters;
}

// The block-local launch of gy clusters of C blocks (`threads` a block,
// `smem` bytes, `split` warps a column tile) where both kernels of the
// variant, a whole batch's and a packed one's, have that many clusters
// resident at once; not ok otherwise.
template <typename Whole, typename Packed>
LocalLaunch resident_local_launch(Whole whole, Packed packed, int C, int64_t gy, int threads,
                                  size_t smem, int split, int optin, int sms) {
  LocalLaunch launch;
  if (gy > std::min(resident_clusters(whole, C, threads, smem, optin, sms),
                    resident_clusters(packed, C, threads, smem, optin, sms))) {
    return launch;
  }
  launch.ok = true;
  launch.split = split;
  launch.threads = threads;
  launch.grid = dim3(static_cast<unsigned int>(C), static_cast<unsigned int>(gy));
  launch.smem = smem;
  return launch;
}

// Warps a column tile of the block-local forward on C blocks of `warps`
// tiles: two (each half the tile's chunks of k; the first adds the
// second's sums and runs the cell) in a cluster where a warp's chunks pass
// the 8 it holds in registers (16-bit S > 256, float32 S > 128: each half
// then in registers, none read from shared memory a step) and the blocks
// have at most half the warps a cluster's block may, else one. H100,
// T1024, us a forward step, one warp a tile / two: 16-bit S = 512 B8
// 2.32-2.44 / 1.97-2.06, B64 3.18-3.31 / 2.76; float32 TF32 S = 256 B8
// 2.05 / 1.72-1.79, B64 2.73-3.09 / 2.30-2.44. At 8 chunks or fewer two
// were slower (float32 S = 128 B8 1.00-1.04 / 1.22-1.25; 16-bit S = 192
// B8 1.09-1.13 / 1.18-1.23) or the same (16-bit S = 256 B64).
// LLTM_OP_SEQUENCE_LOCAL_SPLIT=1 asks for one (tests, benchmarks).
template <typename T>
int local_forward_split(bool forward, int C, int64_t S, int warps) {
  const int64_t chunks = (S + tc::kChunk<T> - 1) / tc::kChunk<T>;
  if (!forward || C == 1 || chunks <= tc::kLocalForwardRegChunks<T, true, false> ||
      2 * warps > tc::kLocalClusterMaxWarps) {
    return 1;
  }
  return env_int("LLTM_OP_SEQUENCE_LOCAL_SPLIT", 2) == 1 ? 1 : 2;
}

// The global-barrier kernels' kHalfRows variants (lltm_sequence_tc.cuh):
// 16-bit types (float32 on TF32 unmeasured with them).
template <typename T>
constexpr bool kHalfRowsKernels = sizeof(T) == 2;
// Whether a whole (not packed) batch of B rows runs them: B <= 8, one row
// tile whose second half is past the batch. LLTM_OP_SEQUENCE_HALF_ROWS=0
// turns them off (benchmarks).
template <typename T>
bool half_rows(int64_t B, bool packed) {
  return kHalfRowsKernels<T> && B <= 8 && !packed && env_int("LLTM_OP_SEQUENCE_HALF_ROWS", 1) != 0;
}

// The global-barrier forward's kernel for a launch: padded or packed, the
// half-row variant where `half` (half_rows), its cells spread or not.
template <typename T, int Q, bool kSpread>
auto forward_tc_variant(bool packed, bool half, bool wgmma = false) {
  auto kernel = packed ? tc::forward_tc_kernel<T, Q, true, false, false, kSpread>
                       : tc::forward_tc_kernel<T, Q, false, false, false, kSpread>;
  if constexpr (kHalfRowsKernels<T>) {
    if (half) kernel = tc::forward_tc_kernel<T, Q, false, false, true, kSpread>;
    if constexpr (!kSpread) {
      if (wgmma) {
        kernel = packed ? tc::forward_tc_kernel<T, Q, true, false, false, false, true>
                        : tc::forward_tc_kernel<T, Q, false, false, false, false, true>;
      }
    }
  }
  return kernel;
}
// The fewest blocks a multiprocessor holds of the forward variants above
// (cells spread or not) with `smem` bytes of shared memory: a plan holds for
// whichever of them a call launches.
template <typename T, int Q, bool kSpread>
int forward_tc_residency(size_t smem, int optin) {
  int per_sm =
      std::min(resident_blocks(forward_tc_variant<T, Q, kSpread>(false, false), smem, optin),
               resident_blocks(forward_tc_variant<T, Q, kSpread>(true, false), smem, optin));
  if constexpr (kHalfRowsKernels<T>) {
    per_sm = std::min(per_sm,
                      resident_blocks(forward_tc_variant<T, Q, kSpread>(false, true), smem, optin));
    if constexpr (!kSpread) {
      for (bool packed : {false, true}) {
        per_sm = std::min(
            per_sm,
            resident_blocks(forward_tc_variant<T, Q, false>(packed, false, true), smem, optin));
      }
    }
  }
  return per_sm;
}

// tc::backward_partial's kernel of a shape: the FMA units' (full float32)
// or the tensor cores'.
template <typename T, bool kFma, int KB, int NTo>
auto partial_kernel() {
  if constexpr (kFma) {
    return tc::backward_fma_partial_kernel<KB, NTo>;
  } else {
    return tc::backward_tc_partial_kernel<T, KB, NTo>;
  }
}

// A cluster backward of 8 rows a cluster (`rows`) by partial sums
// (tc::backward_partial) where its shape is built and its clusters fit
// with the larger shared memory of it and the packed kernel's (`packed`,
// which packed batches still run): l.partial set, l.smem the larger.
// Each block pushes S values a row a step where backward_local pushes 3S
// (float32: a third of the bytes). Measured (H200, T256, us of the
// backward kernel, backward_local against this): float32 TF32 B8 498 /
// 343, B64 503 / 352, B256 623 / 476; full float32 B8 457 / 393, B64 502
// / 421; bfloat16 B8 332 / 296; float16 B64 342 / 294; at 16-bit S = 256
// (clusters of 8 blocks, 4 warps of 8 column tiles) float16 B64 522 / 424,
// bfloat16 B64 512 / 423
// (bench/results-h200/lltm_sequence_backward_partial_sums_0.6.30.md).
// Full float32 at B256 keeps backward_local: its rule gives the backward
// one warp a tile there (4 warps a block), a shape not built.
// LLTM_OP_SEQUENCE_PARTIAL=0 keeps backward_local (tests, benchmarks).
template <typename T, bool kFma, typename Packed>
void use_partial_sums(LocalLaunch& l, int64_t rows, int64_t S, int64_t gy, int optin, int sms,
                      Packed packed) {
  if (env_int("LLTM_OP_SEQUENCE_PARTIAL", 1) == 0 || rows != tc::kLocalEightRows) return;
  const int C = static_cast<int>(l.grid.x), warps = l.threads / 32;
  const PartialShape shape = partial_shape(S, C, warps, kFma, sizeof(T) == 2);
  if (shape.kb == 0) return;
  const size_t smem =
      std::max(l.smem, tc::partial_backward_smem<T>(kFma, C, shape.kb, warps, shape.nto));
  if (smem > static_cast<size_t>(optin)) return;
  bool fits = false;
  with_partial_shape<T, kFma>(shape, [&](auto kb, auto nto) {
    constexpr int KB = decltype(kb)::value, NTo = decltype(nto)::value;
    fits = std::min(resident_clusters(partial_kernel<T, kFma, KB, NTo>(), C, l.threads, smem, optin,
                                      sms),
                    resident_clusters(packed, C, l.threads, smem, optin, sms)) >= gy;
  });
  if (!fits) return;
  l.partial = shape;
  l.smem = smem;
}

// The largest state size that the rule runs on 8 rows a cluster.
constexpr int64_t kLocalEightRowsMaxS = 256;
// Past it, the 16-bit forward up to S = 512 (on clusters of 16 blocks
// there) runs on 8 rows a cluster where those clusters take at most half
// the multiprocessors (B <= 32 on an H100 or H200): its step is mostly per
// row, as below, and twice the clusters still leave most of the GPU idle.
// H200, T256, wall time of a call, us, 16 rows against 8: float16 S = 512
// inference B16 745 / 578, B24 874 / 676, B32 802 / 639, T1024 B16 2582 /
// 1980; bfloat16 B16 770 / 604; S = 384 float16 B16 561 / 459, bfloat16
// B32 701 / 558; forward+backward (its backward on the global-barrier
// kernels either way) float16 B16 1641 / 1520, B32 1785 / 1633, T1024 B16
// 5848 / 5258. Past that batch the clusters of 8 rows would be of 8
// blocks, slower (see compute_local_launch).
template <typename T>
bool wide_eight_rows(int64_t S, bool forward) {
  return sizeof(T) == 2 && forward && S > kLocalEightRowsMaxS && S <= 512;
}

// Whether the rule runs a batch of at most 8 rows (one cluster either way)
// on 8 rows a cluster: S = 40 to 128 in 16-bit types, S = 40 to 256 in
// float32 (TF32; its forward from S = 24). H200, T256, kernel time of a
// call, us, 16 rows against 8 (both directions where they are
// block-local), B8: float32 S = 128 inference 245 against 227,
// forward+backward 761 against 723; S = 256 414 / 387 and 1273
// / 1246; bfloat16 S = 128 242 / 230 and 604 / 556; float16 S = 128 228 /
// 218 and 590 / 552; float32 B5 S = 128 264 / 234 and 742 / 682. Not at
// 16-bit S = 256 (bfloat16 257 / 303 and 793 / 811, float16 249 / 295 and
// 788 / 811). And the 16-bit forward from S = 40 (clusters of 2 to 4
// blocks; the 16-row plan takes one block up to S = 32, which 8 rows a
// cluster cannot): H200, T1024, wall time of an inference call, us, 16
// rows against 8, B3 / B8: float16 S = 40 835 / 691 and 839 / 687, S = 64
// 824 / 681 and 810 / 765, S = 96 899 / 785 and 918 / 835, S = 112 923 /
// 810 and 866 / 808; bfloat16 S = 40 892 / 739 and 844 / 716, S = 96 963
// / 832 and 963 / 875. Its backward there takes 8 too since 0.6.36 (0.6.35
// kept 16: T256 B8 forward+backward calls, about a millisecond of host
// time, had moved both ways by up to 16%): H200, T1024, wall time of a
// forward+backward call, us, 16 rows against 8 in the backward, B8 / B3:
// float16 S = 40 1773 / 1748 and 1854 / 1833, S = 64 2203 / 2001 and 2087
// / 1958, S = 96 2281 / 2206 and 2254 / 2141, S = 120 2421 / 2307 and 2242
// / 2190; bfloat16 S = 64 2221 / 1969 and 2061 / 1873, S = 120 2393 / 2274
// and 2257 / 2152. Below S = 40 the 16-bit forward's one block of 16 rows
// stays (T1024 float16 B8 S24 inference 603 against 660 us on 8).
// float32 (TF32) takes 8 from S = 24 forward and 40 backward (since 0.6.36;
// below S = 128 its 16 rows took one block up to S = 64): H200, wall time of
// a call, us, 16 rows against 8 (both directions), B8 / B3: inference T256 S
// = 24 211 / 191 (B8), S = 32 226 / 200, S = 40 329 / 233 and 322 / 235, S =
// 64 394 / 215, S = 96 283 / 261, S = 120 305 / 283; T1024 S = 32 696 / 615
// and 687 / 651, S = 64 1405 / 700 and 1264 / 742, S = 112 1007 / 916;
// forward+backward T1024 S = 40 2463 / 1972 and 2420 / 1922, S = 64 3334 /
// 2213 and 2924 / 2103, S = 96 2886 / 2753 and 2850 / 2608, S = 120 3283 /
// 3109 and 3037 / 2816; at S = 32 the backward on 8 was slower (T1024 1812 /
// 1910 and 1725 / 1910).
template <typename T>
bool eight_rows_at_small_batch(int64_t S, bool forward) {
  if (sizeof(T) == 4) return S >= (forward ? 24 : 40) && S <= 256;
  return S >= 40 && S <= 128;
}

// One direction's launch with `rows` batch rows a cluster (tc::kLocalRows,
// or tc::kLocalEightRows: clusters only; by the rule, `eight_rule`, up to S
// = 256, where they are at most 8 blocks and take a multiprocessor each:
// past B = 8, and at B <= 8 where eight_rows_at_small_batch says; and the
// 16-bit forward past S = 256 where wide_eight_rows says).
template <typename T>
LocalLaunch compute_local_launch_rows(const Dims& d, int device, int sms, int optin, bool forward,
                                      int64_t rows, bool eight_rule = false) {
  LocalLaunch launch;
  constexpr int Q = tc::kLocalQ;
  const int64_t gy = (d.B + rows - 1) / rows;
  // The kernels' element offsets within a step are int32 (see tc::Places).
  if (gy > 65535 || d.B * 3 * d.S >= (int64_t(1) << 31)) return launch;
  const int64_t want = env_int("LLTM_OP_SEQUENCE_LOCAL_CLUSTER", 0);
  if (want == 0 && d.S > local_max_s<T>(forward)) return launch;
  const bool wide = wide_eight_rows<T>(d.S, forward);
  if (eight_rule && ((d.S > kLocalEightRowsMaxS && !wide) ||
                     (d.B <= tc::kLocalEightRows && !eight_rows_at_small_batch<T>(d.S, forward)))) {
    return launch;
  }
  const int max_c = opscommon::compute_capability_major(device) >= 9 ? tc::kLocalMaxCluster : 1;
  const int tiles = tc::local_tiles(d.S, Q);
  // Without clusters (sm_80 to sm_89), one block up to S = 96 (16-bit) /
  // 64 (float32): at S = 96 on an H100, 0.64-0.81x the global-barrier
  // kernels' step. With them, the forward's clusters take over from S = 40
  // (H100, S = 64 at B 8 / 64 / 256, bfloat16, us a step: one block 1.00 /
  // 1.64 / 1.74, two 0.92 / 1.02 / 1.16), in float32 only past one row
  // block (one block 1.29 / 1.80 / 2.15, two 1.45 / 1.55 / 1.65).
  int one_block_tiles = kLocalOneBlockTiles;
  if (max_c == 1) {
    one_block_tiles = sizeof(T) == 2 ? 12 : kLocalOneBlockTiles;
  } else if (forward && (sizeof(T) == 2 || gy > 1)) {
    one_block_tiles = kLocalOneBlockTiles / 2;
  }
  int cluster_warps = kLocalClusterWarps;
  for (int C = 2; C <= max_c; C *= 2) {
    if (tc::local_block_tiles(d.S, Q, C) <= kLocalClusterWarps) {
      if (gy * C > sms / 2) cluster_warps = tc::kLocalClusterMaxWarps;
      break;
    }
  }
  for (int C = 1; C <= max_c; C *= 2) {
    if (C == 1 && rows != tc::kLocalRows) continue;
    const int warps = tc::local_block_tiles(d.S, Q, C);
    if (warps > (C > 1 ? tc::kLocalClusterMaxWarps : tc::kLocalMaxWarps)) continue;
    if (want > 0 ? C != want : (C == 1 ? tiles > one_block_tiles : warps > cluster_warps)) {
      continue;
    }
    if (eight_rule &&
        (wide ? C != tc::kLocalMaxCluster || 2 * gy * C > sms : C > 8 || gy * C > sms)) {
      return launch;
    }
    for (int split = local_forward_split<T>(forward, C, d.S, warps); split >= 1; --split) {
      const size_t smem = forward ? tc::local_forward_smem<T>(d.S, Q, C, split, rows)
                                  : tc::local_backward_smem<T>(d.S, Q, C, rows);
      if (smem > static_cast<size_t>(optin)) continue;
      auto fits = [&](auto whole, auto packed) {
        return resident_local_launch(whole, packed, C, gy, 32 * warps * split, smem, split, optin,
                                     sms);
      };
      with_local_variant(
          C > 1, tc::local_small_k<T>(d.S, forward), split, [&](auto kc, auto ks, auto kp) {
            constexpr bool kCluster = decltype(kc)::value, kSmallK = decltype(ks)::value;
            constexpr int kSplit = decltype(kp)::value;
            with_local_rows<kCluster>(static_cast<int>(rows), [&](auto kr) {
              constexpr int kRows = decltype(kr)::value;
              launch =
                  forward
                      ? fits(tc::forward_tc_local_kernel<T, Q, false, kCluster, kSmallK, kRows,
                                                         kSplit>,
                             tc::forward_tc_local_kernel<T, Q, true, kCluster, kSmallK, kRows,
                                                         kSplit>)
                      : fits(tc::backward_tc_local_kernel<T, Q, false, kCluster, kSmallK, kRows>,
                             tc::backward_tc_local_kernel<T, Q, true, kCluster, kSmallK, kRows>);
              if (kCluster && !forward && launch.ok) {
                use_partial_sums<T, false>(
                    launch, rows, d.S, gy, optin, sms,
                    tc::backward_tc_local_kernel<T, Q, true, kCluster, kSmallK, kRows>);
              }
            });
          });
      if (launch.ok) {
        launch.rows = static_cast<int>(rows);
        return launch;
      }
    }
    return launch;
  }
  return launch;
}

// The block-local launch of one direction: 8 rows a cluster (sm_90, see
// tc::kLocalEightRows) past B = 8 (where they spread the batch over more
// clusters) up to S = 256 where those clusters are at most 8 blocks and take
// a multiprocessor each, else 16. Measured (H100, T1024, us a step, forward /
// forward+backward, 16 rows against 8): float32 TF32 S = 128 at B16 1.66 /
// 4.25 against 1.21 / 3.16, B64 1.65 / 4.45 against 1.21 / 3.46, B256 (C = 2)
// 2.07 / 5.31 against 1.83 / 4.76; float16 S = 128 B64 1.44 / 3.33 against
// 1.15 / 2.59; bfloat16 S = 256 B64 1.96 / 4.89 against 1.51 / 3.75. Slower
// where they were not: bfloat16 S = 256 B256 (256 blocks) 2.91 / 6.72 against
// 4.81 / 10.52, and the 16-bit forward at S = 512, where 8 rows take clusters
// of 8 blocks instead of 16 (float16 B64: 2.83 against 2.98 us a step). At B8
// (one cluster either way) the float16 forward was slower on 8 (S = 256 1.09
// against 1.25), bfloat16's and float32's faster (S = 256 1.79 against 1.64;
// S = 128 1.16 against 1.07): 8 there where eight_rows_at_small_batch says
// (measured again on an H200, both directions).
// LLTM_OP_SEQUENCE_LOCAL_ROWS=8 or 16 asks for either wherever it fits
// (tests, benchmarks).
template <typename T>
LocalLaunch compute_local_launch(const Dims& d, int device, int sms, int optin, bool forward) {
  const int64_t want = env_int("LLTM_OP_SEQUENCE_LOCAL_ROWS", 0);
  if (opscommon::compute_capability_major(device) >= 9 && want != tc::kLocalRows) {
    const LocalLaunch eight = compute_local_launch_rows<T>(d, device, sms, optin, forward,
                                                           tc::kLocalEightRows, want == 0);
    if (eight.ok || want == tc::kLocalEightRows) return eight;
  }
  return compute_local_launch_rows<T>(d, device, sms, optin, forward, tc::kLocalRows);
}

// Full float32 (no TF32): the block-local kernels with the product on the
// FMA units (lltm_sequence_tc_local.cuh, kFma), where S is a multiple of 8
// up to 128: 8 batch rows a cluster of C blocks of at most 4 warps, one
// block up to S = 32, C = 2 to S = 64 and 4 to 128 (sm_90), each warp's
// weights in registers (96 a thread at S = 128), and the ceil(B / 8)
// clusters one wave of one block a multiprocessor (B <= 264 at S = 128 on
// an H100); LLTM_OP_SEQUENCE_LOCAL_CLUSTER=C asks for C blocks. There is no
// global-barrier kernel of this kind: where these do not apply, path 2's
// resident-weight kernels run. Measured against those (H100, T1024, us a
// step, forward / forward+backward): S = 128 at B 8 / 64 / 256 2.2 / 2.4
// / 3.4 against 2.7 / 3.4 / 5.9 and 4.9 / 5.7 / 8.5 against 5.5 / 7.0 /
// 12.1; S = 64 B16 1.4 / 2.9 against 2.6 / 5.2. The product is most of
// the step: an FMA per row, k and column (768 a thread at S = 128, about
// 2.7 clocks each with one warp an SMSP; without it the step took 1.0 us
// at B8).
LocalLaunch compute_fma_local_launch(const Dims& d, int device, int sms, int optin, bool forward) {
  LocalLaunch launch;
  constexpr int Q = tc::kLocalQ;
  constexpr int64_t rows = tc::kLocalRowsOf<true>;
  const int64_t gy = (d.B + rows - 1) / rows;
  if (gy > 65535 || d.B * 3 * d.S >= (int64_t(1) << 31)) return launch;
  const int max_c = opscommon::compute_capability_major(device) >= 9 ? tc::kLocalMaxCluster : 1;
  const int64_t want = env_int("LLTM_OP_SEQUENCE_LOCAL_CLUSTER", 0);
  int C = d.S <= tc::kFmaMaxS<false, false> ? 1 : tc::fma_small_k(d.S) ? 2 : 4;
  // Past S = 64, clusters of 8 where they take at most half the
  // multiprocessors: each block half the product of 4. Measured (H100,
  // T1024, us a forward / forward+backward step, 8 against 4): B8 S128
  // 1.62 / 3.82 against 1.82 / 4.02, B16 S128 1.69 / 3.97 against 1.90 /
  // 4.12, B8 S96 1.55 / 3.54 against 1.77 / 3.78, B64 S96 1.72 / 4.16
  // against 1.95 / 4.26; at B128 S128 (128 blocks) 2.46 / 5.86 against
  // 2.23 / 5.15.
  if (C == 4 && gy * 8 <= sms / 2) C = 8;
  if (want > 0) C = static_cast<int>(want);
  const int warps = tc::local_block_tiles(d.S, Q, C);
  if (C > max_c || (C & (C - 1)) != 0 || warps > kLocalClusterWarps ||
      d.S > (C == 1 ? tc::kFmaMaxS<false, false> : tc::kFmaMaxS<true, false>)) {
    return launch;
  }
  // One block a multiprocessor: a second one shares its FMA units, and
  // the product is most of the step.
  if (gy * C > sms) return launch;
  // Two warps a tile at S > 64 where all their clusters fit (at 168
  // registers a thread, one block a multiprocessor), else one; the backward
  // (K = 3S, three times the forward's product) on four where a block has
  // at most two tiles (clusters of 8 at S = 128). Four against two (H100,
  // T1024, us a backward step, S = 128): B8 2.11 against 2.29, B64 2.57
  // against 2.70; the forward the same or slower (B8 1.54 against 1.47).
  // LLTM_OP_SEQUENCE_FMA_SPLIT=2 or =1 asks for at most that many (tests,
  // benchmarks).
  const int64_t want_split = env_int("LLTM_OP_SEQUENCE_FMA_SPLIT", 0);
  for (int split : {4, 2, 1}) {
    if (want_split != 0 && split > want_split) continue;
    if (split == 4 && (forward || warps * 4 > tc::kLocalClusterMaxWarps)) continue;
    if (split > 1 && (C == 1 || tc::fma_small_k(d.S))) continue;
    const size_t smem = tc::local_fma_smem(d.S, C, forward, split);
    if (smem > static_cast<size_t>(optin)) continue;
    auto fits = [&](auto whole, auto packed) {
      return resident_local_launch(whole, packed, C, gy, 32 * warps * split, smem, split, optin,
                                   sms);
    };
    with_fma_variant(C > 1, tc::fma_small_k(d.S), split, [&](auto kc, auto ks, auto kp) {
      constexpr bool kCluster = decltype(kc)::value, kSmallK = decltype(ks)::value;
      constexpr int kSplit = decltype(kp)::value;
      if constexpr (kSplit == 4) {  // the backward's only
        launch = fits(tc::backward_fma_local_kernel<false, kCluster, kSmallK, kSplit>,
                      tc::backward_fma_local_kernel<true, kCluster, kSmallK, kSplit>);
      } else {
        launch = forward ? fits(tc::forward_fma_local_kernel<false, kCluster, kSmallK, kSplit>,
                                tc::forward_fma_local_kernel<true, kCluster, kSmallK, kSplit>)
                         : fits(tc::backward_fma_local_kernel<false, kCluster, kSmallK, kSplit>,
                                tc::backward_fma_local_kernel<true, kCluster, kSmallK, kSplit>);
      }
    });
    if (launch.ok) {
      launch.fma = true;
      launch.rows = static_cast<int>(rows);
      if (!forward && C > 1 && !tc::fma_small_k(d.S)) {
        with_fma_variant(true, false, split, [&](auto, auto, auto kp) {
          constexpr int kSplit = decltype(kp)::value;
          use_partial_sums<float, true>(launch, rows, d.S, gy, optin, sms,
                                        tc::backward_fma_local_kernel<true, true, false, kSplit>);
        });
      }
      return launch;
    }
  }
  return launch;
}

TcPlan compute_fma_plan(const Dims& d, int device, bool local) {
  TcPlan plan;
  if (!local || d.S % 8 != 0 || d.S == 0 || d.B == 0 || d.S > tc::kFmaMaxS<true, false> ||
      d.B > (int64_t(1) << 24)) {
    return plan;
  }
  const int sms = opscommon::multiprocessor_count(device);
  const int optin = opscommon::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
  plan.local_forward = compute_fma_local_launch(d, device, sms, optin, true);
  plan.local_backward = compute_fma_local_launch(d, device, sms, optin, false);
  plan.ok = plan.local_forward.ok && plan.local_backward.ok;
  return plan;
}

template <typename T>
TcPlan compute_tc_plan(const Dims& d, int device, bool local, int64_t shape, bool spread,
                       bool wgmma, bool ksplit) {
  TcPlan best;
  if (d.S % 8 != 0 || d.S == 0 || d.B == 0 || d.S > (int64_t(1) << 16) ||
      d.B > (int64_t(1) << 24)) {
    return best;
  }
  if (opscommon::compute_capability_major(device) < 8) return best;
  const int sms = opscommon::multiprocessor_count(device);
  const int optin = opscommon::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
  if (local) {
    best.local_forward = compute_local_launch<T>(d, device, sms, optin, true);
    best.local_backward = compute_local_launch<T>(d, device, sms, optin, false);
  }
  // The 16-bit forward's product on wgmma (sm_90a; see best.wgmma below)
  // where a block has 4 or 8 row tiles.
  const bool wgmma_device =
      wgmma && sizeof(T) == 2 && opscommon::compute_capability_major(device) == 9 &&
      opscommon::device_attribute<cudaDevAttrComputeCapabilityMinor>(device) == 0;
  auto wgmma_shape = [&](int64_t bm) {
    const int tiles = tc::Split(bm).I;
    return wgmma_device && (tiles == 4 || tiles == 8) && tc::wgmma_whole_groups<T>(d.S, bm);
  };
  // The backward: most blocks, then tie_rank. The forward: most blocks,
  // then a shape whose product runs on wgmma and has no row tile past the
  // batch, then tie_rank. The two directions want different shapes at
  // some sizes. Measured (H200, T256, kernel time, us, forward / backward,
  // the 16-bit shapes of as many blocks, the rule's against one on
  // wgmma): bfloat16 B256 S512 1547 / 1642 against 1072 / 1568, B128 S768
  // 1735 / 1904 against 1521 / 3297, B256 S768 2038 / 2683 against 1824 /
  // 3370; B8 S1024 (one row block either way) 686 / 923 against 1341 / 1798
  // in 64-row blocks.
  std::tuple<int64_t, int> best_rank{0, 0};
  std::tuple<int64_t, bool, int> forward_rank{0, false, 0};
  // Only where the loaded code has wgmma: a build without sm_90a code runs
  // mma.sync in these shapes, not measured.
  const bool forward_wgmma = wgmma_device && wgmma_loaded();
  for (int q : {1, 2, 4}) {
    const int64_t gx = (d.S + 8 * q - 1) / (8 * q);
    if (gx * d.B * d.S * static_cast<int64_t>(sizeof(T)) > kTcMaxStateReread) continue;
    for (int64_t bm = 16; bm <= tc::kTcMaxRows; bm += 16) {
      if (shape != 0 && shape != 1000 * q + bm) continue;
      const int64_t gy = (d.B + bm - 1) / bm;
      const size_t sf = tc::forward_smem<T>(d.S, q, bm), sb = tc::backward_smem<T>(d.S, q, bm);
      if (sf > static_cast<size_t>(optin) || sb > static_cast<size_t>(optin)) continue;
      int per_sm = 0;
      with_q(q, [&](auto qc) {
        constexpr int Q = decltype(qc)::value;
        // The packed variants use as many registers or more: the plan holds
        // for both (and for the half-rows ones, see half_rows).
        per_sm = std::min({forward_tc_residency<T, Q, false>(sf, optin),
                           resident_blocks(tc::backward_tc_kernel<T, Q, false>, sb, optin),
                           resident_blocks(tc::backward_tc_kernel<T, Q, true>, sb, optin)});
        if constexpr (kHalfRowsKernels<T>) {
          per_sm = std::min(per_sm,
                            resident_blocks(tc::backward_tc_kernel<T, Q, false, true>, sb, optin));
        }
      });
      const int64_t blocks = gx * gy;
      if (gy > 65535 || blocks > static_cast<int64_t>(per_sm) * sms) continue;
      const dim3 grid(static_cast<unsigned int>(gx), static_cast<unsigned int>(gy));
      const int tie = tie_rank(q, bm, d.S);
      const std::tuple<int64_t, int> rank{blocks, tie};
      if (rank > best_rank) {
        best_rank = rank;
        best.global = true;
        best.q = q;
        best.bm = bm;
        best.grid = grid;
        best.smem_backward = sb;
      }
      const bool on_wgmma = forward_wgmma && wgmma_shape(bm) && gy * bm - d.B < 16;
      const std::tuple<int64_t, bool, int> f_rank{blocks, on_wgmma, tie};
      if (f_rank > forward_rank) {
        forward_rank = f_rank;
        best.forward_shape = {q, bm, grid};
        best.smem_forward = sf;
      }
    }
  }
  if (best.global) {
    best.cluster = compute_cluster_plan<T>(d.B, d.S, best.q, best.bm, device, optin);
    const TcPlan::Shape& fs = best.forward_shape;
    const size_t ss = tc::forward_smem_spread<T>(d.S, fs.q);
    if (spread && tc::Split(fs.bm).KS >= 4 && ss <= static_cast<size_t>(optin)) {
      int per_sm = 0;
      with_q(fs.q, [&](auto qc) {
        per_sm = forward_tc_residency<T, decltype(qc)::value, true>(ss, optin);
      });
      best.spread =
          static_cast<int64_t>(fs.grid.x) * fs.grid.y <= static_cast<int64_t>(per_sm) * sms;
      best.smem_forward_spread = ss;
    }
    best.wgmma = !best.spread && wgmma_shape(fs.bm);
    if (ksplit && shape == 0) best.ksplit = compute_ksplit_plan<T>(d.B, d.S, device, optin);
  }
  best.ok = best.global || (best.local_forward.ok && best.local_backward.ok);
  return best;
}

// The plan of (device, dtype, B, S), remembered for the last kPlansKept
// asked (a call asks several times: fused(), the partial sums, each
// launch; a model runs several sizes in turn: two layers, a last smaller
// batch). Computing one queries the occupancy of a dozen kernel variants:
// about 0.3 ms of host time a call where a single remembered plan flipped
// between two sizes (or LLTM_OP_SEQUENCE_LOCAL settings) on every call.
constexpr size_t kPlansKept = 16;
// The plan remembered under `key` (most recently used first), made by
// `compute` where there is none: one list a thread per call site.
template <typename Plan, typename Key, typename Compute>
Plan remembered(const Key& key, Compute compute) {
  thread_local std::vector<std::pair<Key, Plan>> plans;
  auto hit =
      std::find_if(plans.begin(), plans.end(), [&](const auto& e) { return e.first == key; });
  if (hit == plans.end()) {
    const Plan plan = compute();
    if (plans.size() == kPlansKept) plans.pop_back();
    plans.insert(plans.begin(), {key, plan});
  } else if (hit != plans.begin()) {
    std::rotate(plans.begin(), hit, hit + 1);
  }
  return plans.front().second;
}

TcPlan tc_plan(const Tensor& like, const Dims& d) {
  using ST = torch::headeronly::ScalarType;
  const ST st = like.scalar_type();
  if (st != ST::Half && st != ST::BFloat16 && st != ST::Float) return {};
  // float32 without TF32: the block-local kernels' FMA variant only.
  const bool fma = st == ST::Float && !d.tf32;
  if (env_int("LLTM_OP_SEQUENCE_TENSOR_CORES", 1) == 0 ||
      env_int("LLTM_OP_SEQUENCE_FUSED", -1) == 0 ||
      env_int("LLTM_OP_SEQUENCE_PERSISTENT", 1) == 0) {
    return {};
  }
  const int device = like.get_device();
  // LLTM_OP_SEQUENCE_LOCAL=0: the global-barrier kernels where the
  // block-local ones would run.
  const bool local = env_int("LLTM_OP_SEQUENCE_LOCAL", 1) != 0;
  const int64_t cluster = env_int("LLTM_OP_SEQUENCE_LOCAL_CLUSTER", 0);
  const int64_t split = env_int("LLTM_OP_SEQUENCE_LOCAL_SPLIT", 0);
  const int64_t rows = env_int("LLTM_OP_SEQUENCE_LOCAL_ROWS", 0);
  const int64_t fma_split = env_int("LLTM_OP_SEQUENCE_FMA_SPLIT", 0);
  const int64_t shape = env_int("LLTM_OP_SEQUENCE_TC_SHAPE", 0);
  const bool spread = env_int("LLTM_OP_SEQUENCE_SPREAD_CELLS", 1) != 0;
  const bool wgmma = env_int("LLTM_OP_SEQUENCE_WGMMA", 1) != 0;
  const bool ksplit = env_int("LLTM_OP_SEQUENCE_KSPLIT", 1) != 0;
  const bool partial = env_int("LLTM_OP_SEQUENCE_PARTIAL", 1) != 0;
  struct Key {
    int device;
    ST st;
    int64_t B, S;
    bool local;
    int64_t cluster, split, rows, fma_split, shape;
    bool fma, spread, wgmma, ksplit, partial;
    bool operator==(const Key& o) const {
      return device == o.device && st == o.st && B == o.B && S == o.S && local == o.local &&
             cluster == o.cluster && split == o.split && rows == o.rows &&
             fma_split == o.fma_split && shape == o.shape && fma == o.fma && spread == o.spread &&
             wgmma == o.wgmma && ksplit == o.ksplit && partial == o.partial;
    }
  };
  return remembered<TcPlan>(
      Key{device, st, d.B, d.S, local, cluster, split, rows, fma_split, shape, fma, spread, wgmma,
          ksplit, partial},
      [&] {
        return fma              ? compute_fma_plan(d, device, local)
               : st == ST::Half ? compute_tc_plan<opscommon::Half>(d, device, local, shape, spread,
                                                                   wgmma, ksplit)
               : st == ST::BFloat16
                   ? compute_tc_plan<opscommon::BFloat16>(d, device, local, shape, spread, wgmma,
                                                          ksplit)
                   : compute_tc_plan<float>(d, device, local, shape, spread, wgmma, ksplit);
      });
}

// -- the resident-weight kernels' plan (lltm_sequence_resident.cuh) --------------

// One direction's launch: NJ columns and bm = 8 RT row_warps rows a block,
// grid (ceil(S / NJ), ceil(B / bm)), smem bytes a block.
struct ResidentLaunch {
  bool ok = false;
  int nj = 0, rt = 0, row_warps = 0;
  dim3 grid;
  size_t smem = 0;
};
struct ResidentPlan {
  ResidentLaunch forward, backward;
  bool ok() const { return forward.ok && backward.ok; }
};

// f(NJ, RT) as compile-time constants: NJ in {4, 8}, RT in {1, 4}.
template <typename F>
void with_resident(int nj, int rt, F&& f) {
  auto rows = [&](auto njc) {
    if (rt == 1) {
      f(njc, std::integral_constant<int, 1>{});
    } else {
      f(njc, std::integral_constant<int, 4>{});
    }
  };
  if (nj == 4) {
    rows(std::integral_constant<int, 4>{});
  } else {
    rows(std::integral_constant<int, 8>{});
  }
}

// Among the block shapes whose blocks all fit on the GPU at once, the one
// with the least estimated step time (clocks): the busiest multiprocessor's
// issue slots (an FMA per row and weight column and k, a shared-memory load
// per 4 weight columns and k and RT rows, four warps issuing a clock) or
// the state its blocks re-read through L2 (each column block reads its
// rows' whole state every step; about 3000 bytes a clock on an H100),
// whichever is longer. `want` (resident_plan's
// LLTM_OP_SEQUENCE_RESIDENT_SHAPE=100 NJ + 10 RT + row_warps, or 0) asks
// for one shape (tests, benchmarks).
ResidentLaunch compute_resident_launch(int64_t B, int64_t S, int device, bool forward,
                                       int64_t want) {
  ResidentLaunch best;
  const int sms = opscommon::multiprocessor_count(device);
  const int optin = opscommon::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
  const int64_t K = forward ? S : 3 * S;
  double best_cost = 0.0;
  for (int nj : {4, 8}) {
    for (int rt : {1, 4}) {
      for (int rw : {1, 2, 4, 8}) {
        const int64_t bm = resident::block_rows(rt, rw);
        if (want != 0 ? want != nj * 100 + rt * 10 + rw : bm >= 2 * B && bm > 8) continue;
        const int64_t gx = (S + nj - 1) / nj, gy = (B + bm - 1) / bm;
        if (gy > 65535) continue;
        const size_t smem = resident::smem_bytes(forward, S, nj, rt, rw);
        if (smem > static_cast<size_t>(optin)) continue;
        int per_sm = 0;
        with_resident(nj, rt, [&](auto njc, auto rtc) {
          constexpr int NJ = decltype(njc)::value, RT = decltype(rtc)::value;
          per_sm = forward
                       ? std::min(resident_blocks(resident::forward_resident_kernel<NJ, RT, false>,
                                                  smem, optin, resident::kThreads),
                                  resident_blocks(resident::forward_resident_kernel<NJ, RT, true>,
                                                  smem, optin, resident::kThreads))
                       : std::min(resident_blocks(resident::backward_resident_kernel<NJ, RT, false>,
                                                  smem, optin, resident::kThreads),
                                  resident_blocks(resident::backward_resident_kernel<NJ, RT, true>,
                                                  smem, optin, resident::kThreads));
        });
        const int64_t blocks = gx * gy;
        if (blocks > static_cast<int64_t>(per_sm) * sms) continue;
        const int64_t W = forward ? 3 * nj : nj;
        const double per_sm_blocks = static_cast<double>((blocks + sms - 1) / sms);
        const double issue = per_sm_blocks * rw * W * K / 16.0 * (rt + 1);
        const double reread = static_cast<double>(blocks) * bm * K * 4 / 3000.0;
        const double cost = std::max(issue, reread);
        if (!best.ok || cost < best_cost) {
          best_cost = cost;
          best.ok = true;
          best.nj = nj;
          best.rt = rt;
          best.row_warps = rw;
          best.grid = dim3(static_cast<unsigned int>(gx), static_cast<unsigned int>(gy));
          best.smem = smem;
        }
      }
    }
  }
  return best;
}

// The sizes the resident kernels take by default: at most kFusedMaxMacs
// multiply-adds a step (B 3S S, where the fused kernels ran before them);
// past it, in full float32 where the batch is narrow against the state,
// B S^2 <= 2^25 with 4B <= S, and for an inference run (the forward alone)
// up to 2^26 with 16B <= S. There they beat a cuBLAS product a step (H100,
// full float32, ms, against LLTM_OP_SEQUENCE_RESIDENT=0): forward+backward
// B32 S1024 T64 3.61 against 4.74, T256 12.55 against 13.86; B128 S512 T64
// 3.50 against 4.38; inference B64 S1024 T64 2.10 against 2.31, T1024 29.4
// against 30.8. Elsewhere cuBLAS won or tied: forward+backward B64 S1024
// T1024 76.0 against 89.8, B2048 S128 T256 14.4 against 16.4, B512 S256
// T256 13.6 against 13.8; inference B256 S512 T256 7.9 against 8.4.
bool resident_size(const Dims& d) {
  const int64_t bss = d.B * d.S * d.S;  // S <= 2^14, B <= 2^24: no overflow
  if (3 * bss <= kFusedMaxMacs) return true;
  // Measured in full float32 only: a call on TF32 (S off the tensor-core
  // kernels' multiple of 8) keeps its cuBLAS TF32 products past the bound.
  if (d.tf32) return false;
  if (bss <= kResidentMaxBSS && 4 * d.B <= d.S) return true;
  return d.inference && bss <= 2 * kResidentMaxBSS && 16 * d.B <= d.S;
}

// The rule: float32 (full precision, or TF32 where the tensor-core path does
// not apply), S a multiple of 4, the sizes of resident_size, both
// directions' grids resident at once. LLTM_OP_SEQUENCE_RESIDENT=0 turns the
// path off; forcing the cuBLAS path or the per-step launches
// (LLTM_OP_SEQUENCE_FUSED=0, LLTM_OP_SEQUENCE_PERSISTENT=0) does too.
// Remembered per (device, B, S) as the tensor-core plans are.
ResidentPlan resident_plan(const Tensor& like, const Dims& d) {
  if (like.scalar_type() != torch::headeronly::ScalarType::Float) return {};
  if (d.S % 4 != 0 || d.S == 0 || d.B == 0 || d.S > (int64_t(1) << 14) ||
      d.B > (int64_t(1) << 24)) {
    return {};
  }
  const int64_t force = env_int("LLTM_OP_SEQUENCE_RESIDENT", -1);
  if (force == 0 || env_int("LLTM_OP_SEQUENCE_FUSED", -1) == 0 ||
      env_int("LLTM_OP_SEQUENCE_PERSISTENT", 1) == 0) {
    return {};
  }
  // LLTM_OP_SEQUENCE_RESIDENT=1 lifts the size rule.
  if (force < 0 && !resident_size(d)) return {};
  const int device = like.get_device();
  const int64_t shape = env_int("LLTM_OP_SEQUENCE_RESIDENT_SHAPE", 0);
  struct Key {
    int device;
    int64_t B, S, shape;
    bool operator==(const Key& o) const {
      return device == o.device && B == o.B && S == o.S && shape == o.shape;
    }
  };
  return remembered<ResidentPlan>(Key{device, d.B, d.S, shape}, [&] {
    return ResidentPlan{compute_resident_launch(d.B, d.S, device, true, shape),
                        compute_resident_launch(d.B, d.S, device, false, shape)};
  });
}

// Whether a cuBLAS-path float32 step's cells run forward_cell_vec_kernel: a
// product in parts (with the product added into the gates instead, float32
// TF32 B256 S1024 inference took 5% longer on it), S and the parts' stride
// whole vectors of 4, every pointer 16-byte aligned.
// LLTM_OP_SEQUENCE_CELL_VEC=0 keeps forward_cell_kernel (A/B).
inline bool forward_cell_vectorizes(const ForwardStep& s) {
  if (s.rec == nullptr || s.rec_splits < 2 || s.S % 4 != 0 || s.rec_stride % 4 != 0) return false;
  for (const void* p : {s.rec, static_cast<const void*>(s.gates), s.bias, s.c_prev,
                        static_cast<const void*>(s.h), static_cast<const void*>(s.c)}) {
    if (!opscommon::is_aligned(p)) return false;
  }
  if (s.h_n != nullptr && !(opscommon::is_aligned(s.h_n) && opscommon::is_aligned(s.c_n))) {
    return false;
  }
  return env_int("LLTM_OP_SEQUENCE_CELL_VEC", 1) != 0;
}

struct CudaDev {
  static bool fused(const Tensor& like, const Dims& d) {
    if (tc_plan(like, d).ok || resident_plan(like, d).ok()) return true;
    // The fused kernels' grid: ceil(S / 32) x ceil(B / 4) blocks.
    const bool possible = d.B <= int64_t(kRows) * 65535 && d.S <= (int64_t(1) << 36);
    const int64_t force = env_int("LLTM_OP_SEQUENCE_FUSED", -1);
    if (force == 0) return false;
    if (force > 0) return possible;
    // B * 3S * S without overflow: S is at most 2^31 here when it matters.
    if (d.S > (int64_t(1) << 20) || d.B > (int64_t(1) << 20)) return false;
    return possible && d.B * 3 * d.S * d.S <= kFusedMaxMacs;
  }

  // The persistent kernels run when the grid, with `stage` bytes of shared
  // memory a block, fits in one wave (see above) and the stage in the
  // default 48 KB; LLTM_OP_SEQUENCE_PERSISTENT=0 launches the steps one by
  // one instead.
  template <typename Kernel>
  static bool fits_one_wave(Kernel kernel, const dim3& grid, size_t stage, int device) {
    if (env_int("LLTM_OP_SEQUENCE_PERSISTENT", 1) == 0 || stage > kMaxStageBytes) return false;
    int per_sm = 0;
    OPSCOMMON_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kWarps, stage));
    return static_cast<int64_t>(grid.x) * grid.y <=
           static_cast<int64_t>(per_sm) * opscommon::multiprocessor_count(device);
  }

  // One zeroed arrival counter per block row (stream-ordered, capturable).
  static Tensor arrival_counters(const Tensor& like, int64_t rows) {
    Tensor t = empty_contiguous(kSeqForward, "the step barrier's counters", like, {rows},
                                aoti_torch_dtype_int64());
    zero(t);
    return t;
  }

  // A packed run's batch sizes (host, [T]) in device memory for the
  // persistent kernels: staged in pinned memory and copied without waiting
  // for the stream (torch keeps the pinned block until the copy is done).
  static std::optional<Tensor> device_sizes(const Tensor& like, const char* op,
                                            const int64_t* sizes, int64_t T) {
    if (sizes == nullptr) return std::nullopt;
    const std::vector<int64_t> shape{T};
    Tensor host = torch::stable::empty(shape, torch::headeronly::ScalarType::Long, std::nullopt,
                                       std::nullopt, /*pin_memory=*/true);
    std::memcpy(host.mutable_data_ptr(), sizes, static_cast<size_t>(T) * sizeof(int64_t));
    Tensor dev = empty_contiguous(op, "the batch sizes", like, shape, aoti_torch_dtype_int64());
    torch::stable::copy_(dev, host, /*non_blocking=*/true);
    return dev;
  }
  static const int64_t* ptr_of(const std::optional<Tensor>& t) {
    return t ? t->const_data_ptr<int64_t>() : nullptr;
  }
  static unsigned long long* counters_of(Tensor& arrivals) {
    return static_cast<unsigned long long*>(arrivals.mutable_data_ptr());
  }

  // What the tensor-core and resident launches of a call share: the
  // stream, the shared memory a block may opt in to, and a packed run's
  // batch sizes on the device (`sizes()`, null for a whole batch).
  struct StepLaunch {
    cudaStream_t stream;
    int optin;
    std::optional<Tensor> bs;
    StepLaunch(const Tensor& like, const char* op, const int64_t* batch_sizes, int64_t T)
        : stream(opscommon::current_stream(like.get_device())),
          optin(opscommon::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(
              like.get_device())),
          bs(device_sizes(like, op, batch_sizes, T)) {}
    const int64_t* sizes() const { return ptr_of(bs); }
    // kernel<<<grid, threads, smem>>>(args...) on the stream, the opt-in
    // shared memory allowed first.
    template <typename Kernel, typename... Args>
    void launch(Kernel kernel, dim3 grid, int threads, size_t smem, Args... args) const {
      allow_optin(kernel);
      kernel<<<grid, threads, smem, stream>>>(args...);
      OPSCOMMON_CUDA_CHECK_LAUNCH();
    }
    // The same in clusters of grid.x blocks (sm_90).
    template <typename Kernel, typename... Args>
    void launch_clusters(Kernel kernel, dim3 grid, int threads, size_t smem, Args... args) const {
      launch_clusters_of(grid.x, kernel, grid, threads, smem, args...);
    }
    // The same in clusters of cluster_x blocks along x.
    template <typename Kernel, typename... Args>
    void launch_clusters_of(unsigned int cluster_x, Kernel kernel, dim3 grid, int threads,
                            size_t smem, Args... args) const {
      allow_optin(kernel);
      set_attribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      cudaLaunchAttribute attr;
      const cudaLaunchConfig_t cfg =
          cluster_config(kernel, grid, smem, stream, &attr, threads, cluster_x);
      OPSCOMMON_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
    }
    template <typename Kernel>
    void allow_optin(Kernel kernel) const {
      set_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    }
  };

  static dim3 fused_grid(int64_t B, int64_t S) {
    return dim3(grid_dim((S + 31) / 32, "the state size"),
                grid_dim(fused_block_rows(B), "the batch"));
  }

  // A block-local kernel's launch: clusters of l.grid.x blocks where that is
  // more than one.
  template <typename Kernel, typename... Args>
  static void launch_local(Kernel kernel, const LocalLaunch& l, const StepLaunch& s, Args... args) {
    if (l.grid.x == 1) {
      s.launch(kernel, l.grid, l.threads, l.smem, args...);
    } else {
      s.launch_clusters(kernel, l.grid, l.threads, l.smem, args...);
    }
  }

  static bool forward_steps_local(const Tensor& like, const ForwardSteps& a, const TcPlan& p) {
    const StepLaunch s(like, kSeqForward, a.batch_sizes, a.T);
    const ForwardStep& f = a.first;
    opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, double>) {
        constexpr int Q = tc::kLocalQ;
        const LocalLaunch& l = p.local_forward;
        auto run = [&](auto kernel) {
          launch_local(kernel, l, s, a.T, a.B, a.S, static_cast<T*>(f.gates),
                       static_cast<const T*>(f.bias), static_cast<const T*>(f.h_prev),
                       static_cast<const T*>(a.w_h), a.w_ld, static_cast<const T*>(f.c_prev),
                       static_cast<T*>(f.h), static_cast<T*>(f.c), a.inference,
                       static_cast<T*>(a.h_n), static_cast<T*>(a.c_n), s.sizes());
        };
        const bool packed = a.batch_sizes != nullptr;
        if constexpr (std::is_same_v<T, float>) {
          if (l.fma) {
            with_local_variant(
                l.grid.x > 1, tc::fma_small_k(a.S), l.split, [&](auto kc, auto ks, auto kp) {
                  constexpr bool kCluster = decltype(kc)::value, kSmallK = decltype(ks)::value;
                  constexpr int kSplit = decltype(kp)::value;
                  run(packed ? tc::forward_fma_local_kernel<true, kCluster, kSmallK, kSplit>
                             : tc::forward_fma_local_kernel<false, kCluster, kSmallK, kSplit>);
                });
            return;
          }
        }
        with_local_variant(
            l.grid.x > 1, tc::local_small_k<T>(a.S, true), l.split, [&](auto kc, auto ks, auto kp) {
              constexpr bool kCluster = decltype(kc)::value, kSmallK = decltype(ks)::value;
              constexpr int kSplit = decltype(kp)::value;
              with_local_rows<kCluster>(l.rows, [&](auto kr) {
                constexpr int kRows = decltype(kr)::value;
                run(packed
                        ? tc::forward_tc_local_kernel<T, Q, true, kCluster, kSmallK, kRows, kSplit>
                        : tc::forward_tc_local_kernel<T, Q, false, kCluster, kSmallK, kRows,
                                                      kSplit>);
              });
            });
      }
    });
    return true;
  }

  static bool backward_steps_local(const Tensor& like, const BackwardSteps& a, const TcPlan& p) {
    const StepLaunch s(like, kSeqBackward, a.batch_sizes, a.T);
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, double>) {
        constexpr int Q = tc::kLocalQ;
        const LocalLaunch& l = p.local_backward;
        auto run = [&](auto kernel) {
          launch_local(kernel, l, s, a.T, a.t0, a.t1, a.K, a.B, a.S,
                       static_cast<const T*>(a.grad_outputs), static_cast<const T*>(a.grad_h_n),
                       static_cast<const T*>(a.grad_c_n), static_cast<T*>(a.dG),
                       static_cast<const T*>(a.w_h), a.w_ld, static_cast<T*>(a.dc),
                       static_cast<const T*>(a.gates), static_cast<const T*>(a.cells),
                       static_cast<const T*>(a.c0), static_cast<float*>(a.bias_partial), s.sizes());
        };
        const bool packed = a.batch_sizes != nullptr;
        if (!packed && l.partial.kb > 0) {
          auto run_partial = [&](auto fma) {
            constexpr bool kFma = decltype(fma)::value;
            with_partial_shape<T, kFma>(l.partial, [&](auto kb, auto nto) {
              run(partial_kernel<T, kFma, decltype(kb)::value, decltype(nto)::value>());
            });
          };
          if constexpr (std::is_same_v<T, float>) {
            if (l.fma) {
              run_partial(std::true_type{});
              return;
            }
          }
          run_partial(std::false_type{});
          return;
        }
        if constexpr (std::is_same_v<T, float>) {
          if (l.fma) {
            with_fma_variant(
                l.grid.x > 1, tc::fma_small_k(a.S), l.split, [&](auto kc, auto ks, auto kp) {
                  constexpr bool kCluster = decltype(kc)::value, kSmallK = decltype(ks)::value;
                  constexpr int kSplit = decltype(kp)::value;
                  run(packed ? tc::backward_fma_local_kernel<true, kCluster, kSmallK, kSplit>
                             : tc::backward_fma_local_kernel<false, kCluster, kSmallK, kSplit>);
                });
            return;
          }
        }
        with_local_variant(
            l.grid.x > 1, tc::local_small_k<T>(a.S, false), l.split, [&](auto kc, auto ks, auto) {
              constexpr bool kCluster = decltype(kc)::value, kSmallK = decltype(ks)::value;
              with_local_rows<kCluster>(l.rows, [&](auto kr) {
                constexpr int kRows = decltype(kr)::value;
                run(packed ? tc::backward_tc_local_kernel<T, Q, true, kCluster, kSmallK, kRows>
                           : tc::backward_tc_local_kernel<T, Q, false, kCluster, kSmallK, kRows>);
              });
            });
      }
    });
    return true;
  }

  // The forward's h0 for kernels that read it in 16-byte loads: a view
  // that does not start on such a boundary is copied (into `copy_of`).
  static const void* aligned_h0(const Tensor& like, const ForwardSteps& a,
                                std::optional<Tensor>& copy_of) {
    const void* h0 = a.first.h_prev;
    if (reinterpret_cast<uintptr_t>(h0) % 16 == 0) return h0;
    copy_of = empty_contiguous(kSeqForward, "an aligned copy of old_h", like, {a.B, a.S});
    copy(like, copy_of->mutable_data_ptr(), h0,
         a.B * a.S * static_cast<int64_t>(like.element_size()));
    return copy_of->const_data_ptr();
  }

  static bool forward_steps_tc(const Tensor& like, const ForwardSteps& a, const TcPlan& p) {
    if (p.local_forward.ok) return forward_steps_local(like, a, p);
    const StepLaunch s(like, kSeqForward, a.batch_sizes, a.T);
    const ForwardStep& f = a.first;
    std::optional<Tensor> h0_copy;
    const void* h0 = aligned_h0(like, a, h0_copy);
    // The cluster variant where LLTM_OP_SEQUENCE_CLUSTERS=1 asks for it
    // (opt-in: on an H200 it was 5-8% faster at T1024 S128 B8-64 but its
    // forward 15-30% slower at T64, the rest within noise).
    if (p.cluster.ok && env_int("LLTM_OP_SEQUENCE_CLUSTERS", 0) != 0) {
      const TcPlan::Cluster& c = p.cluster;
      opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (!std::is_same_v<T, double>) {
          with_q(c.q, [&](auto qc) {
            constexpr int Q = decltype(qc)::value;
            auto kernel = a.batch_sizes != nullptr ? tc::forward_tc_kernel<T, Q, true, true>
                                                   : tc::forward_tc_kernel<T, Q, false, true>;
            s.launch_clusters(
                kernel, c.grid, tc::kTcThreads, c.smem, a.T, a.B, a.S, c.bm,
                static_cast<T*>(f.gates), static_cast<const T*>(f.bias), static_cast<const T*>(h0),
                static_cast<const T*>(a.w_h), a.w_ld, static_cast<const T*>(f.c_prev),
                static_cast<T*>(f.h), static_cast<T*>(f.c), a.inference, static_cast<T*>(a.h_n),
                static_cast<T*>(a.c_n), s.sizes(), static_cast<unsigned long long*>(nullptr));
          });
        }
      });
      return true;
    }
    const TcPlan::Shape& fs = p.forward_shape;
    Tensor arrivals = arrival_counters(like, fs.grid.y);
    opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, double>) {
        with_q(fs.q, [&](auto qc) {
          constexpr int Q = decltype(qc)::value;
          const bool packed = a.batch_sizes != nullptr, half = half_rows<T>(a.B, packed);
          const auto kernel = p.spread ? forward_tc_variant<T, Q, true>(packed, half)
                                       : forward_tc_variant<T, Q, false>(packed, half, p.wgmma);
          const size_t smem = p.spread ? p.smem_forward_spread : p.smem_forward;
          s.launch(kernel, fs.grid, tc::kTcThreads, smem, a.T, a.B, a.S, fs.bm,
                   static_cast<T*>(f.gates), static_cast<const T*>(f.bias),
                   static_cast<const T*>(h0), static_cast<const T*>(a.w_h), a.w_ld,
                   static_cast<const T*>(f.c_prev), static_cast<T*>(f.h), static_cast<T*>(f.c),
                   a.inference, static_cast<T*>(a.h_n), static_cast<T*>(a.c_n), s.sizes(),
                   counters_of(arrivals));
        });
      }
    });
    return true;
  }

  static bool backward_steps_tc(const Tensor& like, const BackwardSteps& a, const TcPlan& p) {
    if (p.local_backward.ok) return backward_steps_local(like, a, p);
    if (p.ksplit.ok && a.batch_sizes == nullptr) return backward_steps_ksplit(like, a, p.ksplit);
    const StepLaunch s(like, kSeqBackward, a.batch_sizes, a.T);
    Tensor arrivals = arrival_counters(like, p.grid.y);
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, double>) {
        with_q(p.q, [&](auto qc) {
          constexpr int Q = decltype(qc)::value;
          auto kernel = a.batch_sizes != nullptr ? tc::backward_tc_kernel<T, Q, true>
                                                 : tc::backward_tc_kernel<T, Q, false>;
          if constexpr (kHalfRowsKernels<T>) {
            if (half_rows<T>(a.B, a.batch_sizes != nullptr)) {
              kernel = tc::backward_tc_kernel<T, Q, false, true>;
            }
          }
          s.launch(kernel, p.grid, tc::kTcThreads, p.smem_backward, a.T, a.t0, a.t1, a.K, a.B, a.S,
                   p.bm, static_cast<const T*>(a.grad_outputs), static_cast<const T*>(a.grad_h_n),
                   static_cast<const T*>(a.grad_c_n), static_cast<T*>(a.dG),
                   static_cast<const T*>(a.w_h), a.w_ld, static_cast<T*>(a.dc),
                   static_cast<const T*>(a.gates), static_cast<const T*>(a.cells),
                   static_cast<const T*>(a.c0), static_cast<float*>(a.bias_partial), s.sizes(),
                   counters_of(arrivals));
        });
      }
    });
    return true;
  }

  static bool backward_steps_ksplit(const Tensor& like, const BackwardSteps& a,
                                    const TcPlan::KSplit& k) {
    const StepLaunch s(like, kSeqBackward, nullptr, a.T);
    Tensor arrivals = arrival_counters(like, k.grid.y);
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (sizeof(T) == 2) {
        constexpr int P = tc::kKsParts;
        s.launch_clusters_of(P, tc::backward_ksplit_kernel<T, P>, k.grid, tc::kTcThreads, k.smem,
                             a.T, a.t0, a.t1, a.K, a.B, a.S, static_cast<const T*>(a.grad_outputs),
                             static_cast<const T*>(a.grad_h_n), static_cast<const T*>(a.grad_c_n),
                             static_cast<T*>(a.dG), static_cast<const T*>(a.w_h), a.w_ld,
                             static_cast<T*>(a.dc), static_cast<const T*>(a.gates),
                             static_cast<const T*>(a.cells), static_cast<const T*>(a.c0),
                             static_cast<float*>(a.bias_partial), counters_of(arrivals));
      }
    });
    return true;
  }

  static bool forward_steps_resident(const Tensor& like, const ForwardSteps& a,
                                     const ResidentLaunch& l) {
    const StepLaunch s(like, kSeqForward, a.batch_sizes, a.T);
    Tensor arrivals = arrival_counters(like, l.grid.y);
    const ForwardStep& f = a.first;
    std::optional<Tensor> h0_copy;
    const void* h0 = aligned_h0(like, a, h0_copy);
    with_resident(l.nj, l.rt, [&](auto njc, auto rtc) {
      constexpr int NJ = decltype(njc)::value, RT = decltype(rtc)::value;
      auto kernel = a.batch_sizes != nullptr ? resident::forward_resident_kernel<NJ, RT, true>
                                             : resident::forward_resident_kernel<NJ, RT, false>;
      s.launch(kernel, l.grid, resident::kThreads, l.smem, a.T, a.B, a.S, l.row_warps,
               static_cast<float*>(f.gates), static_cast<const float*>(f.bias),
               static_cast<const float*>(h0), static_cast<const float*>(a.w_h), a.w_ld,
               static_cast<const float*>(f.c_prev), static_cast<float*>(f.h),
               static_cast<float*>(f.c), a.inference, static_cast<float*>(a.h_n),
               static_cast<float*>(a.c_n), s.sizes(), counters_of(arrivals));
    });
    return true;
  }

  static bool backward_steps_resident(const Tensor& like, const BackwardSteps& a,
                                      const ResidentLaunch& l) {
    const StepLaunch s(like, kSeqBackward, a.batch_sizes, a.T);
    Tensor arrivals = arrival_counters(like, l.grid.y);
    with_resident(l.nj, l.rt, [&](auto njc, auto rtc) {
      constexpr int NJ = decltype(njc)::value, RT = decltype(rtc)::value;
      auto kernel = a.batch_sizes != nullptr ? resident::backward_resident_kernel<NJ, RT, true>
                                             : resident::backward_resident_kernel<NJ, RT, false>;
      s.launch(kernel, l.grid, resident::kThreads, l.smem, a.T, a.t0, a.t1, a.K, a.B, a.S,
               l.row_warps, static_cast<const float*>(a.grad_outputs),
               static_cast<const float*>(a.grad_h_n), static_cast<const float*>(a.grad_c_n),
               static_cast<float*>(a.dG), static_cast<const float*>(a.w_h), a.w_ld,
               static_cast<float*>(a.dc), static_cast<const float*>(a.gates),
               static_cast<const float*>(a.cells), static_cast<const float*>(a.c0),
               static_cast<float*>(a.bias_partial), s.sizes(), counters_of(arrivals));
    });
    return true;
  }

  // The tensor-core, block-local and resident kernels load W_h once and
  // read it in place; forward_steps runs them wherever their plan holds.
  static bool steps_read_weights(const Tensor& like, const Dims& d) {
    return tc_plan(like, d).ok || resident_plan(like, d).ok();
  }

  static bool forward_steps(const Tensor& like, const ForwardSteps& a) {
    Dims d{a.T, a.B, 0, a.S};
    d.tf32 = a.tf32;
    d.inference = a.inference;
    if (const TcPlan p = tc_plan(like, d); p.ok) return forward_steps_tc(like, a, p);
    if (const ResidentPlan p = resident_plan(like, d); p.ok()) {
      return forward_steps_resident(like, a, p.forward);
    }
    const int device = like.get_device();
    const dim3 grid = fused_grid(a.B, a.S);
    bool ran = false;
    opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
      using T = decltype(tag);
      const size_t stage = kRows * a.S * sizeof(T);
      auto kernel = a.batch_sizes != nullptr ? forward_persistent_kernel<T, true>
                                             : forward_persistent_kernel<T, false>;
      if (!fits_one_wave(kernel, grid, stage, device)) return;
      Tensor arrivals = arrival_counters(like, grid.y);
      const std::optional<Tensor> bs = device_sizes(like, kSeqForward, a.batch_sizes, a.T);
      const ForwardStep& f = a.first;
      kernel<<<grid, 32 * kWarps, stage, opscommon::current_stream(device)>>>(
          a.T, a.B, a.S, static_cast<T*>(f.gates), static_cast<const T*>(f.bias),
          static_cast<const T*>(f.h_prev), static_cast<const T*>(f.w_hT),
          static_cast<const T*>(f.c_prev), static_cast<T*>(f.h), static_cast<T*>(f.c), a.inference,
          static_cast<T*>(a.h_n), static_cast<T*>(a.c_n), ptr_of(bs), counters_of(arrivals));
      OPSCOMMON_CUDA_CHECK_LAUNCH();
      ran = true;
    });
    return ran;
  }

  static bool backward_steps(const Tensor& like, const BackwardSteps& a) {
    Dims d{a.T, a.B, 0, a.S};
    d.tf32 = a.tf32;
    if (const TcPlan p = tc_plan(like, d); p.ok) return backward_steps_tc(like, a, p);
    if (const ResidentPlan p = resident_plan(like, d); p.ok()) {
      return backward_steps_resident(like, a, p.backward);
    }
    const int device = like.get_device();
    const dim3 grid = fused_grid(a.B, a.S);
    bool ran = false;
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      const size_t stage = kRows * 3 * a.S * sizeof(T);
      auto kernel = a.batch_sizes != nullptr ? backward_persistent_kernel<T, true>
                                             : backward_persistent_kernel<T, false>;
      if (!fits_one_wave(kernel, grid, stage, device)) return;
      Tensor arrivals = arrival_counters(like, grid.y);
      const std::optional<Tensor> bs = device_sizes(like, kSeqBackward, a.batch_sizes, a.T);
      kernel<<<grid, 32 * kWarps, stage, opscommon::current_stream(device)>>>(
          a.T, a.t0, a.t1, a.K, a.B, a.S, static_cast<const T*>(a.grad_outputs),
          static_cast<const T*>(a.grad_h_n), static_cast<const T*>(a.grad_c_n),
          static_cast<T*>(a.dG), static_cast<const T*>(a.w_h), a.w_ld, static_cast<T*>(a.dc),
          static_cast<const T*>(a.gates), static_cast<const T*>(a.cells),
          static_cast<const T*>(a.c0), static_cast<Acc<T>*>(a.bias_partial), ptr_of(bs),
          counters_of(arrivals));
      OPSCOMMON_CUDA_CHECK_LAUNCH();
      ran = true;
    });
    return ran;
  }

  static void forward_step(const Tensor& like, const ForwardStep& s) {
    const int device = like.get_device();
    const cudaStream_t stream = opscommon::current_stream(device);
    opscommon::dispatch_floating(like.scalar_type(), kSeqForward, [&](auto tag) {
      using T = decltype(tag);
      if (s.rec == nullptr && !s.product_in_gates) {
        const dim3 grid(grid_dim((s.S + 31) / 32, "the state size"),
                        grid_dim(fused_block_rows(s.B), "the batch"));
        forward_fused_kernel<T><<<grid, 32 * kWarps, 0, stream>>>(
            s.B, s.S, static_cast<T*>(s.gates), static_cast<const T*>(s.bias),
            static_cast<const T*>(s.h_prev), static_cast<const T*>(s.w_hT),
            static_cast<const T*>(s.c_prev), static_cast<T*>(s.h), static_cast<T*>(s.c),
            static_cast<T*>(s.h_n), static_cast<T*>(s.c_n));
      } else if (std::is_same_v<T, float> && forward_cell_vectorizes(s)) {
        const dim3 grid(
            grid_dim((s.S / 4 + kCellVecThreads - 1) / kCellVecThreads, "the state size"),
            static_cast<unsigned int>(std::min<int64_t>(s.B, 65535)));
        with_bool(s.keep_gates, [&](auto keep) {
          launch_after_prior(
              forward_cell_vec_kernel<decltype(keep)::value>, grid, dim3(kCellVecThreads), stream,
              device, s.B, s.S, static_cast<float*>(s.gates), static_cast<const float*>(s.rec),
              s.rec_splits, s.rec_stride, static_cast<const float*>(s.bias),
              static_cast<const float*>(s.c_prev), static_cast<float*>(s.h),
              static_cast<float*>(s.c), static_cast<float*>(s.h_n), static_cast<float*>(s.c_n));
        });
      } else {
        const auto cfg = opscommon::launch_config(s.B * s.S, device, kThreads, opscommon::kNoSmCap);
        with_bool(s.keep_gates, [&](auto keep) {
          launch_after_prior(forward_cell_kernel<T, decltype(keep)::value>, dim3(cfg.blocks),
                             dim3(cfg.threads), stream, device, s.B, s.S, static_cast<T*>(s.gates),
                             static_cast<const T*>(s.rec), s.rec_splits, s.rec_stride,
                             static_cast<const T*>(s.bias), static_cast<const T*>(s.c_prev),
                             static_cast<T*>(s.h), static_cast<T*>(s.c), static_cast<T*>(s.h_n),
                             static_cast<T*>(s.c_n));
        });
      }
      OPSCOMMON_CUDA_CHECK_LAUNCH();
    });
  }

  // float32's step products on the cuBLAS path in parts of k (one batched
  // product of `splits` partial products, added up by the cell kernel:
  // parts_product below, else split_product's aten::bmm). cuBLAS's float32
  // kernels tile these few-row products coarsely and finish a split-K with a
  // reduction kernel of its own; the parts as a batch fill the GPU and leave
  // the sum to the cell, which reads the product anyway. Measured (H100, GPU
  // time a product, us, one aten::mm against the parts; CUDA graphs), full
  // float32: forward B64 S1024 17.9 against 14.7 (8 parts), B256 S512 17.5 /
  // 14.6 (4), B256 S1024 49.5 / 45.5 (2); backward B64 S1024 19.9 / 14.0 (8),
  // B256 S512 18.4 / 13.5 (8), B256 S1024 44.7 / 38.1 (8). Fewer parts than
  // those were no faster than aten::mm or slower (forward B64 S1024 in 2
  // parts: 21.5), so the rule takes the most parts with at least 128 k each
  // and at most kStepSplitBytes of partials, up to 8, and none where that many
  // do not fit the call's bound on them (step_partials_bound: the bytes
  // past one product; fewer parts there were no faster, measured at T64
  // B64 S1024 forward: 1.97-1.98 ms of GPU time with 1, 2, 4 or 8 parts). On
  // TF32 the same rule: only the backward's products reach it (the forward's
  // go to cuBLASLt, step_product), and at B256 S1024 (T64, profiler) its 8
  // parts took 13.2 us a product against 13.8 plus 3.3 of cuBLASLt's split-K
  // reduction. float16, bfloat16 and the fused paths have none.
  // LLTM_OP_SEQUENCE_STEP_SPLITS=s asks for s parts wherever they divide k
  // (tests, benchmarks; 1: none).
  static int64_t step_splits(const Tensor& like, int64_t M, int64_t N, int64_t K, int64_t bound) {
    if (like.scalar_type() != torch::headeronly::ScalarType::Float) return 1;
    const int64_t force = env_int("LLTM_OP_SEQUENCE_STEP_SPLITS", 0);
    if (force > 0) return force <= K && K % force == 0 ? force : 1;
    if (M * N * K <= kFusedMaxMacs) return 1;
    const int64_t product_bytes = M * N * static_cast<int64_t>(sizeof(float));
    for (int64_t s = 8; s > 1; s /= 2) {
      if (K % s != 0 || K / s < 128 || s * product_bytes > kStepSplitBytes) continue;
      return (s - 1) * product_bytes <= bound ? s : 1;
    }
    return 1;
  }

  // A row-major operand (row and column strides) as cuBLASLt's column-major
  // view of its transpose: its memory as is where its columns are
  // unit-stride (ld its row stride), else read transposed (ld its column
  // stride); false where neither stride is 1.
  static bool lt_operand(int64_t row, int64_t col, int32_t& trans, int64_t& ld) {
    if (col == 1) {
      trans = cublaslt::kOpN;
      ld = row;
    } else if (row == 1) {
      trans = cublaslt::kOpT;
      ld = col;
    } else {
      return false;
    }
    return true;
  }

  // float32's step products in parts of k (see step_splits) as one batched
  // cublasLtMatmul, its algorithm chosen once per shape, instead of an
  // aten::bmm over strided views, whose host time set these steps' pace.
  // Measured (H100, full float32): T256 B256 S512 forward with the GPU busy,
  // 19.8 against 29.6 us of host time a step; forward+backward, ms, T64 B64
  // S1024 5.76 against 6.19, T256 B256 S512 19.21 against 20.34. false
  // (aten::bmm) where cuBLASLt is not loaded, LLTM_OP_SEQUENCE_CUBLASLT or
  // LLTM_OP_SEQUENCE_CUBLASLT_PARTS (A/B) is 0, an operand has no unit stride
  // or no algorithm fits.
  static bool parts_product(const Tensor& like, const PartsProduct& p,
                            ProductWorkspace& workspace) {
    namespace lt = cublaslt;
    const int dtype = lt_dtype(like, p.tf32, true);
    if (dtype != lt::kR32F || env_int("LLTM_OP_SEQUENCE_CUBLASLT_PARTS", 1) == 0) return false;
    if (p.M * p.N * p.K == 0 || p.K % p.splits != 0) return false;
    const int64_t kc = p.K / p.splits, esize = static_cast<int64_t>(sizeof(float));
    // The alignment the parts share: the first's address and the stride's.
    auto align = [](const void* base, int64_t stride_bytes) {
      return std::min(lt::alignment(base),
                      lt::alignment(reinterpret_cast<const void*>(stride_bytes)));
    };
    // Column-major, each part's out^T (N x M, ld N) = b^T (N x kc) a^T (kc x
    // M), as product() below, each operand as lt_operand reads it.
    lt::Shape shape{dtype,
                    lt_compute(dtype, p.tf32),
                    static_cast<uint64_t>(p.N),
                    static_cast<uint64_t>(p.M),
                    static_cast<uint64_t>(kc),
                    0,
                    0,
                    p.N,
                    align(p.b.data, kc * p.b.row * esize),
                    align(p.a.data, kc * p.a.col * esize),
                    align(p.parts, p.part_stride * esize)};
    if (!lt_operand(p.b.row, p.b.col, shape.transa, shape.lda) ||
        !lt_operand(p.a.row, p.a.col, shape.transb, shape.ldb)) {
      return false;
    }
    shape.batch = static_cast<int32_t>(p.splits);
    shape.stride_a = kc * p.b.row;
    shape.stride_b = kc * p.a.col;
    shape.stride_c = p.part_stride;
    const int status = lt_matmul(like, p.op, shape, p.b.data, p.a.data, p.parts, false, workspace);
    if (status < 0) return false;
    OPSCOMMON_CHECK(status == 0, p.op, ": a step's recurrent product in ", p.splits,
                    " parts of k (cublasLtMatmul, ", p.M, " x ", p.K, " @ ", p.K, " x ", p.N,
                    ") failed with status ", status);
    return true;
  }

  // A forward step's product through cuBLASLt (see lltm_sequence_cublaslt.h),
  // added into the gates, where it runs on tensor cores (float16, bfloat16,
  // float32 on TF32), the library is loaded and an algorithm fits;
  // LLTM_OP_SEQUENCE_CUBLASLT=0 leaves every product to aten::mm (tests,
  // A/B). Measured (H100, T256, B256 S1024, float32 on TF32, us a step):
  // forward 26.1 against 32.9 (the host's time, not the GPU's: the cell no
  // longer reads a separate product). Not taken: full float32 and the
  // backward's products. A build that sent them to cuBLASLt measured the
  // same step times (B64 / B256 S1024: GPU-bound there); its first algorithm
  // runs them within 1-4% of aten::mm's kernels
  // (bench/results-h100/lltm_sequence_cublas_path_experiments.md).
  static bool step_product(const Tensor& like, const StepProduct& p, ProductWorkspace& workspace) {
    namespace lt = cublaslt;
    const int dtype = lt_dtype(like, p.tf32, false);
    if (p.rows * p.S == 0 || dtype < 0) return false;
    // Column-major, as cuBLASLt sees the row-major product: gates^T (3S x
    // rows) += (W_h^T, column-major S x 3S)^T (h^T, S x rows).
    const lt::Shape shape{dtype,
                          lt_compute(dtype, p.tf32),
                          static_cast<uint64_t>(3 * p.S),
                          static_cast<uint64_t>(p.rows),
                          static_cast<uint64_t>(p.S),
                          p.ldw,
                          p.S,
                          3 * p.S,
                          lt::alignment(p.w_h),
                          lt::alignment(p.h),
                          lt::alignment(p.gates)};
    const int status = lt_matmul(like, p.op, shape, p.w_h, p.h, p.gates, true, workspace);
    if (status < 0) return false;
    OPSCOMMON_CHECK(status == 0, p.op, ": a step's recurrent product (cublasLtMatmul, ", p.rows,
                    " x ", p.S, " @ ", p.S, " x ", 3 * p.S, ") failed with status ", status);
    return true;
  }

  // A chunk's large product (out = a @ b, or out += a @ b; 2-D, each
  // operand with a unit stride): the forward's input projection, the
  // backward's weight and input gradients, d_old_h. Through cuBLASLt where
  // it has at most kLtProductMaxMacs multiply-adds, where its host time is
  // most of what it costs: cublasLtMatmul with a remembered algorithm
  // issues in less host time than aten::mm, and adds into `out` itself (no
  // scratch product and add kernel). Full float32 too, in cuBLASLt's
  // float32 compute (no TF32): a two-chunk backward makes eight of these
  // products and three adds, about 0.2 ms of host time through aten::mm
  // (float32 TF32 against full float32 forward+backward, T64 B8 S128 on an
  // H100: 1.04 against 1.30 ms at 0.6.22, both host-bound). Larger
  // products, full float32's long-K ones past kLtFullF32LongKMaxMacs and
  // float64 stay with aten::mm, whose kernels this does not second-guess;
  // false means aten::mm. LLTM_OP_SEQUENCE_CUBLASLT=0 sends
  // them all there, LLTM_OP_SEQUENCE_CUBLASLT_CHUNKS=0 these alone (A/B).
  static bool product(const Tensor& like, const char* op, Tensor& out, const Tensor& a,
                      const Tensor& b, bool accumulate, bool tf32, ProductWorkspace& workspace) {
    namespace lt = cublaslt;
    const int dtype = lt_dtype(like, tf32, true);
    if (dtype < 0 || env_int("LLTM_OP_SEQUENCE_CUBLASLT_CHUNKS", 1) == 0) return false;
    const int64_t M = out.size(0), N = out.size(1), K = a.size(1);
    if (M * N * K == 0 || M * N * K > kLtProductMaxMacs || out.stride(1) != 1) return false;
    const bool full_f32 = dtype == lt::kR32F && !tf32;
    if (full_f32 && K > 2 * std::max(M, N) && M * N * K > kLtFullF32LongKMaxMacs) return false;
    // Column-major, out^T (N x M, ld out.stride(0)) = b^T (N x K) a^T (K x
    // M), each operand as lt_operand reads it.
    lt::Shape shape{dtype,
                    lt_compute(dtype, tf32),
                    static_cast<uint64_t>(N),
                    static_cast<uint64_t>(M),
                    static_cast<uint64_t>(K),
                    0,
                    0,
                    out.stride(0),
                    lt::alignment(b.const_data_ptr()),
                    lt::alignment(a.const_data_ptr()),
                    lt::alignment(out.const_data_ptr())};
    if (!lt_operand(b.stride(0), b.stride(1), shape.transa, shape.lda) ||
        !lt_operand(a.stride(0), a.stride(1), shape.transb, shape.ldb)) {
      return false;
    }
    // A column-major layout's ld is at least its rows (a size-1 dimension's
    // stride may be anything).
    const int64_t rows_a = shape.transa == lt::kOpT ? K : N;
    const int64_t rows_b = shape.transb == lt::kOpT ? M : K;
    if (shape.lda < rows_a || shape.ldb < rows_b || shape.ldc < N) return false;
    const int status = lt_matmul(like, op, shape, b.const_data_ptr(), a.const_data_ptr(),
                                 out.mutable_data_ptr(), accumulate, workspace);
    if (status < 0) return false;
    OPSCOMMON_CHECK(status == 0, op, ": the matrix product ", opscommon::shape_str(a), " @ ",
                    opscommon::shape_str(b), " (cublasLtMatmul) failed with status ", status);
    return true;
  }

  // cuBLASLt's data type for the call's products: float16, bfloat16,
  // float32 where the call allows TF32 or `full_f32` (full float32 taken
  // too); -1: aten::mm (also where cuBLASLt is not loaded, or
  // LLTM_OP_SEQUENCE_CUBLASLT=0). float32 is 0 (CUDA_R_32F).
  static int lt_dtype(const Tensor& like, bool tf32, bool full_f32) {
    using ST = torch::headeronly::ScalarType;
    namespace lt = cublaslt;
    if (lt::api() == nullptr || env_int("LLTM_OP_SEQUENCE_CUBLASLT", 1) == 0) return -1;
    const ST st = like.scalar_type();
    if (st == ST::Float && (tf32 || full_f32)) return lt::kR32F;
    if (st == ST::Half) return lt::kR16F;
    if (st == ST::BFloat16) return lt::kR16BF;
    return -1;
  }
  // float32 on TF32 only where the call allows it; CUBLAS_COMPUTE_32F is
  // float32 arithmetic (the 16-bit types accumulate in it).
  static int lt_compute(int dtype, bool tf32) {
    return dtype == cublaslt::kR32F && tf32 ? cublaslt::kCompute32FFastTf32 : cublaslt::kCompute32F;
  }

  // c = op(a) op(b), or c += op(a) op(b) (accumulate), as `shape` says, on
  // the current stream, with the algorithm remembered for the shape and
  // the workspace it needs (allocated once a call, grown where a later
  // shape needs more); cublasLtMatmul's status, or -1 where there is no
  // handle or algorithm (aten::mm then). The algorithm is chosen within
  // the call's workspace bound, rounded down to a power of two (a handful
  // of remembered plans a shape however many sequence lengths run).
  static int lt_matmul(const Tensor& like, const char* op, const cublaslt::Shape& shape,
                       const void* a, const void* b, void* c, bool accumulate,
                       ProductWorkspace& workspace) {
    namespace lt = cublaslt;
    const int device = like.get_device();
    const lt::Handle h = lt::handle(device);
    if (h == nullptr) return -1;
    // LLTM_OP_SEQUENCE_CUBLASLT_WORKSPACE=MiB caps it otherwise (tuning).
    const int64_t max_ws = env_int("LLTM_OP_SEQUENCE_CUBLASLT_WORKSPACE", -1);
    size_t most = max_ws >= 0 ? static_cast<size_t>(max_ws) << 20 : kCublasLtWorkspaceBytes;
    while (most > static_cast<size_t>(workspace.bound)) most /= 2;
    struct Key {
      int device;
      lt::Shape shape;
      size_t most;
      bool operator==(const Key& o) const {
        return device == o.device && shape == o.shape && most == o.most;
      }
    };
    const lt::Plan plan = remembered<lt::Plan>(Key{device, shape, most},
                                               [&] { return lt::make_plan(h, shape, most); });
    if (!plan.ok || plan.workspace > most) return -1;
    void* ws = nullptr;
    if (plan.workspace > 0) {
      const auto bytes = static_cast<int64_t>(plan.workspace);
      std::optional<Tensor>& t = workspace.tensor;
      if (!t || t->numel() < bytes) {
        t = empty_contiguous(op, "the cuBLASLt workspace", like, {bytes}, aoti_torch_dtype_uint8());
      }
      ws = t->mutable_data_ptr();
    }
    const float one = 1.0f, zero = 0.0f;  // alpha; beta
    return lt::api()->matmul(h, plan.desc.get(), &one, a, plan.a.get(), b, plan.b.get(),
                             accumulate ? &one : &zero, c, plan.c.get(), c, plan.c.get(),
                             &plan.algo, ws, plan.workspace, opscommon::current_stream(device));
  }

  static void backward_step(const Tensor& like, const BackwardStep& s, bool fused) {
    const int device = like.get_device();
    const cudaStream_t stream = opscommon::current_stream(device);
    opscommon::dispatch_floating(like.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      using A = Acc<T>;
      A* partial = static_cast<A*>(s.bias_partial);
      const unsigned int gx = grid_dim((s.S + 31) / 32, "the state size");
      if (fused) {
        const dim3 grid(gx, grid_dim(fused_block_rows(s.B), "the batch"));
        backward_fused_kernel<T><<<grid, 32 * kWarps, 0, stream>>>(
            s.B, s.S, static_cast<const T*>(s.grad_out), static_cast<const T*>(s.extra),
            static_cast<const T*>(s.dG_next), static_cast<const T*>(s.w_h), s.w_ld,
            static_cast<const T*>(s.dc_in), static_cast<const T*>(s.gates),
            static_cast<const T*>(s.c_prev), static_cast<T*>(s.d_gates), static_cast<T*>(s.dc_out),
            partial);
      } else {
        const dim3 grid(gx, static_cast<unsigned int>(backward_block_rows(s.B, s.S, device)));
        const T* other = static_cast<const T*>(s.rec != nullptr ? s.rec : s.extra);
        const int64_t splits = s.rec != nullptr ? s.rec_splits : 1;
        launch_after_prior(backward_cell_kernel<T>, grid, dim3(32, kBwdRows), stream, device, s.B,
                           s.S, static_cast<const T*>(s.grad_out), other, splits, s.rec_stride,
                           static_cast<const T*>(s.dc_in), static_cast<const T*>(s.gates),
                           static_cast<const T*>(s.c_prev), static_cast<T*>(s.d_gates),
                           static_cast<T*>(s.dc_out), partial);
      }
      OPSCOMMON_CUDA_CHECK_LAUNCH();
    });
  }

  static Tensor bias_partial(const Tensor& like, const Dims& d, bool fused) {
    const TcPlan tc = fused ? tc_plan(like, d) : TcPlan{};
    const int64_t rows = tc.ok   ? tc.backward_rows()
                         : fused ? fused_block_rows(d.B)
                                 : backward_block_rows(d.B, d.S, like.get_device());
    const int32_t acc_dtype = like.scalar_type() == torch::headeronly::ScalarType::Double
                                  ? aoti_torch_dtype_float64()
                                  : aoti_torch_dtype_float32();
    Tensor p = empty_contiguous(kSeqBackward, "the bias-gradient partial sums", like,
                                {rows, 3 * d.S}, acc_dtype);
    zero(p);
    return p;
  }

  static void bias_chunk(const Tensor&, Tensor&, const Tensor&) {}  // summed by the step kernels

  // The [cols, rows] transpose, contiguous, of the [rows, cols] matrix at t
  // (row stride ld, unit column stride): W_h^T for the fused kernels.
  static Tensor transposed(const char* op, const Tensor& t, int64_t rows, int64_t cols,
                           int64_t ld) {
    const int64_t gx = (cols + kTransposeTile - 1) / kTransposeTile;
    const int64_t gy = (rows + kTransposeTile - 1) / kTransposeTile;
    if (gy > 65535 || gx > 65535) {
      return torch::stable::contiguous(view_of(t, {cols, rows}, {1, ld}));
    }
    Tensor out = empty_contiguous(op, "the transposed recurrent weights", t, {cols, rows});
    if (rows * cols == 0) return out;
    const int device = t.get_device();
    const dim3 grid(static_cast<unsigned int>(gx), static_cast<unsigned int>(gy));
    const dim3 block(kTransposeTile, kTransposeRows);
    const cudaStream_t stream = opscommon::current_stream(device);
    auto run = [&](auto zero) {
      using U = decltype(zero);
      transpose_kernel<U><<<grid, block, 0, stream>>>(rows, cols, ld,
                                                      static_cast<const U*>(t.const_data_ptr()),
                                                      static_cast<U*>(out.mutable_data_ptr()));
    };
    switch (t.element_size()) {
      case 2:
        run(uint16_t{});
        break;
      case 4:
        run(uint32_t{});
        break;
      default:
        run(uint64_t{});
        break;
    }
    OPSCOMMON_CUDA_CHECK_LAUNCH();
    return out;
  }

  // Stream-ordered memset / copy (no dispatcher round trip; graph-capturable).
  static void zero(Tensor& t) {
    if (t.numel() == 0) return;
    const int device = t.get_device();
    OPSCOMMON_CUDA_CHECK(cudaMemsetAsync(t.mutable_data_ptr(), 0, t.numel() * t.element_size(),
                                         opscommon::current_stream(device)));
  }

  static void zero_bytes(const Tensor& like, void* dst, int64_t bytes) {
    if (bytes <= 0) return;
    const int device = like.get_device();
    OPSCOMMON_CUDA_CHECK(
        cudaMemsetAsync(dst, 0, static_cast<size_t>(bytes), opscommon::current_stream(device)));
  }
  static void copy(const Tensor& like, void* dst, const void* src, int64_t bytes) {
    if (bytes == 0) return;
    const int device = like.get_device();
    OPSCOMMON_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                         opscommon::current_stream(device)));
  }

  static void bias_finish(const Tensor& partial, Tensor& d_bias) {
    const int device = d_bias.get_device();
    const cudaStream_t stream = opscommon::current_stream(device);
    const int64_t cols = d_bias.numel();
    if (cols == 0) return;
    opscommon::dispatch_floating(d_bias.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      const auto cfg = opscommon::launch_config(cols, device, kThreads, opscommon::kNoSmCap);
      bias_finish_kernel<T><<<cfg.blocks, cfg.threads, 0, stream>>>(
          cols, partial.size(0), static_cast<const Acc<T>*>(partial.const_data_ptr()),
          d_bias.mutable_data_ptr<T>());
      OPSCOMMON_CUDA_CHECK_LAUNCH();
    });
  }

  static void add_into(Tensor& dst, const Tensor& src) {
    const int device = dst.get_device();
    const cudaStream_t stream = opscommon::current_stream(device);
    const int64_t rows = dst.size(0), cols = dst.size(1);
    if (rows * cols == 0) return;
    opscommon::dispatch_floating(dst.scalar_type(), kSeqBackward, [&](auto tag) {
      using T = decltype(tag);
      const auto cfg = opscommon::launch_config(rows * cols, device, kThreads, 8);
      add_into_kernel<T><<<cfg.blocks, cfg.threads, 0, stream>>>(
          rows, cols, dst.stride(0), dst.mutable_data_ptr<T>(), src.const_data_ptr<T>());
      OPSCOMMON_CUDA_CHECK_LAUNCH();
    });
  }

  // pad_columns_kernel over jobs[0 .. count) (most: the largest one's
  // elements), in one launch.
  static void pad_columns(const char* op, const Tensor& like, const PadJobs& jobs, int count,
                          int64_t most) {
    if (count == 0 || most == 0) return;
    const int device = like.get_device();
    const cudaStream_t stream = opscommon::current_stream(device);
    opscommon::dispatch_floating(like.scalar_type(), op, [&](auto tag) {
      using T = decltype(tag);
      const auto cfg = opscommon::launch_config(most, device, kThreads, 8);
      pad_columns_kernel<T>
          <<<dim3(cfg.blocks, static_cast<unsigned int>(count)), cfg.threads, 0, stream>>>(jobs);
      OPSCOMMON_CUDA_CHECK_LAUNCH();
    });
  }
};

}  // namespace

// -- state sizes that are not a multiple of 8 -------------------------------------------------
//
// The tensor-core kernels (path 1, and full float32's block-local FMA
// kernels) take S a multiple of 8. A call of another S runs them at Sp, the
// next multiple of 8, where they run at Sp (tc_plan) and the call is small
// (its padded outputs, gates and cells, 5 T B Sp elements, in kPadMaxBytes;
// past that paths 2 and 3 run it as they did, at no cost in memory): the
// padded columns of the weights, bias and initial state are zero, which
// keeps those columns of h and c zero at every step (their input and output
// gates are 0.5 and their candidate elu(0) = 0: c stays 0, h = 0.5 tanh(0)),
// W_h's padded rows multiply only those zeros and its padded columns are
// zero, and every gradient of a padded column is zero. The real columns get
// what the kernels compute at any size. Copies in and out are one launch
// each way for all of a call's tensors (ColumnResize), the padded inputs in
// one buffer. H200, float16 B3 S100 T128, wall time of a
// call against nn.LSTM: inference 1.48x before, forward+backward 1.05x (see
// the README). LLTM_OP_SEQUENCE_PAD=0 keeps such calls on paths 2 and 3.
constexpr double kPadMaxBytes = 16.0 * (1 << 20);

int64_t padded_state(const Tensor& like, const Dims& d) {
  if (d.S % 8 == 0 || d.T == 0 || d.B == 0 || d.S > (int64_t(1) << 16)) return 0;
  if (env_int("LLTM_OP_SEQUENCE_PAD", 1) == 0) return 0;
  Dims p = d;
  p.S = (d.S + 7) / 8 * 8;
  const double bytes = 5.0 * static_cast<double>(d.T) * static_cast<double>(d.B) *
                       static_cast<double>(p.S) * static_cast<double>(like.element_size());
  if (bytes > kPadMaxBytes) return 0;
  return tc_plan(like, p).ok ? p.S : 0;
}

// Tensors at the padded state size, or cut back from it, all copied in one
// launch: add each (state, weights), then run. `arena`: the padded call's
// inputs, views of one buffer (each 256-byte aligned); else each its own
// tensor (the op's results, which the caller may keep or change apart).
class ColumnResize {
 public:
  ColumnResize(const char* op, const Tensor& like, bool arena)
      : op_(op), like_(like), arena_(arena) {}

  // t (contiguous or not) with its last dimension, whole blocks of `from`
  // columns (the gates' three, or one), in blocks of `to` columns: zero
  // columns after each block's `from` (to > from) or its first `to` only
  // (to < from). Returns its index in run's tensors.
  int state(const char* what, const Tensor& t, int64_t from, int64_t to) {
    const Tensor src = dense(t);
    std::vector<int64_t> sizes(static_cast<size_t>(src.dim()));
    for (int64_t k = 0; k < src.dim(); ++k) sizes[k] = src.size(k);
    sizes.back() = sizes.back() / from * to;
    const int64_t rows = src.numel() / from;
    return add(what, src, std::move(sizes),
               {nullptr, nullptr, rows, to, 1, 1, 1, std::min(from, to), to - from, from});
  }
  // The weights [3 from, from + F] as [3 to, to + F].
  int weights(const char* what, const Tensor& t, int64_t from, int64_t to, int64_t F) {
    const int64_t live = std::min(from, to);
    return add(what, dense(t), {3 * to, to + F},
               {nullptr, nullptr, 3 * to, to + F, to, from, live, live, to - from, from + F});
  }

  // The tensors, in the order added, allocated and copied (once: it takes
  // the items' sizes).
  std::vector<Tensor> run() {
    std::vector<Tensor> out;
    out.reserve(items_.size());
    if (arena_) {
      const int64_t align = 256 / static_cast<int64_t>(like_.element_size());
      std::vector<int64_t> at;
      int64_t total = 0;
      for (const Item& it : items_) {
        at.push_back(total);
        total += (numel(it.sizes) + align - 1) / align * align;
      }
      const Tensor buffer =
          empty_contiguous(op_, "the inputs at a padded state size", like_, {total});
      for (size_t k = 0; k < items_.size(); ++k) {
        // Moved, not copied: a vector's copy would reference
        // std::__throw_bad_array_new_length (GLIBCXX_3.4.29, past the
        // manylinux_2_28 floor) with a newer libstdc++. An item's count
        // fits: it is part of the buffer just allocated.
        std::vector<int64_t> strides = *opscommon::contiguous_strides(items_[k].sizes);
        out.push_back(view_of(buffer, std::move(items_[k].sizes), std::move(strides), at[k]));
      }
    } else {
      for (const Item& it : items_) out.push_back(empty_contiguous(op_, it.what, like_, it.sizes));
    }
    PadJobs jobs{};
    int64_t most = 0;
    for (size_t k = 0; k < items_.size(); ++k) {
      PadJob j = items_[k].job;
      j.dst = out[k].mutable_data_ptr();
      j.src = items_[k].src.const_data_ptr();
      jobs.job[k] = j;
      most = std::max(most, j.rows * j.n_dst);
    }
    CudaDev::pad_columns(op_, like_, jobs, static_cast<int>(items_.size()), most);
    return out;
  }

 private:
  struct Item {
    const char* what;
    Tensor src;  // kept alive until the launch
    std::vector<int64_t> sizes;
    PadJob job;
  };
  int add(const char* what, Tensor src, std::vector<int64_t> sizes, const PadJob& job) {
    OPSCOMMON_CHECK(items_.size() < static_cast<size_t>(kMaxPadJobs), op_,
                    ": internal error: too many tensors to pad in one launch");
    items_.push_back({what, std::move(src), std::move(sizes), job});
    return static_cast<int>(items_.size()) - 1;
  }
  static int64_t numel(const std::vector<int64_t>& sizes) {
    int64_t n = 1;
    for (const int64_t v : sizes) n *= v;
    return n;
  }

  const char* op_;
  const Tensor& like_;
  bool arena_;
  std::vector<Item> items_;
};

// Whether old_h's state size (its columns) is one the kernels may run
// padded: only then do the entry points check the arguments for the padding
// rule (sequence_forward and sequence_backward check them again; a call at
// a multiple of 8 is checked once).
bool unaligned_state(const Tensor& old_h) { return old_h.dim() == 2 && old_h.size(1) % 8 != 0; }

// The forward (inference: without gates and cells) at the state size the
// kernels run: padded and cut back to S (padded_state), or as it is.
ForwardResult cuda_forward(const char* op, const Tensor& input, const Tensor& weights,
                           const Tensor& bias, const Tensor& old_h, const Tensor& old_cell,
                           bool allow_tf32, const std::optional<Tensor>& batch_sizes,
                           bool inference) {
  check_operand(op, "input", input);
  opscommon::DeviceGuard guard(input.get_device());
  int64_t Sp = 0;
  Dims d;
  if (unaligned_state(old_h)) {
    d = check_forward_args(op, input, weights, bias, old_h, old_cell);
    d.tf32 = allow_tf32;
    Sp = padded_state(input, d);
  }
  if (Sp == 0) {
    return sequence_forward<CudaDev>(input, weights, bias, old_h, old_cell, allow_tf32, batch_sizes,
                                     inference);
  }
  const int64_t S = d.S;
  ColumnResize in(op, input, /*arena=*/true);
  in.weights("weights", weights, S, Sp, d.F);
  in.state("bias", bias, S, Sp);
  in.state("old_h", old_h, S, Sp);
  in.state("old_cell", old_cell, S, Sp);
  const std::vector<Tensor> p = in.run();
  const ForwardResult r =
      sequence_forward<CudaDev>(input, p[0], p[1], p[2], p[3], allow_tf32, batch_sizes, inference);
  ColumnResize back(op, input, /*arena=*/false);
  back.state("outputs", r.outputs, Sp, S);
  back.state("h_n", r.h_n, Sp, S);
  back.state("c_n", r.c_n, Sp, S);
  if (!inference) {
    back.state("gates", r.gates, Sp, S);
    back.state("cells", r.cells, Sp, S);
  }
  const std::vector<Tensor> o = back.run();
  ForwardResult out;
  out.outputs = o[0];
  out.h_n = o[1];
  out.c_n = o[2];
  if (!inference) {
    out.gates = o[3];
    out.cells = o[4];
  }
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sequence_forward_cuda(
    Tensor input, Tensor weights, Tensor bias, Tensor old_h, Tensor old_cell, bool allow_tf32,
    std::optional<Tensor> batch_sizes) {
  ForwardResult r = cuda_forward(kSeqForward, input, weights, bias, old_h, old_cell, allow_tf32,
                                 batch_sizes, /*inference=*/false);
  return {r.outputs, r.h_n, r.c_n, r.gates, r.cells};
}

std::tuple<Tensor, Tensor, Tensor> sequence_inference_cuda(Tensor input, Tensor weights,
                                                           Tensor bias, Tensor old_h,
                                                           Tensor old_cell, bool allow_tf32,
                                                           std::optional<Tensor> batch_sizes) {
  ForwardResult r = cuda_forward(kSeqInference, input, weights, bias, old_h, old_cell, allow_tf32,
                                 batch_sizes, /*inference=*/true);
  return {r.outputs, r.h_n, r.c_n};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sequence_backward_cuda(
    std::optional<Tensor> grad_outputs, std::optional<Tensor> grad_h_n,
    std::optional<Tensor> grad_c_n, Tensor input, Tensor weights, Tensor old_h, Tensor old_cell,
    Tensor outputs, Tensor gates, Tensor cells, bool input_grad, bool allow_tf32,
    std::optional<Tensor> batch_sizes) {
  const char* op = kSeqBackward;
  check_operand(op, "input", input);
  opscommon::DeviceGuard guard(input.get_device());
  int64_t Sp = 0;
  Dims d;
  if (unaligned_state(old_h)) {
    d = check_backward_args(grad_outputs, grad_h_n, grad_c_n, input, weights, old_h, old_cell,
                            outputs, gates, cells);
    d.tf32 = allow_tf32;
    Sp = padded_state(input, d);
  }
  if (Sp != 0) {
    const int64_t S = d.S;
    ColumnResize in(op, input, /*arena=*/true);
    auto pad = [&](const std::optional<Tensor>& t, const char* what) {
      return t ? in.state(what, *t, S, Sp) : -1;
    };
    const int go = pad(grad_outputs, "grad_outputs"), ghn = pad(grad_h_n, "grad_h_n"),
              gcn = pad(grad_c_n, "grad_c_n");
    const int w = in.weights("weights", weights, S, Sp, d.F);  // and the five after it
    in.state("old_h", old_h, S, Sp);
    in.state("old_cell", old_cell, S, Sp);
    in.state("outputs", outputs, S, Sp);
    in.state("gates", gates, S, Sp);
    in.state("cells", cells, S, Sp);
    const std::vector<Tensor> p = in.run();
    auto padded = [&](int k) -> std::optional<Tensor> {
      if (k < 0) return std::nullopt;
      return p[k];
    };
    const BackwardResult r = sequence_backward<CudaDev>(
        padded(go), padded(ghn), padded(gcn), input, p[w], p[w + 1], p[w + 2], p[w + 3], p[w + 4],
        p[w + 5], input_grad, allow_tf32, batch_sizes);
    ColumnResize back(op, input, /*arena=*/false);
    back.weights("d_weights", r.d_weights, Sp, S, d.F);
    back.state("d_bias", r.d_bias, Sp, S);
    back.state("d_old_h", r.d_old_h, Sp, S);
    back.state("d_old_cell", r.d_old_cell, Sp, S);
    const std::vector<Tensor> o = back.run();
    return {r.d_input, o[0], o[1], o[2], o[3]};
  }
  BackwardResult r =
      sequence_backward<CudaDev>(grad_outputs, grad_h_n, grad_c_n, input, weights, old_h, old_cell,
                                 outputs, gates, cells, input_grad, allow_tf32, batch_sizes);
  return {r.d_input, r.d_weights, r.d_bias, r.d_old_h, r.d_old_cell};
}

}  // namespace seq
}  // namespace lltm_op

STABLE_TORCH_LIBRARY_IMPL(lltm_op, CUDA, m) {
  m.impl("sequence_forward", TORCH_BOX(&lltm_op::seq::sequence_forward_cuda));
  m.impl("sequence_inference", TORCH_BOX(&lltm_op::seq::sequence_inference_cuda));
  m.impl("sequence_backward", TORCH_BOX(&lltm_op::seq::sequence_backward_cuda));
}
