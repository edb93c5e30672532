// lltm_op: the resident-weight persistent kernels of the LLTM sequence:
// float32 at full precision (no TF32), the recurrent product on the FMA
// units, any GPU the package builds for. Included by lltm_sequence_cuda.cu
// inside its anonymous namespace (it uses that file's row_barrier,
// row_arrive / row_wait and rows_at, and tc::batched_copy).
//
// The fused kernels (lltm_sequence_cuda.cu) read their columns of the
// recurrent weights from L2 at every step: at B8 S1024 a block re-reads
// 384 KB a step, and a step took as long as cuDNN's. Here, as in the
// tensor-core kernels, the grid is (column blocks) x (batch blocks), every
// block resident at once, and a block loads its slice of the weights into
// shared memory once, for every step:
//
// * forward: NJ state columns j0 .. j0 + NJ - 1, the slice W = 3 NJ columns
//   of W_h^T (its columns' three gates), K = S rows;
// * backward: the NJ columns of W_h, K = 3S rows.
//
// A warp is 8 row groups x 4 k-lanes; a thread owns RT batch rows (8 apart)
// and, of the warp's share of k, every fourth 4-element chunk. Each step it
// loads its rows' state chunks (h_{t-1} forward, dG_{t+1} backward: written
// by the other blocks, read from L2 in 16-byte loads, kPrefetch chunks
// ahead) and multiplies them into RT x W float32 accumulators by the weight
// rows, which the 8 row groups read as one broadcast. The 4 k-lanes sum
// with shuffles, the warps that split k through shared memory, and the
// block's threads then finish the cell, one (row, column) each, as the fused
// kernels do. The blocks of a batch block meet at a barrier between steps
// (row_barrier; the backward arrives before it sums its bias gradient).
#pragma once

namespace resident {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kLaneRows = 8;  // row groups of a warp
constexpr int kLaneK = 4;     // k-lanes of a warp
constexpr int kChunk = 4;     // k elements of one 16-byte load
// k elements the 4 k-lanes of a warp take in one round.
constexpr int kRound = kLaneK * kChunk;

// Row k of a weight slice of `width` floats a row, in shared memory: 4
// floats of padding after every 4 rows put the rows k, k + 4, k + 8,
// k + 12 that the four k-lanes read together on four different groups of
// 4 banks (widths of 4, 8, 12 and 24 floats; rows of 8 or 24 floats would
// otherwise start on the same bank: a 4-way conflict).
__host__ __device__ __forceinline__ int weight_row(int k, int width) {
  return k * width + 4 * (k >> 2);
}
// Floats of a slice of K rows (rounded up to whole rounds, zero past K).
__host__ __device__ inline int64_t weight_floats(int64_t K, int width) {
  const int64_t rows = (K + kRound - 1) / kRound * kRound;
  return rows * width + rows;
}
__host__ __device__ inline int64_t block_rows(int RT, int row_warps) {
  return int64_t(kLaneRows) * RT * row_warps;
}
// Shared memory: the weight slice, the k-warps' partial sums ([kw][bm][W]),
// and in the backward the block's bias-gradient rows ([bm][3 NJ]).
inline size_t smem_bytes(bool forward, int64_t S, int NJ, int RT, int row_warps) {
  const int W = forward ? 3 * NJ : NJ;
  const int64_t K = forward ? S : 3 * S;
  const int64_t bm = block_rows(RT, row_warps);
  const int64_t kw = kWarps / row_warps;
  int64_t floats = weight_floats(K, W) + kw * bm * W;
  if (!forward) floats += bm * 3 * NJ;
  return static_cast<size_t>(floats) * sizeof(float);
}
// Chunks in flight per thread and row: 8 of them for one row (a warp's
// whole share at B8 S1024), 4 for four rows, 2 with 96 accumulators (the
// forward's RT = 4, NJ = 8 spilled at 4).
template <int RT, int W>
constexpr int kPrefetch = RT == 1        ? 8
                          : RT * W >= 96 ? 2
                                         : 4;

// Cells a thread runs at once where they are not loaded ahead (RT = 4):
// the loads of a batch are all in flight together, after the product,
// whose accumulators are dead by then.
constexpr int kCellBatch = 4;

// The block's `count` cells, kCellBatch a thread at a time: inputs(e, v)
// loads cell e's NV inputs and returns its status (0: none; e >= count
// loads nothing), then finish(e, v, status) runs each cell of the batch.
template <int NV, typename Inputs, typename Finish>
__device__ __forceinline__ void cells_in_batches(int count, Inputs&& inputs, Finish&& finish) {
  for (int e0 = threadIdx.x; e0 < count; e0 += kCellBatch * kThreads) {
    float v[kCellBatch][NV];
    int status[kCellBatch];
#pragma unroll
    for (int q = 0; q < kCellBatch; ++q) status[q] = inputs(e0 + q * kThreads, v[q]);
#pragma unroll
    for (int q = 0; q < kCellBatch; ++q) {
      if (e0 + q * kThreads < count) finish(e0 + q * kThreads, v[q], status[q]);
    }
  }
}

// Asks L2 for the line of `p` (no register, no wait): a step's cell inputs
// that live in HBM (the input projection, the saved states) are fetched
// while the product runs.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// acc[i][c] += sum over the thread's k of state[row i][k] * w[k][c], over
// the chunks c0, c0 + 4, ... below kend of this warp's k range (`state(i)`
// is row i's base pointer; k past K reads zero weights, and the state is
// not loaded there). Then the 4 k-lanes' sums, in every lane.
template <int RT, int W>
__device__ __forceinline__ void product(float (&acc)[RT][W], const float* const (&row)[RT],
                                        const float* wsm, int kbegin, int kend, int K, int kq) {
  constexpr int PD = kPrefetch<RT, W>;
#pragma unroll
  for (int i = 0; i < RT; ++i) {
#pragma unroll
    for (int c = 0; c < W; ++c) acc[i][c] = 0.0f;
  }
  float4 buf[PD][RT];
  auto load = [&](float4(&b)[RT], int k) {
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      b[i] = k < K ? __ldcg(reinterpret_cast<const float4*>(row[i] + k))
                   : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  const int first = kbegin + kChunk * kq;
#pragma unroll
  for (int p = 0; p < PD; ++p) {
    const int k = first + p * kRound;
    if (k < kend) load(buf[p], k);
  }
  for (int k0 = first; k0 < kend; k0 += PD * kRound) {
#pragma unroll
    for (int p = 0; p < PD; ++p) {
      const int k = k0 + p * kRound;
      if (k < kend) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          const float* wr = wsm + weight_row(k + e, W);
#pragma unroll
          for (int q = 0; q < W / 4; ++q) {
            const float4 w = *reinterpret_cast<const float4*>(wr + 4 * q);
#pragma unroll
            for (int i = 0; i < RT; ++i) {
              const float h = e == 0   ? buf[p][i].x
                              : e == 1 ? buf[p][i].y
                              : e == 2 ? buf[p][i].z
                                       : buf[p][i].w;
              acc[i][4 * q] = fmaf(h, w.x, acc[i][4 * q]);
              acc[i][4 * q + 1] = fmaf(h, w.y, acc[i][4 * q + 1]);
              acc[i][4 * q + 2] = fmaf(h, w.z, acc[i][4 * q + 2]);
              acc[i][4 * q + 3] = fmaf(h, w.w, acc[i][4 * q + 3]);
            }
          }
        }
        if (k + PD * kRound < kend) load(buf[p], k + PD * kRound);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RT; ++i) {
#pragma unroll
    for (int c = 0; c < W; ++c) {
      float v = acc[i][c];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      acc[i][c] = v;
    }
  }
}

// A thread's place in its block: rows (of bm, RT of them, 8 apart within
// its row warp's 8 RT), k-lane, and its warp's k range [kbegin, kend)
// (whole rounds; the k-warps split the rounds of K evenly).
struct Place {
  int kq, kwi, row0, kbegin, kend;
  __device__ Place(int RT, int row_warps, int64_t K) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    kq = lane & 3;
    const int rw = warp % row_warps;
    kwi = warp / row_warps;
    row0 = rw * kLaneRows * RT + (lane >> 2);
    const int kw = kWarps / row_warps;
    const int rounds = static_cast<int>((K + kRound - 1) / kRound);
    const int per = (rounds + kw - 1) / kw;
    kbegin = kwi * per * kRound;
    kend = min(rounds, (kwi + 1) * per) * kRound;
  }
};

// Write the 4 k-lanes' sums (every lane holds them) to this warp's partial
// rows, each lane a quarter of the columns.
template <int RT, int W>
__device__ __forceinline__ void store_partial(float* part, const float (&acc)[RT][W],
                                              const Place& p, int64_t bm) {
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    float* dst = part + (p.kwi * bm + p.row0 + i * kLaneRows) * W;
#pragma unroll
    for (int c = 0; c < W; ++c) {
      if ((c & 3) == p.kq) dst[c] = acc[i][c];
    }
  }
}

// The product of this block's rows r0 .. r0 + bm - 1 of a [B, K] state
// (rows past B read row B - 1; unused) and its weight slice: each warp's
// sums over its k range into `part`.
template <int RT, int W>
__device__ __forceinline__ void block_product(float* part, const float* wsm, const Place& p,
                                              const float* state, int64_t B, int64_t K, int64_t r0,
                                              int64_t bm) {
  const float* row[RT];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    row[i] = state + std::min<int64_t>(r0 + p.row0 + i * kLaneRows, B - 1) * K;
  }
  float acc[RT][W];
  product<RT, W>(acc, row, wsm, p.kbegin, p.kend, static_cast<int>(K), p.kq);
  store_partial<RT, W>(part, acc, p, bm);
}

// Forward: steps 0 .. steps - 1, as forward_persistent_kernel (kPacked: bs
// holds a packed run's batch sizes; alternate_cells: step t's cell state in
// slot t & 1). w_h: W_h, [3S, S] rows of stride ld_w (read in place); h0
// 16-byte aligned, S a multiple of 4.
template <int NJ, int RT, bool kPacked>
__global__ void __launch_bounds__(kThreads)
    forward_resident_kernel(int64_t steps, int64_t B, int64_t S, int row_warps, float* gates,
                            const float* bias, const float* h0, const float* w_h, int64_t ld_w,
                            const float* c0, float* outs, float* cells, bool alternate_cells,
                            float* h_n, float* c_n, const int64_t* bs,
                            unsigned long long* arrivals) {
  constexpr int W = 3 * NJ;
  extern __shared__ __align__(16) unsigned char smem[];
  float* wsm = reinterpret_cast<float*>(smem);
  const int64_t bm = block_rows(RT, row_warps);
  float* part = wsm + weight_floats(S, W);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * NJ;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * bm;
  const int kw = kWarps / row_warps;
  {
    const int K = static_cast<int>((S + kRound - 1) / kRound * kRound);
    // Column c of the slice is column (c / NJ) S + j of W_h^T (tc::w_hT_at):
    // consecutive threads read consecutive k of it (coalesced).
    tc::batched_copy_2d(
        W, K,
        [&](int c, int k) {
          const int64_t j = j0 + c % NJ;
          return k < S && j < S ? tc::w_hT_at(w_h, ld_w, k, (c / NJ) * S + j) : 0.0f;
        },
        [&](int c, int k, float v) { wsm[weight_row(k, W) + c] = v; });
  }
  __syncthreads();
  const Place p(RT, row_warps, S);
  const int64_t step_gates = B * 3 * S, step_state = B * S;
  for (int64_t t = 0; t < steps; ++t) {
    const int64_t n = kPacked ? rows_at(bs, B, steps, t) : B;
    const int64_t n_next = kPacked ? rows_at(bs, B, steps, t + 1) : 0;
    if (kPacked && r0 >= n) break;
    const bool last = t == steps - 1;
    const bool final_state = kPacked || last;
    float* g_t = gates + t * step_gates;
    const float* c_prev = t ? cells + cell_slot(t - 1, alternate_cells) * step_state : c0;
    float* h = outs + t * step_state;
    float* c = cells + cell_slot(t, alternate_cells) * step_state;
    // Cell e's inputs: the input projection and bias of its three gates,
    // its c_{t-1}; false where it is no cell of this step.
    auto cell_inputs = [&](int e, float (&v)[7]) {
      const int64_t row_i = r0 + e / NJ, j = j0 + e % NJ;
      if (e >= bm * NJ || row_i >= n || j >= S) return false;
      const float* gr = g_t + row_i * 3 * S;
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        v[g] = gr[g * S + j];
        v[3 + g] = bias[g * S + j];
      }
      v[6] = c_prev[row_i * S + j];
      return true;
    };
    auto finish_cell = [&](int e, const float (&v)[7]) {
      const int r = e / NJ, jj = e % NJ;
      const int64_t row_i = r0 + r, j = j0 + jj;
      float pre[3];
      float* gr = g_t + row_i * 3 * S;
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        float sum = 0.0f;
        for (int w = 0; w < kw; ++w) sum += part[(w * bm + r) * W + g * NJ + jj];
        pre[g] = v[g] + sum + v[3 + g];
        gr[g * S + j] = pre[g];
      }
      const int64_t i = row_i * S + j;
      float nh, nc;
      cell_forward_math<float, AccurateMath>(pre[0], pre[1], pre[2], v[6], nh, nc);
      h[i] = nh;
      c[i] = nc;
      if (final_state && h_n != nullptr && row_i >= n_next) {
        h_n[i] = nh;
        c_n[i] = nc;
      }
    };
    // One row a thread (latency-bound sizes): the cells' inputs are loaded
    // before the product, which hides their latency. Four rows (no
    // registers to spare): their input projections are asked of L2 before
    // the product and loaded after it, kCellBatch cells at once.
    constexpr int kAhead = RT == 1 ? NJ / 4 : 0;  // bm NJ <= kAhead * kThreads
    float ahead[kAhead > 0 ? kAhead : 1][7];
    bool live[kAhead > 0 ? kAhead : 1];
#pragma unroll
    for (int q = 0; q < kAhead; ++q) live[q] = cell_inputs(threadIdx.x + q * kThreads, ahead[q]);
    if constexpr (kAhead == 0) {
      for (int e = threadIdx.x; e < bm * NJ; e += kThreads) {
        const int64_t row_i = r0 + e / NJ, j = j0 + e % NJ;
        if (row_i >= n || j >= S) continue;
#pragma unroll
        for (int g = 0; g < 3; ++g) prefetch_l2(g_t + row_i * 3 * S + g * S + j);
      }
    }
    block_product<RT, W>(part, wsm, p, t ? outs + (t - 1) * step_state : h0, B, S, r0, bm);
    __syncthreads();
    if constexpr (kAhead > 0) {
#pragma unroll
      for (int q = 0; q < kAhead; ++q) {
        if (live[q]) finish_cell(threadIdx.x + q * kThreads, ahead[q]);
      }
    } else {
      cells_in_batches<7>(
          static_cast<int>(bm * NJ), [&](int e, float (&v)[7]) { return int(cell_inputs(e, v)); },
          [&](int e, const float (&v)[7], int live) {
            if (live) finish_cell(e, v);
          });
    }
    if (!last) row_barrier(arrivals, static_cast<unsigned long long>(t + 1) * gridDim.x);
  }
}

// Backward: steps t1 - 1 down to t0 of a chunk, as backward_persistent_kernel.
// w_h: [3S, S] rows of stride ld; partial: [gridDim.y or more, 3S].
template <int NJ, int RT, bool kPacked>
__global__ void __launch_bounds__(kThreads)
    backward_resident_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K_slots, int64_t B,
                             int64_t S, int row_warps, const float* go, const float* ghn,
                             const float* gcn, float* dG, const float* w_h, int64_t ld, float* dc,
                             const float* gates, const float* cells, const float* c0,
                             float* partial, const int64_t* bs, unsigned long long* arrivals) {
  constexpr int W = NJ;
  extern __shared__ __align__(16) unsigned char smem[];
  float* wsm = reinterpret_cast<float*>(smem);
  const int64_t bm = block_rows(RT, row_warps);
  const int64_t S3 = 3 * S;
  const int kw = kWarps / row_warps;
  float* part = wsm + weight_floats(S3, W);
  float* bsum = part + kw * bm * W;  // [bm][3][NJ]
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * NJ;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * bm;
  {
    const int K = static_cast<int>((S3 + kRound - 1) / kRound * kRound);
    tc::batched_copy(
        K * W,
        [&](int e) {
          const int k = e / W;
          const int64_t j = j0 + e % W;
          return k < S3 && j < S ? w_h[k * ld + j] : 0.0f;
        },
        [&](int e, float v) { wsm[weight_row(e / W, W) + e % W] = v; });
  }
  __syncthreads();
  const Place p(RT, row_warps, S3);
  const int64_t step_gates = B * S3, step_state = B * S;
  for (int64_t t = t1 - 1; t >= t0; --t) {
    const ChunkStep<kPacked> step_at(bs, B, T_, t0, t1, K_slots, t);
    const int64_t n = step_at.n, n_next = step_at.n_next;
    const bool product_runs = step_at.product_from(r0);
    const float* extra = kPacked || step_at.last ? ghn : nullptr;
    const float* dc_in = step_at.last ? gcn : dc;
    const float* g_t = gates + t * step_gates;
    const float* c_prev = t ? cells + (t - 1) * step_state : c0;
    float* d_t = dG + (t - t0) * step_gates;
    // Cell e's inputs: dh's terms besides the product, dc, the three gates'
    // pre-activations, c_{t-1}. 0: no cell; 1: a row past this step's
    // length (zero gradients, dc kept); 2: a cell that runs.
    auto cell_inputs = [&](int e, float (&v)[6]) {
      const int64_t row_i = r0 + e / NJ, j = j0 + e % NJ;
      if (e >= bm * NJ || row_i >= B || j >= S) return 0;
      if (row_i >= n) return 1;
      const int64_t i = row_i * S + j;
      v[0] = (go != nullptr ? go[t * step_state + i] : 0.0f) +
             (extra != nullptr && row_i >= n_next ? extra[i] : 0.0f);
      v[1] = dc_in != nullptr ? dc_in[i] : 0.0f;
      const float* g = g_t + row_i * S3;
      v[2] = g[j];
      v[3] = g[S + j];
      v[4] = g[2 * S + j];
      v[5] = c_prev[i];
      return 2;
    };
    auto finish_cell = [&](int e, const float (&v)[6], int status) {
      const int r = e / NJ, jj = e % NJ;
      const int64_t row_i = r0 + r, j = j0 + jj;
      float d3[3] = {0.0f, 0.0f, 0.0f};
      if (status == 2) {
        float grad_h = 0.0f;
        if (product_runs) {
          for (int w = 0; w < kw; ++w) grad_h += part[(w * bm + r) * W + jj];
        }
        grad_h += v[0];
        float d_c;
        cell_backward_math<float, AccurateMath>(grad_h, v[1], v[2], v[3], v[4], v[5], d3[0], d3[1],
                                                d3[2], d_c);
        dc[row_i * S + j] = d_c;
      }
      if (status > 0) {
        float* d = d_t + row_i * S3;
        d[j] = d3[0];
        d[S + j] = d3[1];
        d[2 * S + j] = d3[2];
      }
#pragma unroll
      for (int g = 0; g < 3; ++g) bsum[(r * 3 + g) * NJ + jj] = d3[g];
    };
    constexpr int kAhead = RT == 1 ? NJ / 4 : 0;  // as in the forward
    float ahead[kAhead > 0 ? kAhead : 1][6];
    int status[kAhead > 0 ? kAhead : 1];
#pragma unroll
    for (int q = 0; q < kAhead; ++q) status[q] = cell_inputs(threadIdx.x + q * kThreads, ahead[q]);
    if constexpr (kAhead == 0) {
      // As in the forward: the inputs that live in HBM (the step's output
      // gradient, pre-activations and c_{t-1}) asked of L2 first.
      for (int e = threadIdx.x; e < bm * NJ; e += kThreads) {
        const int64_t row_i = r0 + e / NJ, j = j0 + e % NJ;
        if (row_i >= n || j >= S) continue;
        const int64_t i = row_i * S + j;
        if (go != nullptr) prefetch_l2(go + t * step_state + i);
#pragma unroll
        for (int g = 0; g < 3; ++g) prefetch_l2(g_t + row_i * S3 + g * S + j);
        prefetch_l2(c_prev + i);
      }
    }
    if (product_runs) {
      block_product<RT, W>(part, wsm, p, dG + step_at.next_slot * step_gates, B, S3, r0, bm);
    }
    __syncthreads();
    if constexpr (kAhead > 0) {
#pragma unroll
      for (int q = 0; q < kAhead; ++q) {
        const int e = threadIdx.x + q * kThreads;
        if (e < bm * NJ) finish_cell(e, ahead[q], status[q]);
      }
    } else {
      cells_in_batches<6>(static_cast<int>(bm * NJ), cell_inputs, finish_cell);
    }
    // Arrive with the step's dG written (and its bias-gradient rows: the
    // arrival holds the block's threads), then sum the bias gradient while
    // the other blocks arrive.
    if (t > t0) {
      row_arrive(arrivals);
    } else {
      __syncthreads();
    }
    // The block's rows' bias gradient, summed in row order (deterministic).
    for (int e = threadIdx.x; e < 3 * NJ; e += kThreads) {
      const int g = e / NJ, jj = e % NJ;
      if (j0 + jj >= S) continue;
      float sum = 0.0f;
      for (int r = 0; r < bm; ++r) sum += bsum[(r * 3 + g) * NJ + jj];
      partial[static_cast<int64_t>(blockIdx.y) * S3 + g * S + j0 + jj] += sum;
    }
    if (t > t0) row_wait(arrivals, static_cast<unsigned long long>(t1 - t) * gridDim.x);
  }
}

}  // namespace resident
