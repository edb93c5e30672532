// lltm_op: the global-barrier backward with k split over a thread block
// cluster (sm_90, 16-bit types), for the largest state size. Included by
// lltm_sequence_cuda.cu after lltm_sequence_tc.cuh, whose loads, products,
// cell and barrier it uses.
//
// A step's recurrent product is dh = dG_{t+1} W_h (k = 3S). The global-
// barrier backward gives a block all of k for its 8 Q state columns, so
// every column block reads its rows' whole dG_{t+1} from L2 each step
// (B256 S1024, 32 columns and 64 rows a block: 384 KiB a block, 48 MiB
// over the grid, a step). Here a cluster of P blocks shares 32 P columns
// and splits k: block `part` holds rows part * 3S / P .. of those columns
// of W_h (the same bytes of shared memory as a 32-column block), reads
// only that range of its rows' dG (1 / P of it), and sends each block of
// the cluster the float32 partial sums of the kKsOwn columns whose cells
// that block runs (distributed shared memory, then the cluster's
// barrier). Each block adds the parts in cluster order (a fixed order) and
// runs its columns' cells as the global-barrier backward does: the same
// cell, the same barrier between steps, the same outputs.
#pragma once

namespace tc {

constexpr int kKsParts = 4;              // blocks a cluster (P): k parts
constexpr int kKsRows = 64;              // batch rows a block: 4 row tiles
constexpr int kKsOwn = 32;               // columns whose cells a block runs
constexpr int kKsOwnTiles = kKsOwn / 8;  // tiles of the block's own columns

// The k chunks of a block's part (3S / P elements), or 0 where the parts
// are not whole chunks.
template <typename T>
__host__ __device__ inline int64_t ksplit_chunks(int64_t S, int P) {
  const int64_t part = 3 * S / P;
  return 3 * S % P == 0 && part % kChunk<T> == 0 ? part / kChunk<T> : 0;
}
// Shared memory: the two warpgroups' weight slices (2 P tiles each), the
// partial sums the cluster's blocks send (a slot a part) and the
// bias-gradient sums.
template <typename T>
inline size_t ksplit_smem(int64_t S, int P) {
  return 2 * weight_bytes(2 * ksplit_chunks<T>(S, P), 2 * P) +
         static_cast<size_t>(P) * kKsRows * kKsOwn * sizeof(float) +
         static_cast<size_t>(kKsRows / 16) * 3 * kKsOwn * sizeof(float);
}

// How the host tells whether the code loaded for a device has wgmma (an
// sm_90a build): the marked probe's static shared memory is 16 bytes more
// than the unmarked one's there, the same elsewhere (cudaFuncGetAttributes
// of both; neither is launched). The plan takes the k-split backward only
// there: on mma.sync (a build for sm_90) it took longer than the
// global-barrier backward (H200, T256 bfloat16 B128 2963 against 2528 us).
template <bool kMarked>
__global__ void wgmma_build_probe_kernel(int* sink) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kMarked) {
    __shared__ int marker[4];
    marker[threadIdx.x & 3] = static_cast<int>(threadIdx.x);
    __syncthreads();
    if (sink != nullptr) *sink = marker[0];
  }
#endif
}

// 16 bytes to the cluster's shared-memory window address `addr`.
__device__ __forceinline__ void store_cluster_v4(uint32_t addr, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v[0]),
               "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
#else
  __trap();  // never launched below sm_90 (the host checks the device)
#endif
}

// The backward chunk [t0, t1) as backward_tc_kernel's (same arguments but
// the block shape, which is fixed; padded batches only). Grid: (S /
// kKsOwn, ceil(B / kKsRows)), clusters of P along x (kKsParts; 2 took
// longer than the global-barrier backward at B128 and B192). Warpgroup
// wg multiplies the block's k range for the cluster's columns 16 P wg ..
// + 16 P - 1 (warp w: row tile w % 4) on wgmma, both warpgroups' weights
// in shared memory in its canonical layout (the plan launches it only
// where the loaded code has wgmma). Warp w then runs the cells of row tile
// w % 4 and tiles 2 (w / 4), + 1 of the block's own columns.
template <typename T, int P>
__global__ void __launch_bounds__(kTcThreads, 1)
    backward_ksplit_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                           const T* go, const T* ghn, const T* gcn, T* dG, const T* w_h, int64_t ld,
                           T* dc, const T* gates, const T* cells, const T* c0, float* partial,
                           unsigned long long* arrivals) {
  constexpr int NT = 2 * P, Q = 2;  // a warp's product tiles, its cells' tiles
  constexpr bool kWg = kWgmmaBuilt;
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t S3 = 3 * S, KC = ksplit_chunks<T>(S, P), KT = 2 * KC;
  const int part = static_cast<int>(blockIdx.x) % P;
  const int64_t cols0 = static_cast<int64_t>(blockIdx.x / P) * P * kKsOwn;
  const int64_t k0 = part * KC * kChunk<T>;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kKsRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wg = warp >> 2, mt = warp & 3;
  const size_t slice_bytes = weight_bytes(KT, NT);
  // recv: [part][row tile][own tile][lane] float4, the accumulators as the
  // sending warp holds them.
  float4* recv = reinterpret_cast<float4*>(smem + 2 * slice_bytes);
  float* bsum = reinterpret_cast<float*>(recv + P * 4 * kKsOwnTiles * 32);  // [mt][3][own]
  for (int s = 0; s < 2; ++s) {
    // Tile nt of slice s: columns cols0 + 8 (NT s + nt) .. + 7 of W_h, k from k0.
    auto weight = [&](int64_t k, int nt, int n) -> uint32_t {
      const int64_t kk = k0 + k, j = cols0 + 8 * (NT * s + nt) + n;
      if (k >= KC * kChunk<T> || kk >= S3 || j >= S) return 0;
      return bits_of(w_h[kk * ld + j]);
    };
    unsigned char* slice = smem + s * slice_bytes;
    if constexpr (kWg) {
      load_weights_canonical<T>(reinterpret_cast<uint32_t*>(slice), KT, NT, weight);
    } else {
      __trap();  // never launched without wgmma (see wgmma_build_probe_kernel)
    }
  }
  const unsigned char* my_slice = smem + wg * slice_bytes;

  const int64_t step_gates = B * S3, step_state = B * S;
  const int64_t j0 = cols0 + part * kKsOwn;  // the block's own columns
  const int64_t row_base = r0 + 16 * mt + (lane >> 2);
  const int64_t col_base = j0 + 16 * wg + 2 * (lane & 3);
  auto valid = [&](int half, int q) { return row_base + 8 * half < B && col_base + 8 * q < S; };
  auto at = [&](int half, int q) { return (row_base + 8 * half) * S + col_base + 8 * q; };

  float dc_reg[Q][2][2] = {};
  Pair<T> n_go[Q][2] = {}, n_g[Q][2][3] = {}, n_c[Q][2] = {};
  const bool one = pairs_aligned<T>(go, gates, cells, c0);
  auto prefetch = [&](int64_t t) {
    fetch_backward_inputs<T, Q>(t, go, gates, cells, c0, S, S3, step_gates, step_state, row_base,
                                col_base, one, valid, at, n_go, n_g, n_c);
  };
  load_backward_dc<T, Q>(t1 - 1 == T_ - 1 ? gcn : dc, valid, at, dc_reg);
  prefetch(t1 - 1);

  // The block's k range of the warp's rows (clamped to the batch: rows past
  // it are not stored); the slice in shared memory starts at its first k.
  KRange kr = KRange::of<T>(S3, part * KC, (part + 1) * KC);
  const int64_t ra_at = std::min<int64_t>(row_base, B - 1) * S3 + kr.first;
  const int64_t rb_at = std::min<int64_t>(row_base + 8, B - 1) * S3 + kr.first;
  kr.c0 = 0;
  for (int64_t t = t1 - 1; t >= t0; --t) {
    const bool last = t == T_ - 1;
    const int64_t next_slot = t + 1 < t1 ? t + 1 - t0 : K;
    const T* dG_next = dG + next_slot * step_gates;
    T* dg_t = dG + (t - t0) * step_gates;
    float acc[Q][4] = {};
    // No recurrent gradient at the last step (the same for every block).
    if (!last) {
      float pacc[NT][4] = {};
      const GlobalRows<T> rows{dG_next + ra_at, dG_next + rb_at};
      if constexpr (kWg) {
        float wacc[NT][4] = {};
        wgmma_tile_product<T, NT>(wacc, rows, kr, shared_address(my_slice));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            asm volatile("mov.b32 %0, %1;" : "=f"(pacc[nt][e]) : "f"(wacc[nt][e]));
          }
        }
      }
      // Tile nt's sums (columns 8 (NT wg + nt) of the cluster's) to the
      // block that runs their cells, into its slot for this part.
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int own = (NT * wg + nt) / kKsOwnTiles, tile = (NT * wg + nt) % kKsOwnTiles;
        const uint32_t addr =
            shared_address(recv + ((part * 4 + mt) * kKsOwnTiles + tile) * 32 + lane);
        store_cluster_v4(cluster_address(addr, static_cast<uint32_t>(own)), pacc[nt]);
      }
      cluster_barrier();
#pragma unroll
      for (int q = 0; q < Q; ++q) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const float4 v = recv[((p * 4 + mt) * kKsOwnTiles + 2 * wg + q) * 32 + lane];
          acc[q][0] += v.x;
          acc[q][1] += v.y;
          acc[q][2] += v.z;
          acc[q][3] += v.w;
        }
      }
    }
    // The cells and the step's dG, then the arrival (as backward_tc_kernel).
    float sums[3][Q][2] = {};
    backward_cells<T, Q>(
        acc, dg_t, S, S3, row_base, col_base, valid, at, [](int64_t) { return true; },
        [&](int64_t) { return last; }, ghn, n_go, n_g, n_c, dc_reg, sums);
    if (t > t0) row_arrive(arrivals);
    if (t > t0) prefetch(t - 1);
    store_tile_bias_sums<Q>(bsum + mt * 3 * kKsOwn + 16 * wg, kKsOwn, sums, lane);
    __syncthreads();
    // The bias-gradient sums of the block's columns, row tiles in order.
    add_block_bias_sums(partial + static_cast<int64_t>(blockIdx.y) * S3, bsum, kKsOwn, kKsRows / 16,
                        j0, S);
    if (t > t0) row_wait(arrivals, static_cast<unsigned long long>(t1 - t) * gridDim.x);
  }
  store_backward_dc<T, Q>(dc, valid, at, dc_reg);
}

}  // namespace tc
