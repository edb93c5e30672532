// lltm_op: CUDA kernels of the fused LLTM cell (forward and backward).
//
// Inputs: P = [old_h, input] @ weights.t() ([B, 3S], from cuBLAS through
// torch), bias ([3S]) and old_cell ([B, S]); the gates are P + bias.
//
// Forward: one grid-stride loop with 64-bit indices over the B x S cell
// elements (the grid covers them: usually one iteration). In an iteration a
// thread handles VEC consecutive state columns j of one row r: it reads the
// three gate pre-activations (columns j, S+j, 2S+j of the row; the bias comes
// from cache), old_cell[r, j], computes in float (double for float64;
// float16/bfloat16 with the hardware exp2 and reciprocal, see FastMath in
// lltm.h, their values kept in pairs in 32-bit words, see Regs) and writes
// new_h and new_cell once. Neighbouring threads take neighbouring columns, so
// every access is coalesced; with VEC > 1 every access is one 16-byte vector.
//   bytes: reads P (3S) + old_cell (S), writes new_h (S) + new_cell (S).
//
// Backward: the same per-element work, but a thread keeps its VEC columns for
// all the rows it visits (blockIdx.y / threadIdx.y stride over rows), so it
// can also sum its dP values over those rows: d_bias = sum over the batch of
// dP comes out of the same pass (block partial sums in shared memory, one row
// of partials per blockIdx.y, added in a fixed order by a small second kernel
// that spreads each column over 32 warps and is launched as the first one's
// programmatic dependent on sm_90+: deterministic), and dP is never read
// back.
//   bytes: reads grad_h, grad_cell (S each; nothing when absent, one value
//   per row when expanded), P (3S), old_cell (S); writes dP (3S), d_old_cell
//   (S); plus 3S partials per blockIdx.y.
//
// Nothing is zero-filled; outputs are written exactly once.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>

#include "lltm.h"
#include "lltm_dependent_launch.cuh"
#include "opscommon/checks.h"
#include "opscommon/cuda.h"
#include "opscommon/dispatch.h"
#include "opscommon/vectorized.h"

namespace lltm_op {

using opscommon::AlignedVector;
using torch::stable::Tensor;

namespace {

constexpr unsigned int kThreads = 256;
// Backward: 8 blocks per SM in all (256 threads x 8 = 2048 threads per SM,
// Hopper's maximum), rows covered by the grid-stride loop, so that there are
// few rows of bias partial sums. With kBackwardMinBlocks resident that is two
// rounds of blocks, which measured faster for the half types than one round
// split evenly (the kernel: 68 vs 71 us at batch 4096, state 2048 on an
// H100): blocks finishing at different times keep the loads spread out.
constexpr int kBlocksPerSm = 8;
// Resident blocks per SM the kernels are compiled for, which caps their
// registers at 64 per thread: with more, the half-type kernels (8 values per
// 16-byte load in the forward, 3 x VEC running sums in the backward) leave
// too few warps to keep enough loads in flight. On an H200 this cut
// bfloat16 forward time by 11% and backward by 22% at batch 4096, state
// 2048, float32 unchanged (an H100 with the packed half vectors below: 3,
// 5 or 6 blocks no faster, 8 spilled). The backward's half types use 8-byte
// vectors (4 elements): 8 would spill.
constexpr int kForwardMinBlocks = 4;
constexpr int kBackwardMinBlocks = 4;
// A batch of at most this many rows per thread row runs in one block row,
// which writes d_bias itself: no partial sums, no second kernel (small,
// launch-bound steps).
constexpr int64_t kSingleBlockRowRows = 4;

template <typename T>
constexpr int forward_vec() {
  return opscommon::vec_size<T>();  // 16 bytes
}
template <typename T>
constexpr int backward_vec() {
  return sizeof(T) == 2 ? 4 : opscommon::vec_size<T>();
}
// Column vectors per backward block row: up to 32 (a warp's 32 vectors,
// 256 or 512 contiguous bytes per row). Narrower blocks take more rows each,
// so a wave of blocks has fewer rows of bias partial sums to write and add up:
// at batch 4096, state 2048 on an H100 the backward reached 0.844 / 0.850 /
// 0.867 of copy bandwidth (bfloat16 / float16 / float32) against 0.826 /
// 0.829 / 0.851 with 64; 16 and 8 were slower again.
constexpr unsigned int kMaxBlockColumns = 32;

// Storage <-> arithmetic type. float16 and bfloat16 go through the bits:
// Half's and BFloat16's own conversions take the address of their member,
// which makes ptxas stage the loaded vectors through local memory.
template <typename T>
__device__ __forceinline__ opscommon::acc_t<T> to_acc(T v) {
  return static_cast<opscommon::acc_t<T>>(v);
}
template <>
__device__ __forceinline__ float to_acc<opscommon::Half>(opscommon::Half v) {
  return __half2float(__ushort_as_half(v.x));
}
template <>
__device__ __forceinline__ float to_acc<opscommon::BFloat16>(opscommon::BFloat16 v) {
  return __uint_as_float(static_cast<unsigned int>(v.x) << 16);
}
template <typename T>
__device__ __forceinline__ T to_storage(opscommon::acc_t<T> v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ opscommon::Half to_storage<opscommon::Half>(float v) {
  return opscommon::Half(__half_as_ushort(__float2half_rn(v)), opscommon::Half::from_bits());
}

// VEC values of T in registers. float16/bfloat16 pairs share a 32-bit word,
// unpacked and packed with one instruction per value or pair. Held as 16-bit
// elements instead, every vector read was shuffled into place with a byte
// permute per element (to merge it with the broadcast path of load()) and the
// bfloat16 kernels spilled: the half-type forward ran 35-45% slower on an
// H100 (batch 4096, state 2048).
template <typename T, int VEC>
struct Regs {
  static constexpr bool kPair = sizeof(T) == 2 && VEC % 2 == 0;
  using W = std::conditional_t<kPair, uint32_t, T>;
  static constexpr int N = kPair ? VEC / 2 : VEC;
  AlignedVector<W, N> w;

  // Value k in the arithmetic type.
  __device__ __forceinline__ opscommon::acc_t<T> operator[](int k) const {
    if constexpr (!kPair) {
      return to_acc(w.val[k]);
    } else if constexpr (std::is_same_v<T, opscommon::BFloat16>) {
      const uint32_t x = w.val[k / 2];
      return __uint_as_float(k % 2 ? x & 0xffff0000u : x << 16);
    } else {
      const uint32_t x = w.val[k / 2];
      return __half2float(__ushort_as_half(static_cast<unsigned short>(k % 2 ? x >> 16 : x)));
    }
  }
};

// lo and hi rounded to T (to nearest even, as to_storage), lo in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, opscommon::BFloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
#else
  r = static_cast<uint32_t>(to_storage<T>(lo).x) |
      (static_cast<uint32_t>(to_storage<T>(hi).x) << 16);
#endif
  return r;
}

template <typename T, int VEC>
__device__ __forceinline__ Regs<T, VEC> pack(const opscommon::acc_t<T> (&x)[VEC]) {
  Regs<T, VEC> r;
  if constexpr (Regs<T, VEC>::kPair) {
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) r.w.val[i] = pack2<T>(x[2 * i], x[2 * i + 1]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) r.w.val[k] = to_storage<T>(x[k]);
  }
  return r;
}

// VEC copies of x.
template <typename T, int VEC>
__device__ __forceinline__ Regs<T, VEC> splat(T x) {
  Regs<T, VEC> r;
#pragma unroll
  for (int i = 0; i < Regs<T, VEC>::N; ++i) {
    if constexpr (Regs<T, VEC>::kPair) {
      r.w.val[i] = static_cast<uint32_t>(x.x) * 0x10001u;
    } else {
      r.w.val[i] = x;
    }
  }
  return r;
}

// VEC elements of row r starting at column j (a multiple of VEC). In the
// vector path an operand either has unit column stride (then its rows are
// aligned to VEC elements: checked at launch) or column stride 0 (a gradient
// expanded along the row: one scalar per row). nullptr reads as zeros.
template <int VEC, typename T>
__device__ __forceinline__ Regs<T, VEC> load(const Mat<T>& m, int64_t r, int64_t j) {
  using R = Regs<T, VEC>;
  if (m.p == nullptr) return splat<T, VEC>(to_storage<T>(opscommon::acc_t<T>(0)));
  const T* row = m.p + r * m.rs;
  if constexpr (VEC == 1) {
    return splat<T, VEC>(row[j * m.cs]);
  } else {
    if (m.cs == 0) return splat<T, VEC>(row[0]);
    R out;
    out.w = *reinterpret_cast<const AlignedVector<typename R::W, R::N>*>(row + j);
    return out;
  }
}

template <int VEC, typename T>
__device__ __forceinline__ void store(T* p, const Regs<T, VEC>& v) {
  using R = Regs<T, VEC>;
  *reinterpret_cast<AlignedVector<typename R::W, R::N>*>(p) = v.w;
}

// The math each storage type computes with (see lltm.h).
template <typename T>
using MathFor = std::conditional_t<sizeof(T) == 2, FastMath, AccurateMath>;

// The backward's bias kernel is launched as the backward kernel's
// programmatic dependent (lltm_dependent_launch.cuh), while the backward
// kernel's last blocks finish, instead of after (its launch latency was a
// tenth of a half-type backward at batch 4096, state 2048).

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads, kForwardMinBlocks)
    cell_forward_kernel(int64_t rows, int64_t S, Mat<T> gates, Mat<T> bias, Mat<T> old_c,
                        T* __restrict__ new_h, T* __restrict__ new_c) {
  using A = opscommon::acc_t<T>;
  const int64_t per_row = S / VEC;
  const int64_t n = rows * per_row;
  OPSCOMMON_KERNEL_LOOP(v, n) {
    const int64_t r = v / per_row;
    const int64_t j = (v - r * per_row) * VEC;
    const Regs<T, VEC> gi = load<VEC>(gates, r, j);
    const Regs<T, VEC> go = load<VEC>(gates, r, S + j);
    const Regs<T, VEC> gz = load<VEC>(gates, r, 2 * S + j);
    const Regs<T, VEC> c = load<VEC>(old_c, r, j);
    const Regs<T, VEC> bi = load<VEC>(bias, 0, j);
    const Regs<T, VEC> bo = load<VEC>(bias, 0, S + j);
    const Regs<T, VEC> bz = load<VEC>(bias, 0, 2 * S + j);
    A h[VEC], nc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      cell_forward_math<A, MathFor<T>>(gi[k] + bi[k], go[k] + bo[k], gz[k] + bz[k], c[k], h[k],
                                       nc[k]);
    }
    store<VEC>(new_h + r * S + j, pack<T, VEC>(h));
    store<VEC>(new_c + r * S + j, pack<T, VEC>(nc));
  }
}

// Block (bx, by), bx * by = kThreads: threadIdx.x picks a column vector,
// threadIdx.y and blockIdx.y stride over rows. partial: [gridDim.y, 3S].
// kNew: old_c holds new_cell (cell_backward_from_new_cell).
template <typename T, int VEC, bool kNew>
__global__ void __launch_bounds__(kThreads, kBackwardMinBlocks)
    cell_backward_kernel(int64_t rows, int64_t S, Mat<T> grad_h, Mat<T> grad_c, Mat<T> gates,
                         Mat<T> bias, Mat<T> old_c, T* __restrict__ d_gates,
                         T* __restrict__ d_old_c, opscommon::acc_t<T>* __restrict__ partial,
                         T* __restrict__ d_bias) {
  using A = opscommon::acc_t<T>;
  constexpr int Q = 3 * VEC;  // bias-gradient sums per thread
  __shared__ A red[kThreads * Q];

  const int64_t per_row = S / VEC;
  const int64_t cv = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t j = cv * VEC;
  A sum[3][VEC];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[k][e] = A(0);
  }
  if (cv < per_row) {
    // This thread's bias columns, loaded once for all its rows.
    const Regs<T, VEC> bi = load<VEC>(bias, 0, j);
    const Regs<T, VEC> bo = load<VEC>(bias, 0, S + j);
    const Regs<T, VEC> bz = load<VEC>(bias, 0, 2 * S + j);
    const int64_t row_stride = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
         r += row_stride) {
      const Regs<T, VEC> gh = load<VEC>(grad_h, r, j);
      const Regs<T, VEC> gc = load<VEC>(grad_c, r, j);
      const Regs<T, VEC> gi = load<VEC>(gates, r, j);
      const Regs<T, VEC> go = load<VEC>(gates, r, S + j);
      const Regs<T, VEC> gz = load<VEC>(gates, r, 2 * S + j);
      const Regs<T, VEC> c = load<VEC>(old_c, r, j);
      A d_i[VEC], d_o[VEC], d_z[VEC], d_c[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        cell_backward_math<A, MathFor<T>, kNew>(gh[e], gc[e], gi[e] + bi[e], go[e] + bo[e],
                                                gz[e] + bz[e], c[e], d_i[e], d_o[e], d_z[e],
                                                d_c[e]);
        sum[0][e] += d_i[e];
        sum[1][e] += d_o[e];
        sum[2][e] += d_z[e];
      }
      T* dg = d_gates + r * 3 * S + j;
      store<VEC>(dg, pack<T, VEC>(d_i));
      store<VEC>(dg + S, pack<T, VEC>(d_o));
      store<VEC>(dg + 2 * S, pack<T, VEC>(d_z));
      store<VEC>(d_old_c + r * S + j, pack<T, VEC>(d_c));
    }
  }

  // The rows are done: the bias kernel, launched as this grid's programmatic
  // dependent (sm_90+), may start launching now; it waits for this grid's
  // partial sums before it reads them.
  grid_dependents_may_launch();

  // Sum the block's rows: thread t's sums at red[t * Q + k * VEC + e].
  const unsigned int t = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) red[t * Q + k * VEC + e] = sum[k][e];
  }
  __syncthreads();
  // Output o = (k, x, e) with e fastest: consecutive o are consecutive
  // columns of gate k, so the partial row is written contiguously.
  const unsigned int row_len = blockDim.x * VEC;
  const unsigned int n_out = 3 * row_len;
  for (unsigned int o = t; o < n_out; o += blockDim.x * blockDim.y) {
    const unsigned int k = o / row_len;
    const unsigned int rem = o - k * row_len;
    const unsigned int x = rem / VEC;
    const unsigned int e = rem - x * VEC;
    const int64_t col = static_cast<int64_t>(blockIdx.x) * row_len + rem;  // within gate k
    if (col >= S) continue;
    A s = A(0);
    for (unsigned int y = 0; y < blockDim.y; ++y) s += red[(y * blockDim.x + x) * Q + k * VEC + e];
    if (gridDim.y == 1) {
      d_bias[k * S + col] = to_storage<T>(s);  // one block row: its sums are the gradient
    } else {
      partial[static_cast<int64_t>(blockIdx.y) * 3 * S + k * S + col] = s;
    }
  }
}

// d_bias[c] = sum over p of partial[p, c] (a few hundred partials at most),
// in double. Block (kBiasCols, kBiasRows): thread row y adds parts y,
// y + kBiasRows, ... in order, loading kBiasUnroll of them at a time, then
// thread row 0 adds the kBiasRows sums in order: a fixed order, so the result
// is deterministic. One thread per column adding all parts in turn waited on
// the partials one at a time: 15 of the 112 us of a bfloat16 backward at
// batch 4096, state 2048 on an H100 (132 parts). 32 thread rows (each part
// load in flight at once up to 256 parts) and the dependent launch bring the
// whole backward from 77 to 73 us there (8 rows, no dependent launch: 77).
constexpr unsigned int kBiasCols = 32;
constexpr unsigned int kBiasRows = 32;
constexpr unsigned int kBiasThreads = kBiasCols * kBiasRows;
constexpr int kBiasUnroll = 8;
constexpr int64_t kMaxBiasBlocks = 65535;
template <typename T>
__global__ void __launch_bounds__(kBiasThreads)
    bias_grad_kernel(int64_t cols, int64_t parts, const opscommon::acc_t<T>* __restrict__ partial,
                     T* __restrict__ d_bias) {
  using A = opscommon::acc_t<T>;
  wait_for_grid_dependencies();
  __shared__ double red[kBiasRows][kBiasCols];
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kBiasCols; c0 < cols;
       c0 += static_cast<int64_t>(gridDim.x) * kBiasCols) {
    const int64_t c = c0 + threadIdx.x;
    double s = 0.0;
    if (c < cols) {
      for (int64_t p0 = threadIdx.y; p0 < parts; p0 += kBiasRows * kBiasUnroll) {
        A v[kBiasUnroll];
#pragma unroll
        for (int u = 0; u < kBiasUnroll; ++u) {
          const int64_t p = p0 + u * static_cast<int64_t>(kBiasRows);
          v[u] = p < parts ? partial[p * cols + c] : A(0);
        }
#pragma unroll
        for (int u = 0; u < kBiasUnroll; ++u) s += static_cast<double>(v[u]);
      }
    }
    red[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
      double total = 0.0;
#pragma unroll
      for (unsigned int y = 0; y < kBiasRows; ++y) total += red[y][threadIdx.x];
      d_bias[c] = to_storage<T>(static_cast<A>(total));
    }
    __syncthreads();
  }
}

// d_bias from the backward kernel's partial sums: one block per kBiasCols
// columns (the loop in the kernel covers any more), launched as the
// backward's programmatic dependent where the GPU has it (see above).
template <typename T>
void launch_bias_grad(int device, cudaStream_t stream, int64_t cols, int64_t parts,
                      const opscommon::acc_t<T>* partial, T* d_bias, bool dependent = true) {
  const int64_t groups = (cols + kBiasCols - 1) / kBiasCols;
  launch_dependent(bias_grad_kernel<T>,
                   dim3(static_cast<unsigned int>(std::min<int64_t>(groups, kMaxBiasBlocks))),
                   dim3(kBiasCols, kBiasRows), stream, device, dependent, cols, parts, partial,
                   d_bias);
}

// Whether an operand can be read VEC elements at a time (see load()).
template <int VEC, typename T>
bool vector_ok(const Mat<T>& m) {
  if (m.p == nullptr || m.cs == 0) return true;
  return m.cs == 1 && m.rs % VEC == 0 && opscommon::is_aligned(m.p, VEC * sizeof(T));
}

template <int VEC, typename T>
bool out_ok(const T* p) {
  return opscommon::is_aligned(p, VEC * sizeof(T));
}

// The forward grid covers the work (one thread per vector; the grid-stride
// loop only matters past 2^20 blocks): for a streaming kernel this measured a
// few percent faster than a one-wave persistent grid (opscommon's launch_map).
constexpr int kForwardBlocksPerSm = 1 << 20;

template <typename T>
void launch_forward(int device, cudaStream_t stream, int64_t B, int64_t S, Mat<T> g, Mat<T> b,
                    Mat<T> oc, T* h, T* c) {
  constexpr int V = forward_vec<T>();
  if (S % V == 0 && vector_ok<V>(g) && vector_ok<V>(b) && vector_ok<V>(oc) && out_ok<V>(h) &&
      out_ok<V>(c)) {
    const auto cfg = opscommon::launch_config(B * (S / V), device, kThreads, kForwardBlocksPerSm);
    cell_forward_kernel<T, V><<<cfg.blocks, cfg.threads, 0, stream>>>(B, S, g, b, oc, h, c);
  } else {
    const auto cfg = opscommon::launch_config(B * S, device, kThreads, kForwardBlocksPerSm);
    cell_forward_kernel<T, 1><<<cfg.blocks, cfg.threads, 0, stream>>>(B, S, g, b, oc, h, c);
  }
  OPSCOMMON_CUDA_CHECK_LAUNCH();
}

struct BackwardGrid {
  dim3 grid;
  dim3 block;
};

// Columns across threadIdx.x (a power of two up to kMaxBlockColumns that
// covers the row when it is short), rows across threadIdx.y and blockIdx.y,
// with about one full wave of blocks in all.
inline BackwardGrid backward_grid(int64_t B, int64_t per_row, int device) {
  unsigned int bx = 1;
  while (bx < kMaxBlockColumns && bx < per_row) bx <<= 1;
  const unsigned int by = kThreads / bx;
  const int64_t grid_x = (per_row + bx - 1) / bx;
  const int64_t wave = static_cast<int64_t>(opscommon::multiprocessor_count(device)) * kBlocksPerSm;
  const int64_t want_y = std::max<int64_t>(1, (B + by - 1) / by);
  const int64_t cap_y = std::max<int64_t>(1, wave / grid_x);
  const int64_t grid_y =
      B <= kSingleBlockRowRows * by ? 1 : std::min<int64_t>({want_y, cap_y, 65535});
  OPSCOMMON_CHECK(grid_x <= 0x7fffffff, kCellBackward, ": state size too large");
  return {dim3(static_cast<unsigned int>(grid_x), static_cast<unsigned int>(grid_y)), dim3(bx, by)};
}

// oc: old_cell, or new_cell when from_new_cell (cell_backward_from_new_cell).
template <typename T>
void launch_backward(const Tensor& like, int device, cudaStream_t stream, int64_t B, int64_t S,
                     Mat<T> gh, Mat<T> gc, Mat<T> g, Mat<T> b, Mat<T> oc, T* dg, T* dc, T* d_bias,
                     bool from_new_cell = false) {
  using A = opscommon::acc_t<T>;
  constexpr int V = backward_vec<T>();
  const bool vec = S % V == 0 && vector_ok<V>(gh) && vector_ok<V>(gc) && vector_ok<V>(g) &&
                   vector_ok<V>(b) && vector_ok<V>(oc) && out_ok<V>(dg) && out_ok<V>(dc);
  const BackwardGrid cfg = backward_grid(B, vec ? S / V : S, device);
  const int64_t parts = cfg.grid.y;
  // Partial sums from the caching allocator: stream-ordered, CUDA-graph safe.
  std::optional<Tensor> partial;
  A* p = nullptr;
  if (parts > 1) {
    const int32_t acc_dtype =
        std::is_same_v<A, double> ? aoti_torch_dtype_float64() : aoti_torch_dtype_float32();
    partial = opscommon::empty_contiguous(from_new_cell ? kCellBackwardFromNewCell : kCellBackward,
                                          like, {parts, 3 * S}, acc_dtype);
    p = static_cast<A*>(partial->mutable_data_ptr());
  }
  if (vec && from_new_cell) {
    cell_backward_kernel<T, V, true>
        <<<cfg.grid, cfg.block, 0, stream>>>(B, S, gh, gc, g, b, oc, dg, dc, p, d_bias);
  } else if (vec) {
    cell_backward_kernel<T, V, false>
        <<<cfg.grid, cfg.block, 0, stream>>>(B, S, gh, gc, g, b, oc, dg, dc, p, d_bias);
  } else if (from_new_cell) {
    cell_backward_kernel<T, 1, true>
        <<<cfg.grid, cfg.block, 0, stream>>>(B, S, gh, gc, g, b, oc, dg, dc, p, d_bias);
  } else {
    cell_backward_kernel<T, 1, false>
        <<<cfg.grid, cfg.block, 0, stream>>>(B, S, gh, gc, g, b, oc, dg, dc, p, d_bias);
  }
  OPSCOMMON_CUDA_CHECK_LAUNCH();
  if (parts == 1) return;
  launch_bias_grad<T>(device, stream, 3 * S, parts, p, d_bias);
}

}  // namespace

std::tuple<Tensor, Tensor> cell_forward_cuda(Tensor gates, Tensor bias, Tensor old_cell) {
  int64_t B = 0, S = 0;
  check_cell_args(kCellForward, gates, bias, old_cell, B, S);
  const int device = gates.get_device();
  opscommon::DeviceGuard guard(device);
  Tensor new_h = opscommon::empty_contiguous(kCellForward, gates, {B, S});
  Tensor new_c = opscommon::empty_contiguous(kCellForward, gates, {B, S});
  if (B == 0 || S == 0) return {new_h, new_c};
  const cudaStream_t stream = opscommon::current_stream(device);
  opscommon::dispatch_floating(gates.scalar_type(), kCellForward, [&](auto tag) {
    using T = decltype(tag);
    launch_forward<T>(device, stream, B, S, mat_of<T>(gates), row_of<T>(bias), mat_of<T>(old_cell),
                      new_h.mutable_data_ptr<T>(), new_c.mutable_data_ptr<T>());
  });
  return {new_h, new_c};
}

namespace {

// cell_backward (`cell` is old_cell) or, with from_new_cell,
// cell_backward_from_new_cell (`cell` is new_cell).
std::tuple<Tensor, Tensor, Tensor> cell_backward_cuda_impl(const std::optional<Tensor>& grad_h,
                                                           const std::optional<Tensor>& grad_cell,
                                                           const Tensor& gates, const Tensor& bias,
                                                           const Tensor& cell, bool from_new_cell) {
  const char* op = from_new_cell ? kCellBackwardFromNewCell : kCellBackward;
  int64_t B = 0, S = 0;
  check_backward_args(grad_h, grad_cell, gates, bias, cell, B, S, from_new_cell);
  const int device = gates.get_device();
  opscommon::DeviceGuard guard(device);
  Tensor d_gates = opscommon::empty_contiguous(op, gates, {B, 3 * S});
  Tensor d_bias = opscommon::empty_contiguous(op, gates, {3 * S});
  Tensor d_old_c = opscommon::empty_contiguous(op, gates, {B, S});
  // B == 0 still runs: the kernels then write d_bias = 0 (one block row).
  if (S == 0) return {d_gates, d_bias, d_old_c};
  const cudaStream_t stream = opscommon::current_stream(device);
  opscommon::dispatch_floating(gates.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const Mat<T> none{nullptr, 0, 0};
    launch_backward<T>(gates, device, stream, B, S, grad_h ? mat_of<T>(*grad_h) : none,
                       grad_cell ? mat_of<T>(*grad_cell) : none, mat_of<T>(gates), row_of<T>(bias),
                       mat_of<T>(cell), d_gates.mutable_data_ptr<T>(),
                       d_old_c.mutable_data_ptr<T>(), d_bias.mutable_data_ptr<T>(), from_new_cell);
  });
  return {d_gates, d_bias, d_old_c};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> cell_backward_cuda(std::optional<Tensor> grad_h,
                                                      std::optional<Tensor> grad_cell, Tensor gates,
                                                      Tensor bias, Tensor old_cell) {
  return cell_backward_cuda_impl(grad_h, grad_cell, gates, bias, old_cell, false);
}

std::tuple<Tensor, Tensor, Tensor> cell_backward_from_new_cell_cuda(std::optional<Tensor> grad_h,
                                                                    std::optional<Tensor> grad_cell,
                                                                    Tensor gates, Tensor bias,
                                                                    Tensor new_cell) {
  return cell_backward_cuda_impl(grad_h, grad_cell, gates, bias, new_cell, true);
}

}  // namespace lltm_op

STABLE_TORCH_LIBRARY_IMPL(lltm_op, CUDA, m) {
  m.impl("cell_forward", TORCH_BOX(&lltm_op::cell_forward_cuda));
  m.impl("cell_backward", TORCH_BOX(&lltm_op::cell_backward_cuda));
  m.impl("cell_backward_from_new_cell", TORCH_BOX(&lltm_op::cell_backward_from_new_cell_cuda));
}
