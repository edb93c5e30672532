// lltm_op: the block-local tensor-core kernels of the LLTM sequence (sm_80+),
// for state sizes whose recurrent matrix fits in the shared memory of one
// block or of one thread block cluster (sm_90; see compute_local_launch).
// Included by lltm_sequence_cuda.cu after lltm_sequence_tc.cuh, whose
// fragments, loads and cell helpers they use.
//
// A block (or a cluster of C blocks) owns 16 batch rows (8: full float32's
// kernels, and the tensor cores' clusters where the rule says so, see
// kLocalEightRows) and ALL state columns, so no step waits for any other
// block (cluster): the recurrent state of its rows (h forward, dG backward)
// stays in shared memory, and the steps are separated by __syncthreads alone
// (in a cluster, each block's wait on its mbarrier for the step's state: see
// Exchange). The global-barrier kernels spend most of a step at small sizes
// on what this removes: the state's round trip through L2 and the grid-wide
// barrier (a release, an atomic and a poll of global memory). Blocks are
// independent, so they need not all be resident at once; the plan still asks
// for one wave (see compute_tc_plan).
//
// The state columns are tiles of 8 Q; block `rank` of a cluster owns tiles
// rank * n .. rank * n + n - 1 (n = local_block_tiles), one a warp: warp w
// owns the state columns of tile rank * n + w (forward: their three gates'
// columns of W_h^T, K = S; backward: those columns of W_h, K = 3S), its
// weight fragments a contiguous slice of shared memory, laid out as a
// global-barrier block's of the same Q. Every block keeps the whole state
// rows: a block writes its columns of a step's state to its own buffer and to
// the other blocks' (distributed shared memory, st.async), and a warp starts
// the next step once its block's buffer holds the whole state (the buffer's
// mbarrier: the block's warps arrived, the other blocks' bytes came). A
// cluster-wide barrier a step, as before, waited for every block's slowest
// warp, and its release fence for the step's global stores (the ncu profile
// of S = 128, B64: a quarter of the step); the exchange made the 16-bit step
// 0.6x as long there (H100, forward 2.16 -> 1.29 us). Each thread owns the
// accumulator elements at rows lane / 4 and + 8, columns 2 (lane % 4) +
// {0, 1} of each 8-column group, for all three gates: the cell runs in
// registers, as in the global-barrier kernels, with the same arithmetic
// (float32 products and cell, pre-activations rounded to the storage type).
#pragma once

namespace tc {

constexpr int64_t kLocalRows = 16;  // batch rows a block (cluster)
// 8 rows a cluster: full float32's (kLocalRowsOf below), and the tensor
// cores' cluster kernels where the rule says so (kRows, the
// accumulator's first row half; the second's A rows repeat the first's and
// its results are dropped): a step's cells and exchange, most of its
// instructions, are per row, so 8 rows a cluster over twice the clusters
// take less time a step wherever the clusters fit (H100, T1024, us a step:
// one cluster at B8 against B16, float32 TF32 S = 128 forward 1.03 / 1.53,
// forward+backward 3.10 / 4.12).
constexpr int kLocalEightRows = 8;
// Full float32 (kFma: the product on the FMA units, see fma_product) takes
// 8 rows a block, the accumulator's first row half: its product costs an
// FMA per row, where the tensor cores' m16 tile costs the same for 8 rows
// as for 16, so 8 rows a cluster spread the batch over twice the
// multiprocessors.
template <bool kFma>
constexpr int64_t kLocalRowsOf = kFma ? kLocalEightRows : kLocalRows;
// The accumulator's row halves a block's kRows batch rows fill (16 or 8;
// the FMA kernels 8).
template <bool kFma, int64_t kRows>
constexpr int local_halves() {
  static_assert(kRows == kLocalRowsOf<true> || (kRows == kLocalRows && !kFma),
                "16 or 8 rows, 8 on FMA");
  return static_cast<int>(kRows / 8);
}
// At most 12 warps (column tiles) a block, what the rule
// (compute_local_launch) gives one block: the launch bound, 168 registers
// a thread (16 warps would leave 128, where the float32 backward spills).
constexpr int kLocalMaxWarps = 12;
// A cluster's blocks at most 8 (the rule gives them 4 or 8): 255
// registers a thread.
constexpr int kLocalClusterMaxWarps = 8;
template <bool kCluster>
constexpr int local_max_threads() {
  return 32 * (kCluster ? kLocalClusterMaxWarps : kLocalMaxWarps);
}
constexpr int kLocalGroup = 2;  // chunks of A in flight (shared memory: short latency)
// Chunks of its weight slice a warp holds in registers for the whole launch
// (the product's B operand; the rest it reads from shared memory every
// step): 12 registers a chunk forward (three gates' tiles), 4 backward. Four
// warps a block read the step's state and, without these, their weights
// from shared memory, and at S = 128 the product was about twice the time
// the bytes take at its bandwidth (H100: 16-bit forward 630 cycles a step,
// backward 1240; float32 1200 and 2300). A multiple of 2 kLocalGroup. In
// a cluster, 8 forward and 24 backward (96 registers), or where the
// product has at most half that many chunks (kSmallK, see local_small_k),
// 4 and 12. One block alone (no cluster) has at most 168 registers a
// thread: 4 and 12 in 16-bit types, 0 and 12 in float32 (its forward
// spilled with 4).
template <typename T, bool kCluster, bool kSmallK>
constexpr int kLocalForwardRegChunks = kCluster ? (kSmallK ? 4 : 8) : (sizeof(T) == 2 ? 4 : 0);
template <bool kCluster, bool kSmallK>
constexpr int kLocalBackwardRegChunks = kCluster && !kSmallK ? 24 : 12;
// Whether the forward (K = S) or backward (K = 3S) product of state size S
// fits the kSmallK register chunks.
template <typename T>
inline bool local_small_k(int64_t S, bool forward) {
  const int64_t KC = ((forward ? S : 3 * S) + kChunk<T> - 1) / kChunk<T>;
  return KC <= (forward ? 4 : 12);
}
// Register fragments of RC chunks (an array of one where RC is 0, unused):
// v[chunk][k tile][nt]. A struct, not an alias template of the array type:
// nvcc 12.4's front end stops with an internal error on that alias.
template <int RC, int NT>
struct RegChunks {
  uint2 v[RC > 0 ? RC : 1][2][NT];
};
// Blocks a cluster: sm_90 allows up to 16 (8 portably).
constexpr int kLocalMaxCluster = 16;

// Row stride (elements) of a [16, K] state buffer in shared memory: K
// rounded up to whole chunks (the product reads whole chunks; the padding
// stays zero), then to 16 bytes past a multiple of 128 so that the eight
// rows of an ldmatrix (16 bytes each) fall in different banks.
template <typename T>
__host__ __device__ inline int64_t local_ld(int64_t K) {
  const int64_t bytes =
      (K + kChunk<T> - 1) / kChunk<T> * kChunk<T> * static_cast<int64_t>(sizeof(T));
  const int64_t padded = bytes + (16 - bytes % 128 + 128) % 128;
  return padded / static_cast<int64_t>(sizeof(T));
}

// Column tiles of 8 Q columns: ceil(ceil(S / 8) / Q); a block's share of
// them over C blocks (its warps).
__host__ __device__ inline int local_tiles(int64_t S, int Q) {
  return static_cast<int>(((S + 7) / 8 + Q - 1) / Q);
}
__host__ __device__ inline int local_block_tiles(int64_t S, int Q, int C) {
  return (local_tiles(S, Q) + C - 1) / C;
}

// This block's share of the column tiles: C blocks in its cluster (the
// grid's x), per_block tiles a block (its shared memory is laid out for
// that many), tiles first .. first + slices - 1 its own (a last block may
// hold fewer, or none).
struct TileShare {
  int C, rank, per_block, first, slices;
  __device__ __forceinline__ TileShare(int64_t S, int Q)
      : C(static_cast<int>(gridDim.x)), rank(static_cast<int>(blockIdx.x)) {
    per_block = local_block_tiles(S, Q, C);
    first = rank * per_block;
    slices = std::max(0, std::min(per_block, local_tiles(S, Q) - first));
  }
};

// One 8-column tile a warp.
constexpr int kLocalQ = 1;

// After the two state buffers: their mbarriers (clusters).
constexpr size_t kLocalBarrierBytes = 2 * sizeof(uint64_t);
// The split's exchange (see combine_halves) of a block's `tiles` column
// tiles: each tile's split - 1 other warps' 32 lanes' NT tiles of E sums;
// none without a split.
inline size_t split_sums_bytes(int split, int tiles, int NT, int E) {
  return static_cast<size_t>(split - 1) * tiles * 32 * NT * E * sizeof(float);
}
// split > 1 (see forward_local): after the mbarriers, the split's exchange.
template <typename T>
inline size_t local_forward_smem(int64_t S, int Q, int C, int split = 1,
                                 int64_t rows = kLocalRows) {
  const int tiles = local_block_tiles(S, Q, C);
  return tiles * weight_bytes(k_tiles<T>(S), 3 * Q) + 2 * rows * local_ld<T>(S) * sizeof(T) +
         kLocalBarrierBytes + split_sums_bytes(split, tiles, 3 * Q, 4);
}
// Two dG buffers: the step's and the next's.
template <typename T>
inline size_t local_backward_smem(int64_t S, int Q, int C, int64_t rows = kLocalRows) {
  return local_block_tiles(S, Q, C) * weight_bytes(k_tiles<T>(3 * S), Q) +
         2 * rows * local_ld<T>(3 * S) * sizeof(T) + kLocalBarrierBytes;
}

// The state written before it visible to every warp of the block (the
// cluster), every warp done with what it read before.
template <bool kCluster>
__device__ __forceinline__ void local_barrier() {
  if constexpr (kCluster) {
    cluster_barrier();
  } else {
    __syncthreads();
  }
}

// The cluster's exchange of a step's state (see the mbarriers in
// lltm_sequence_tc.cuh): buffer b's mbarrier at bar + 8 b of every block;
// a phase of it is one step's state, whose bytes from the other blocks
// (`tx`) warp 0 posts as it arrives. Blocks past `active` hold no tiles
// and get nothing.
struct Exchange {
  uint32_t buf, bar, tx;
  int rank, active;
  __device__ __forceinline__ uint32_t bar_of(int64_t b) const {
    return bar + static_cast<uint32_t>(b) * 8;
  }
  // The i-th other active block (0 < i < active), counting on from this one.
  __device__ __forceinline__ uint32_t peer(int i) const {
    return static_cast<uint32_t>(rank + i < active ? rank + i : rank + i - active);
  }
  // v[n] to the other active blocks' buffers at byte offset off[n] of this
  // block's buffer `b`, counted on their mbarrier of it: a peer's
  // addresses once, then its N stores (a block's window of the cluster's
  // shared memory is contiguous). What the pushes cost follows their
  // bytes, not their store count: 16-byte stores gathered by shuffles
  // (half or a quarter as many) were slower or the same in every cluster
  // kernel measured, twice the pushes 8-31% slower, and a backward pushing
  // a third of its bytes (one gate's dG: results wrong, timing only)
  // 16-22% faster (H200;
  // bench/results-h200/lltm_sequence_exchange_and_products_0.6.29.md).
  template <int N, typename V>
  __device__ __forceinline__ void push(const uint32_t (&off)[N], int64_t b, const V (&v)[N]) const {
    for (int i = 1; i < active; ++i) {
      const uint32_t r = peer(i);
      const uint32_t to = cluster_address(buf, r), bar_r = cluster_address(bar_of(b), r);
#pragma unroll
      for (int n = 0; n < N; ++n) store_async(to + off[n], v[n], bar_r);
    }
  }
  // A row's 16 bytes v of a tile (16-bit types: 8 columns, which the 4
  // lanes of a row group hold) at byte offset off of buffer b to a quarter
  // of the other blocks, `part` (the lane's place in its group) choosing
  // which: two stores of 16 bytes a lane at C = 8 where it made 7 of 4
  // bytes, each with two mapa.
  __device__ __forceinline__ void push_row(uint32_t off, int64_t b, uint4 v, int part) const {
    for (int i = 1 + part; i < active; i += 4) {
      const uint32_t r = peer(i);
      store_async(cluster_address(buf, r) + off, v, cluster_address(bar_of(b), r));
    }
  }
  // The warp's columns of buffer b written (its own, and pushed to the
  // others): its arrival on this block's mbarrier of b.
  __device__ __forceinline__ void arrive(int64_t b) const {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbarrier_arrive(bar_of(b), threadIdx.x == 0 ? tx : 0);
  }
  // Until phase `phase` of buffer b is complete: the state is all there.
  __device__ __forceinline__ void wait(int64_t b, int64_t phase) const {
    mbarrier_wait(bar_of(b), static_cast<uint32_t>(phase & 1));
  }
};

// The rows of the batch a block (cluster) of `rows` rows at row r0 holds:
// the rows whose state its blocks exchange (the buffers' rows past B stay
// zero).
__device__ __forceinline__ uint32_t local_rows(int64_t B, int64_t r0, int64_t rows = kLocalRows) {
  return static_cast<uint32_t>(B - r0 < rows ? B - r0 : rows);
}

// Block setup of an exchange among `active` blocks, before the prologue's
// cluster barrier: thread 0 initializes both mbarriers for `arrivals`
// arrivals (none: a block that holds no tiles), each phase expecting `tx`
// bytes from the other blocks.
__device__ __forceinline__ Exchange setup_exchange(const void* buf, const void* bars, int rank,
                                                   int active, int arrivals, uint32_t tx) {
  Exchange x;
  x.buf = shared_address(buf);
  x.bar = shared_address(bars);
  x.rank = rank;
  x.active = active;
  x.tx = tx;
  if (threadIdx.x == 0 && arrivals > 0) {
    mbarrier_init(x.bar, static_cast<uint32_t>(arrivals));
    mbarrier_init(x.bar + 8, static_cast<uint32_t>(arrivals));
  }
  return x;
}

// The exchange of a step's state tiles: one arrival a warp that owns tiles;
// tile_bytes: what one warp's tile of a step's state brings to each peer.
__device__ __forceinline__ Exchange make_exchange(const void* buf, const void* bars,
                                                  const TileShare& share, int total_tiles,
                                                  uint32_t tile_bytes) {
  return setup_exchange(buf, bars, share.rank,
                        (total_tiles + share.per_block - 1) / share.per_block, share.slices,
                        static_cast<uint32_t>(total_tiles - share.slices) * tile_bytes);
}

// The state buffers hold the product's A operand as the tensor cores take
// it: float32 rounded to TF32 by the thread that writes an element, once,
// instead of by every warp that reads it (each reads all of it; without
// the conversion the float32 forward's step loop is 18-21% fewer SASS
// instructions on sm_90). kFma: as it is.
template <typename T, bool kFma = false>
__device__ __forceinline__ T operand_of(T v) {
  if constexpr (sizeof(T) == 4 && !kFma) {
    return __uint_as_float(to_tf32(__float_as_uint(v)));
  } else {
    return v;
  }
}
template <typename T, bool kFma = false>
__device__ __forceinline__ Pair<T> operand_pair(Pair<T> v) {
  if constexpr (sizeof(T) == 4 && !kFma) {
    return make_float2(operand_of(v.x), operand_of(v.y));
  } else {
    return v;
  }
}

// A fragments of chunks c .. c + G - 1 (two k tiles each: 32 bytes of a
// row apart; stopping at KC) of the state rows that `a` (this lane's
// ldmatrix address of k tile 0, see a_lane) points at, in k order (the
// weight fragments are loaded kNatural); float32 already TF32 (see
// operand_of).
template <typename T, int G>
__device__ __forceinline__ void load_a_chunks(uint32_t (&v)[G][2][4], uint32_t a, int c, int KC) {
#pragma unroll
  for (int u = 0; u < G; ++u) {
    if (c + u >= KC) break;
#pragma unroll
    for (int s = 0; s < 2; ++s) load_matrices(v[u][s], a + 32 * (2 * (c + u) + s));
  }
}

// Chunks c .. c + G - 1 (stopping at KC): the first k tile of each into
// lo, the second into hi.
template <typename T, int NT, int G>
__device__ __forceinline__ void mma_a_chunks(float (&lo)[NT][4], float (&hi)[NT][4],
                                             const uint32_t (&v)[G][2][4], int c, int KC,
                                             const uint2* frag) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < G; ++u) {
    if (c + u >= KC) break;
    const uint2* f = frag + (c + u) * 2 * NT * 32 + lane;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_tile<T>(lo[nt], v[u][0], f[nt * 32]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_tile<T>(hi[nt], v[u][1], f[(NT + nt) * 32]);
  }
}

// As mma_a_chunks, with the weight fragments of chunks c .. c + G - 1 from
// registers (wr.v[chunk][k tile][nt]; c + G <= RC, c known at compile time).
template <typename T, int NT, int G, int RC>
__device__ __forceinline__ void mma_reg_chunks(float (&lo)[NT][4], float (&hi)[NT][4],
                                               const uint32_t (&v)[G][2][4], int c, int KC,
                                               const RegChunks<RC, NT>& wr) {
#pragma unroll
  for (int u = 0; u < G; ++u) {
    if (c + u >= KC) break;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_tile<T>(lo[nt], v[u][0], wr.v[c + u][0][nt]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_tile<T>(hi[nt], v[u][1], wr.v[c + u][1][nt]);
  }
}

// The first RC chunks of this warp's weight slice (`frag`: the warp's own)
// into registers, zero past KC.
template <int NT, int RC>
__device__ __forceinline__ void load_reg_chunks(RegChunks<RC, NT>& wr, const uint2* frag, int KC) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < RC; ++c) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        wr.v[c][s][nt] = c < KC ? frag[((2 * c + s) * NT + nt) * 32 + lane] : make_uint2(0u, 0u);
      }
    }
  }
}

// This lane's ldmatrix address in a [kRows, ld] state buffer at shared
// address `buf`: lanes 0-7 give rows 0-7 of a k tile's first 16 bytes
// (the A fragment's a0), 8-15 rows 8-15 (a1; rows 0-7 again in an 8-row
// buffer, whose second row half nothing reads), 16-31 the same rows' next
// 16 bytes (a2, a3).
template <typename T, int64_t kRows = kLocalRows>
__device__ __forceinline__ uint32_t a_lane(uint32_t buf, int64_t ld, int lane) {
  const int row = (lane & 7) + (kRows > 8 ? 8 * ((lane >> 3) & 1) : 0);
  return buf + static_cast<uint32_t>(row * ld * sizeof(T)) + 16 * (lane >> 4);
}

// The product of KC chunks with A from this block's shared memory (see
// load_a_chunks: ldmatrix, no register moves to form the fragments), its
// k tiles in P independent chains (P = 2: the two tiles of a chunk; P = 4:
// and alternate groups of G = kLocalGroup chunks), summed at the end: a
// warp owns few columns here (one tile backward), and one chain of
// dependent mma over the whole K would be most of a step. The first RC
// chunks' weights come from registers (wr), the rest from `frag`.
template <typename T, int NT, int P, int RC>
__device__ __forceinline__ void local_product(float (&acc)[NT][4], uint32_t a, int KC,
                                              const uint2* frag, const RegChunks<RC, NT>& wr) {
  static_assert(P == 2 || P == 4, "two or four chains");
  constexpr int G = kLocalGroup;
  static_assert(RC % (2 * G) == 0, "whole turns of the loop in registers");
  float part[P][NT][4] = {};
  uint32_t va[G][2][4], vb[G][2][4];
  load_a_chunks<T, G>(va, a, 0, KC);
#pragma unroll
  for (int c = 0; c < RC; c += 2 * G) {
    if (c >= KC) break;
    load_a_chunks<T, G>(vb, a, c + G, KC);
    mma_reg_chunks<T, NT, G, RC>(part[0], part[1], va, c, KC, wr);
    load_a_chunks<T, G>(va, a, c + 2 * G, KC);
    mma_reg_chunks<T, NT, G, RC>(part[P - 2], part[P - 1], vb, c + G, KC, wr);
  }
  for (int c = RC; c < KC; c += 2 * G) {
    load_a_chunks<T, G>(vb, a, c + G, KC);
    mma_a_chunks<T, NT, G>(part[0], part[1], va, c, KC, frag);
    load_a_chunks<T, G>(va, a, c + 2 * G, KC);
    mma_a_chunks<T, NT, G>(part[P - 2], part[P - 1], vb, c + G, KC, frag);
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = part[0][nt][e] + part[1][nt][e];
      if constexpr (P == 4) v += part[2][nt][e] + part[3][nt][e];
      acc[nt][e] = v;
    }
  }
}

// Rows r0 .. r0 + kRows - 1 (those below B) of a [B, width] matrix `src`,
// its first K columns, into a state buffer `dst` of row stride ld, as the
// product's operand (see operand_of).
template <typename T, bool kFma, int64_t kRows>
__device__ __forceinline__ void copy_rows(T* dst, int64_t ld, const T* src, int64_t width,
                                          int64_t B, int64_t r0, int64_t K) {
  const int k_n = static_cast<int>(K);
  const int rows = static_cast<int>(local_rows(B, r0, kRows));
  const T* from = src + r0 * width;
  batched_copy(
      rows * k_n, [&](int e) { return operand_of<T, kFma>(from[(e / k_n) * width + e % k_n]); },
      [&](int e, T v) { dst[(e / k_n) * ld + e % k_n] = v; });
}

// Zero `count` elements of shared memory (T-sized) at p.
template <typename T>
__device__ __forceinline__ void zero_shared(T* p, int64_t count) {
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) p[e] = to_storage<T>(0.f);
}

// -- full float32: the product on the FMA units (kFma) ----------------------------------------
//
// Without TF32 (torch's float32 matmul precision "highest") the block-local
// kernels multiply in float32 on the FMA units, each warp's weights in
// registers for the whole launch (none in shared memory). The 8 lanes that
// hold the same columns in the accumulator layout (lane % 4) split k: lane
// group g = lane / 4 takes k = 32 m + 4 g + e (e < 4), so that the 16-byte
// state loads of the 8 groups fall in 32 different banks. Each lane sums
// its k for all of the block's rows, and three rounds of shuffles leave it
// its own row's (lane / 4) sums: the tensor cores' accumulator layout,
// whose cell code runs unchanged.

// k of one turn of the FMA product (fma_product): 8 lane groups of 4.
constexpr int kFmaK = 32;
// KM turns of k: forward (K = S) 1, 2 or 4 for S up to 32 (one block), 64
// (a cluster, kSmallK) or 128 (a cluster); backward (K = 3S) three times
// that. NT column tiles a warp: forward three (the gates), backward one.
template <bool kCluster, bool kSmallK>
constexpr int kFmaTurns = kCluster ? (kSmallK ? 2 : 4) : 1;
// The largest state size of a variant.
template <bool kCluster, bool kSmallK>
constexpr int64_t kFmaMaxS = int64_t(kFmaK) * kFmaTurns<kCluster, kSmallK>;
// Whether a cluster's product of state size S fits the kSmallK variant (as
// local_small_k for the tensor cores').
inline bool fma_small_k(int64_t S) { return S <= kFmaMaxS<true, true>; }
// The forward's turns of C blocks a cluster at state size S (the variant
// with_local_variant picks).
inline int fma_turns(int C, int64_t S) {
  return C == 1 ? kFmaTurns<false, false>
                : (fma_small_k(S) ? kFmaTurns<true, true> : kFmaTurns<true, false>);
}
// The state buffers' rows hold every turn the product reads (the padding
// zero): no branch on K or on the rows in the product, whose loads and
// FMAs then run as one straight block (with a branch between rows, each
// row's load waited its whole latency: H100, S = 128, B8, 2.5 us a
// forward step against 1.1 on TF32). After them the mbarriers, then the
// split's exchange (a tile's 32 lanes' NT pairs of sums).
inline size_t local_fma_buffer_bytes(int64_t S, int C, bool forward) {
  const int64_t row = (forward ? 1 : 3) * int64_t(kFmaK) * fma_turns(C, S);
  return 2 * kLocalRowsOf<true> * local_ld<float>(row) * sizeof(float);
}
inline size_t local_fma_smem(int64_t S, int C, bool forward, int split) {
  const int nt = forward ? 3 * kLocalQ : kLocalQ;
  return local_fma_buffer_bytes(S, C, forward) + kLocalBarrierBytes +
         split_sums_bytes(split, local_block_tiles(S, kLocalQ, C), nt, 2);
}

// kSplit = 2 (a cluster's S = 128 variant, where its blocks fit): two warps
// share a tile's product, each half of its turns (warp w of a block's 2n:
// tile w % n, half w / n), and the first adds the second's sums (through
// shared memory) and runs the cell. With one warp an SMSP the FMAs issued
// at about one in 2.7 clocks (H100, S = 128, B8: the step 2.2 us, 1.0
// without the product; split, 1.65). The tensor cores' cluster forward
// splits a tile's chunks of k the same way where they pass the 8 a warp
// holds in registers (16-bit S = 512 B8: 2.3-2.4 us a step, 2.0 split).
//
// This warp's column tile in its block and its half of the tile's turns:
// warp w of a block's kSplit n takes tile w % n, half w / n.
template <int kSplit>
struct TileWarp {
  int tile, khalf;
  __device__ __forceinline__ explicit TileWarp(const TileShare& share) {
    const int w = static_cast<int>(threadIdx.x >> 5);
    tile = kSplit > 1 ? w % share.per_block : w;
    khalf = kSplit > 1 ? w / share.per_block : 0;
  }
};

// Named barrier `id` of the kSplit warps of a split tile: the others
// arrive once their sums are in shared memory, the first waits for them.
template <int kSplit>
__device__ __forceinline__ void split_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(32 * kSplit) : "memory");
}
template <int kSplit>
__device__ __forceinline__ void split_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(32 * kSplit) : "memory");
}
// The split's sums of tile `tile` (NT tiles of E elements a lane: 2, the
// FMA product's one row half; 4, the tensor cores' two) at `scratch`: the
// other warps (khalf 1 .. kSplit - 1) store their acc, the first adds
// them to its own, in that order.
template <int NT, int E, int kSplit = 2>
__device__ __forceinline__ void combine_halves(float (&acc)[NT][4], float* scratch, int tile,
                                               int khalf) {
  static_assert(E == 2 || E == 4, "one or both row halves");
  const int lane = threadIdx.x & 31;
  float* const base = scratch + (tile * (kSplit - 1) * 32 + lane) * NT * E;
  if (khalf) {
    float* at = base + (khalf - 1) * 32 * NT * E;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if constexpr (E == 4) {
        reinterpret_cast<float4*>(at)[nt] =
            make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
      } else {
        reinterpret_cast<float2*>(at)[nt] = make_float2(acc[nt][0], acc[nt][1]);
      }
    }
    split_arrive<kSplit>(1 + tile);
  } else {
    split_sync<kSplit>(1 + tile);
#pragma unroll
    for (int k = 1; k < kSplit; ++k) {
      const float* at = base + (k - 1) * 32 * NT * E;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if constexpr (E == 4) {
          const float4 v = reinterpret_cast<const float4*>(at)[nt];
          acc[nt][0] += v.x;
          acc[nt][1] += v.y;
          acc[nt][2] += v.z;
          acc[nt][3] += v.w;
        } else {
          const float2 v = reinterpret_cast<const float2*>(at)[nt];
          acc[nt][0] += v.x;
          acc[nt][1] += v.y;
        }
      }
    }
  }
}

// v[m][e][nt][c] (an array of one turn where KM is 0, unused). A struct,
// like RegChunks, for nvcc 12.4's front end. E: the k of a turn each lane
// group takes, 4 (turns of kFmaK = 32) or 2 (turns of 16: the backward by
// partial sums, whose K is a multiple of 16, not always of 32).
template <int KM, int NT, int E = 4>
struct FmaWeights {
  float v[KM > 0 ? KM : 1][E][NT][2];
};

// This lane's weights of turns m0 .. m0 + KM - 1: w.v[m][e][nt][c] = at(k,
// nt, c) for k = 8 E (m0 + m) + E g + e below K, zero past it.
template <int KM, int NT, int E = 4, typename At>
__device__ __forceinline__ void load_fma_weights(FmaWeights<KM, NT, E>& w, int64_t K, int m0,
                                                 At at) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int m = 0; m < KM; ++m) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t k = int64_t(8 * E) * (m0 + m) + E * g + e;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) w.v[m][e][nt][c] = k < K ? at(k, nt, c) : 0.f;
      }
    }
  }
}

// acc = part summed over the 8 lane groups (lane / 4), each lane left its
// own row lane / 4 (elements 0 and 1; 2 and 3 zero), half the rows a
// round: after the round over lane bit 16, 8, 4 a lane keeps the rows
// whose bit 4, 2, 1 is that lane bit, so the last leaves it row lane / 4.
template <int NT>
__device__ __forceinline__ void sum_lane_groups(const float (&part)[8][NT][2],
                                                float (&acc)[NT][4]) {
  const int lane = threadIdx.x & 31;
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float p4[4][NT][2], p2[2][NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float lo = part[i][nt][c], hi = part[i + 4][nt][c];
        p4[i][nt][c] = (b4 ? hi : lo) + __shfl_xor_sync(0xffffffffu, b4 ? lo : hi, 16);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float lo = p4[i][nt][c], hi = p4[i + 2][nt][c];
        p2[i][nt][c] = (b3 ? hi : lo) + __shfl_xor_sync(0xffffffffu, b3 ? lo : hi, 8);
      }
      const float lo = p2[0][nt][c], hi = p2[1][nt][c];
      acc[nt][c] = (b2 ? hi : lo) + __shfl_xor_sync(0xffffffffu, b2 ? lo : hi, 4);
      acc[nt][2 + c] = 0.f;
    }
  }
}

// E consecutive floats at p (16 or 8 bytes, aligned).
template <int E>
__device__ __forceinline__ void load_consecutive(const float* p, float (&x)[E]) {
  static_assert(E == 4 || E == 2, "16 or 8 bytes");
  if constexpr (E == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else {
    const float2 v = *reinterpret_cast<const float2*>(p);
    x[0] = v.x;
    x[1] = v.y;
  }
}

// acc = the 8 rows of the state buffer `buf` (row stride ld, KM whole
// turns; rows past B and k past K zero) times this warp's weights, as the
// tensor cores' accumulator: elements 0 and 1 this lane's row lane / 4,
// columns 2 (lane % 4) + {0, 1} of tile nt; 2 and 3 (the second row half)
// zero. A turn's loads (E floats a lane group) are 8 E consecutive floats
// of a row: no bank conflict.
template <int KM, int NT, int E = 4>
__device__ __forceinline__ void fma_product(float (&acc)[NT][4], const float* buf, int64_t ld,
                                            const FmaWeights<KM, NT, E>& w) {
  const int lane = threadIdx.x & 31;
  const float* a = buf + E * (lane >> 2);
  float part[8][NT][2] = {};
#pragma unroll
  for (int m = 0; m < KM; ++m) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float x[E];
      load_consecutive<E>(a + r * ld + 8 * E * m, x);
#pragma unroll
      for (int e = 0; e < E; ++e) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) part[r][nt][c] = fmaf(x[e], w.v[m][e][nt][c], part[r][nt][c]);
        }
      }
    }
  }
  sum_lane_groups<NT>(part, acc);
}

// -- per-thread places ----------------------------------------------------------------------
//
// What a thread of column tile `tile` owns, fixed for the launch: element
// offsets (int32: a block row's element offsets are below 2^31, as the
// plan's grid bounds B) of its pairs (half, q) in a step's state ([B, S]),
// gates ([B, 3S], gate g's) and the block's shared state buffer, and
// whether the pair is in the matrix.
template <int Q>
struct Places {
  int state[2][Q], gate[2][Q][3], buf[2][Q];
  bool ok[2][Q];
  int64_t row[2];
  int64_t col;  // the first column of the thread's first pair
  __device__ __forceinline__ Places(int64_t B, int64_t S, int64_t r0, int64_t ld_buf, int tile,
                                    int lane) {
    col = 8 * Q * tile + 2 * (lane & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row[half] = r0 + (lane >> 2) + 8 * half;
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        const int64_t j = col + 8 * q;
        ok[half][q] = row[half] < B && j < S;
        // A row past B reads row B - 1 (its prefetch, unused; see
        // prefetch_p): every store is of rows in the matrix.
        const int64_t r = std::min(row[half], B - 1);
        state[half][q] = static_cast<int>(r * S + j);
#pragma unroll
        for (int g = 0; g < 3; ++g) gate[half][q][g] = static_cast<int>(r * 3 * S + g * S + j);
        buf[half][q] = static_cast<int>((row[half] - r0) * ld_buf + j);
      }
    }
  }
};

// -- forward --------------------------------------------------------------------------------
//
// The forward product's independent mma chains (local_product's P): four
// in a cluster's kSmallK variant (16-bit S <= 128, float32 S <= 64), two
// elsewhere. Measured (H100, T1024, us a forward step, two rounds each,
// two chains / four): float16 S = 128 at B8 1.03, 1.01 / 0.84, 0.95 and
// B256 1.69, 1.56 / 1.58, 1.51; bfloat16 B8 1.25, 1.02 / 1.01, 0.97. Four
// in the other cluster variants (at 254 registers) were slower at float16
// S = 512 B8 (2.21, 2.34 / 2.41, 2.46); one block alone spilled with four.
template <bool kCluster, bool kSmallK>
constexpr int kForwardChains = kCluster && kSmallK ? 4 : 2;

// The block-local kernels' cell math: full float32's (kFma) accurate one,
// else the tensor-core kernels' (TcMathFor).
template <typename T, bool kFma>
using LocalMath = std::conditional_t<kFma, AccurateMath, TcMathFor<T>>;

// kPacked as in forward_tc_kernel: a row runs while it is below the step's
// batch size and writes h_n / c_n at its own last step; alternate_cells as
// there. The grid is (C, ceil(B / rows)); kCluster: C > 1, its rows' C
// blocks one cluster (sm_90). The kernels (forward_tc_local_kernel,
// forward_fma_local_kernel) are this function with their products. kRows:
// batch rows a cluster, 16 or 8 (kFma: 8).
template <typename T, int Q, bool kPacked, bool kCluster, bool kSmallK, bool kFma, int kSplit,
          int64_t kRows>
__device__ __forceinline__ void forward_local(int64_t steps, int64_t B, int64_t S, T* gates,
                                              const T* bias, const T* h0, const T* w_h,
                                              int64_t ld_w, const T* c0, T* outs, T* cells,
                                              bool alternate_cells, T* h_n, T* c_n,
                                              const int64_t* bs) {
  constexpr int NT = 3 * Q;
  constexpr int kHalves = local_halves<kFma, kRows>();
  using Math = LocalMath<T, kFma>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int KC = static_cast<int>((S + kChunk<T> - 1) / kChunk<T>), KT = 2 * KC;
  // kFma: the row's turns of k, KM of them this warp's (kSplit warps a tile).
  static_assert(!kFma || kFmaTurns<kCluster, kSmallK> % kSplit == 0, "whole turns a warp");
  constexpr int KM = kFma ? kFmaTurns<kCluster, kSmallK> / kSplit : 0;
  const int64_t ld = local_ld<T>(kFma ? KM * kSplit * kFmaK : S);
  // 16-bit h pushed a row of a tile at a time (Exchange::push_row) in the
  // cluster kernels past the small-K ones, one warp a tile. Measured (H100,
  // T1024, forward step): float16 B8 S256, 8 blocks, 1.16-1.22 -> 0.99-1.10
  // us; slower at 4 blocks (S128, small K: 0.82-0.87 -> 0.91-0.98, the 4
  // shuffles cost more than the 2 stores saved) and in the split kernels
  // (S512: bfloat16 1.91-2.01 -> 2.05-2.12). Chosen at compile time: a
  // branch on the cluster's size made every variant slower.
  constexpr bool kRowPushes = kCluster && sizeof(T) == 2 && !kSmallK && kSplit == 1;
  const TileShare share(S, Q);
  const int first = share.first, slices = share.slices;
  uint2* frag = reinterpret_cast<uint2*>(smem);
  // h of the rows, two buffers: step t reads (t + 1) % 2 (h_{t-1}) and
  // writes t % 2.
  T* hbuf = reinterpret_cast<T*>(smem + (kFma ? 0 : share.per_block * weight_bytes(KT, NT)));
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int rows = static_cast<int>(local_rows(B, r0, kRows));
  // Slice w, tile nt = g * Q + q: gate g, columns 8 (Q (first + w) + q) .. + 7
  // (of W_h^T, see w_hT_at). Both loaders map the columns, each its own way:
  // one named lambda for both (the fallback reading through the row
  // pointer) made the float16 B8 S256 forward 11% slower at T16 (H200,
  // kernel time 28.0 against 25.2 us), its prologue 0.5 us longer.
  if constexpr (!kFma) {
    if (rows_vectorizable(w_h, ld_w, S)) {
      load_fragment_rows<T, FragLayout::kNatural>(
          smem, slices, KC, NT, S, [&](int w, int nt, int n) -> const T* {
            const int64_t j = 8 * (Q * (first + w) + nt % Q) + n;
            return j < S ? w_h + ((nt / Q) * S + j) * ld_w : nullptr;
          });
    } else {
      load_weight_slices<T, true>(frag, slices, KT, NT,
                                  [&](int w, int64_t k, int nt, int n) -> uint32_t {
                                    const int64_t j = 8 * (Q * (first + w) + nt % Q) + n;
                                    if (k >= S || j >= S) return 0;
                                    return bits_of(w_hT_at(w_h, ld_w, k, (nt / Q) * S + j));
                                  });
    }
  }
  zero_shared(hbuf, 2 * kRows * ld);
  __syncthreads();
  copy_rows<T, kFma, kRows>(hbuf + kRows * ld, ld, h0, S, B, r0, S);
  Exchange x;
  if constexpr (kCluster) {
    x = make_exchange(hbuf, hbuf + 2 * kRows * ld, share, local_tiles(S, Q),
                      rows * 8 * Q * sizeof(T));
  }
  local_barrier<kCluster>();  // the cluster's buffers are ready before step 0 writes them

  // warp: the block's tile of this warp; khalf: its half of a split tile's
  // turns (the second half's warp runs the product only).
  const TileWarp<kSplit> tw(share);
  const int warp = tw.tile, khalf = tw.khalf;
  const int lane = threadIdx.x & 31;
  float* scratch = reinterpret_cast<float*>(hbuf + 2 * kRows * ld) + kLocalBarrierBytes / 4;
  const int64_t step_gates = B * 3 * S, step_state = B * S;
  const bool owner = warp < slices;
  if (kCluster && !owner) return;  // no tiles: no step waits for this warp
  // Tensor cores, kSplit = 2: the warp's half of the tile's chunks, kc0 ..
  // kc0 + kcn - 1 (weight fragments, and 64 bytes of a state row, a chunk).
  const int kc0 = kSplit > 1 && !kFma ? khalf * ((KC + 1) / 2) : 0;
  const int kcn = kSplit > 1 && !kFma ? (khalf ? KC - kc0 : (KC + 1) / 2) : KC;
  const uint2* my_frag = frag + warp * KT * NT * 32 + kc0 * 2 * NT * 32;
  constexpr int RC = kFma ? 0 : kLocalForwardRegChunks<T, kCluster, kSmallK>;
  RegChunks<RC, NT> wr;
  if (owner && !kFma) load_reg_chunks<NT, RC>(wr, my_frag, kcn);
  const Places<Q> at(B, S, r0, ld, first + warp, lane);
  // kFma: gate g's columns as tile g * Q + q.
  FmaWeights<KM, NT> wf;
  if (kFma && owner) {
    load_fma_weights<KM, NT>(wf, S, khalf * KM, [&](int64_t k, int nt, int c) {
      const int64_t j = at.col + 8 * (nt % Q) + c;
      return j < S ? to_acc(w_hT_at(w_h, ld_w, k, (nt / Q) * S + j)) : 0.f;
    });
  }
  const uint32_t a_of_buf = a_lane<T, kRows>(shared_address(hbuf), ld, lane) + 64 * kc0;
  const uint32_t buf_bytes = static_cast<uint32_t>(kRows * ld * sizeof(T));

  float c_reg[2][Q][2] = {}, b_reg[Q][3][2] = {};
  // P of (half, q, gate), two columns a register, in two sets: the step
  // loop runs two steps a turn, step t on set t % 2, whose loads for step
  // t + 2 it issues once the cell has used it, so every load has two steps
  // to arrive (a load from global memory takes longer than one; a copy
  // from set to set would wait for it).
  Pair<T> p_set[2][2][Q][3] = {};
  // P_t from g_t, the gates of step t: one straight run of loads, none
  // skipped (rows past B read row B - 1, a step past the last step 0,
  // unused), whose registers the step reads whether or not its rows run
  // (see floats_of): branches around either made ptxas wait for the loads
  // in flight where it reused a register (H100, 16-bit forward at B64:
  // 0.2 us a step).
  auto prefetch_p = [&](Pair<T>(&p)[2][Q][3], int64_t t, const T* g_t) {
    const T* src = t < steps ? g_t : gates;
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
#pragma unroll
      for (int q = 0; q < Q; ++q) {
#pragma unroll
        for (int g = 0; g < 3; ++g) p[half][q][g] = load_pair(src + at.gate[half][q][g]);
      }
    }
  };
  if (owner) {
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (at.ok[half][q]) load_floats(c0 + at.state[half][q], c_reg[half][q]);
      }
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) {
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        if (at.col + 8 * q < S) load_floats(bias + g * S + at.col + 8 * q, b_reg[q][g]);
      }
    }
    prefetch_p(p_set[0], 0, gates);
    prefetch_p(p_set[1], 1, gates + step_gates);
  }

  // Step t's rows of gates, outs and cells: advanced a step at a time (no
  // 64-bit products a step).
  T* g_t = gates;
  T* o_t = outs;
  T* c_t = cells;

  // Step t with P in p; false where a packed run's block is done.
  auto step = [&](int64_t t, Pair<T>(&p)[2][Q][3]) -> bool {
    const bool last = t == steps - 1;
    const int64_t n = kPacked ? rows_at(bs, B, steps, t) : B;
    const int64_t n_next = kPacked ? rows_at(bs, B, steps, t + 1) : 0;
    // h_{t-1} is in buffer (t - 1) % 2, its phase (t - 1) / 2. Waited for
    // by a block that is done, too: nothing may write to it once it exits.
    if (kCluster && t > 0) x.wait((t - 1) & 1, (t - 1) >> 1);
    if (kPacked && r0 >= n) return false;  // sizes do not increase: this block is done
    const int64_t write_at = (t & 1) * kRows * ld;
    float acc[NT][4];
    if (owner) {
      if constexpr (kFma) {
        fma_product<KM, NT>(acc, hbuf + ((t + 1) & 1) * kRows * ld + khalf * KM * kFmaK, ld, wf);
        if constexpr (kSplit > 1) combine_halves<NT, 2, kSplit>(acc, scratch, warp, khalf);
      } else {
        local_product<T, NT, kForwardChains<kCluster, kSmallK>, RC>(
            acc, a_of_buf + ((t + 1) & 1) * buf_bytes, kcn, my_frag, wr);
        if constexpr (kSplit > 1) combine_halves<NT, 4>(acc, scratch, warp, khalf);
      }
    }
    if (owner && khalf == 0) {
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          float rec[3][2], z[3][2];
          gates_of_pair<Q>(acc, q, half, rec);
#pragma unroll
          for (int g = 0; g < 3; ++g) {
            floats_of<T>(p[half][q][g], z[g]);  // whether or not the row runs: see prefetch_p
#pragma unroll
            for (int e = 0; e < 2; ++e) z[g][e] += rec[g][e] + b_reg[q][g][e];
          }
          const bool live = at.ok[half][q] && !(kPacked && at.row[half] >= n);
          // Rows done (a packed run) push zeros: the peers count the bytes
          // of every row below B.
          Pair<T> pre[3], hv = {}, cv;
          if (live) forward_pair_from<T, Math>(z, c_reg[half][q], pre, hv, cv);
          // h first to the peers and the block's buffer: the next step
          // waits for it.
          const Pair<T> h_op = operand_pair<T, kFma>(hv);
          if constexpr (kRowPushes) {
            // The row's 8 columns gathered in each lane of its group (the
            // whole warp shuffles), which sends them to its quarter of the
            // peers (see Exchange::push_row).
            const int group = lane & ~3;
            const uint4 v = make_uint4(__shfl_sync(0xffffffffu, h_op, group),
                                       __shfl_sync(0xffffffffu, h_op, group + 1),
                                       __shfl_sync(0xffffffffu, h_op, group + 2),
                                       __shfl_sync(0xffffffffu, h_op, group + 3));
            if (!last && at.row[half] < B) {  // no step reads the last h
              const int64_t row_at = write_at + at.buf[half][q] - 2 * (lane & 3);
              x.push_row(static_cast<uint32_t>(row_at * sizeof(T)), t & 1, v, lane & 3);
            }
          }
          if (kCluster && !kRowPushes && !last && at.row[half] < B) {  // as above
            const uint32_t off[1] = {
                static_cast<uint32_t>((write_at + at.buf[half][q]) * sizeof(T))};
            const Pair<T> v[1] = {h_op};
            x.push(off, t & 1, v);
          }
          if (!live) continue;
          store_pair(hbuf + write_at + at.buf[half][q], h_op);
#pragma unroll
          for (int g = 0; g < 3; ++g) store_pair(g_t + at.gate[half][q][g], pre[g]);
          store_pair(o_t + at.state[half][q], hv);
          store_pair(c_t + at.state[half][q], cv);
          if (kPacked ? at.row[half] >= n_next : last) {  // the row's last step
            store_pair(h_n + at.state[half][q], hv);
            store_pair(c_n + at.state[half][q], cv);
          }
        }
      }
      prefetch_p(p, t + 2, g_t + 2 * step_gates);
    }
    if constexpr (kCluster) {
      if (!last && khalf == 0) x.arrive(t & 1);
    } else {
      __syncthreads();  // h_t written before the next step reads it
    }
    g_t += step_gates;
    o_t += step_state;
    // To slot cell_slot(t + 1, alternate_cells), by an addition.
    c_t += alternate_cells && (t & 1) ? -step_state : step_state;
    return true;
  };
  for (int64_t t = 0; t < steps; t += 2) {
    if (!step(t, p_set[0]) || t + 1 >= steps || !step(t + 1, p_set[1])) break;
  }
}

// kSplit = 2: two warps a tile, each half its chunks of k (a cluster's
// forward past the 8 chunks a warp holds in registers; see
// local_forward_split in lltm_sequence_cuda.cu).
// kRows: batch rows a cluster (16, or 8 in a cluster; see kLocalEightRows).
template <typename T, int Q, bool kPacked, bool kCluster, bool kSmallK, int kRows, int kSplit>
__global__ void __launch_bounds__(local_max_threads<kCluster>(), 1)
    forward_tc_local_kernel(int64_t steps, int64_t B, int64_t S, T* gates, const T* bias,
                            const T* h0, const T* w_h, int64_t ld_w, const T* c0, T* outs, T* cells,
                            bool alternate_cells, T* h_n, T* c_n, const int64_t* bs) {
  forward_local<T, Q, kPacked, kCluster, kSmallK, false, kSplit, kRows>(
      steps, B, S, gates, bias, h0, w_h, ld_w, c0, outs, cells, alternate_cells, h_n, c_n, bs);
}
// Full float32 (no TF32): the product on the FMA units, kSplit warps a tile.
template <bool kPacked, bool kCluster, bool kSmallK, int kSplit>
__global__ void __launch_bounds__(local_max_threads<kCluster>(), 1)
    forward_fma_local_kernel(int64_t steps, int64_t B, int64_t S, float* gates, const float* bias,
                             const float* h0, const float* w_h, int64_t ld_w, const float* c0,
                             float* outs, float* cells, bool alternate_cells, float* h_n,
                             float* c_n, const int64_t* bs) {
  forward_local<float, kLocalQ, kPacked, kCluster, kSmallK, true, kSplit, kLocalRowsOf<true>>(
      steps, B, S, gates, bias, h0, w_h, ld_w, c0, outs, cells, alternate_cells, h_n, c_n, bs);
}

// -- backward -------------------------------------------------------------------------------
//
// What backward_local and backward_partial share: the chunk's step loop,
// and the cells' side of a step (a thread's inputs, its cells, and the
// chunk's end).

// A backward chunk's steps t1 - 1 down to t0, step(t, inputs) each, the two
// input sets alternating (a step prefetches the inputs of the step two
// later into its own set).
template <typename Step, typename Inputs>
__device__ __forceinline__ void steps_down(int64_t t1, int64_t t0, Step&& step,
                                           Inputs (&in_set)[2]) {
  for (int64_t t = t1 - 1; t >= t0; t -= 2) {
    step(t, in_set[0]);
    if (t - 1 < t0) break;
    step(t - 1, in_set[1]);
  }
}

// A thread's inputs of a backward step (grad_outputs[t], G_t of the three
// gates, c_{t-1}; two columns a register) for its pairs (half, q).
template <typename T, int Q>
struct BackwardInputs {
  Pair<T> go[2][Q], g[2][Q][3], c[2][Q];
};

// What the cells read, fixed for the launch: backward_tc_kernel's
// arguments; one: the pairs are aligned (pairs_aligned).
template <typename T>
struct BackwardArgs {
  const T *go, *ghn, *gates, *cells, *c0;
  int64_t t0, step_state;
  bool one;
};

// Step t's inputs from g_t (its gates) and c_t (its cells: c_{t-1} is
// c_t - step_state, or c0): as the forward's prefetch_p, straight runs of
// loads, none skipped (rows past B read row B - 1; a step before the
// chunk, or grad_outputs where there are none, read valid memory, unused).
template <typename T, int Q, int kHalves>
__device__ __forceinline__ void prefetch_backward(BackwardInputs<T, Q>& in,
                                                  const BackwardArgs<T>& a, const Places<Q>& at,
                                                  int64_t t, const T* g_t, const T* c_t) {
  const bool run = t >= a.t0;
  const T* g_src = run ? g_t : a.gates;
  const T* c_src = run && t > 0 ? c_t - a.step_state : a.c0;
  const T* go_src = a.go != nullptr ? a.go + (run ? t : a.t0) * a.step_state : a.cells;
  auto load_all = [&](auto load) {
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        in.go[half][q] = load(go_src + at.state[half][q]);
#pragma unroll
        for (int g = 0; g < 3; ++g) in.g[half][q][g] = load(g_src + at.gate[half][q][g]);
        in.c[half][q] = load(c_src + at.state[half][q]);
      }
    }
  };
  // One branch for the whole set where the pairs may be unaligned.
  if (sizeof(T) == 4 || a.one) {
    load_all([](const T* p) { return load_pair_if<T>(p, true); });
  } else {
    load_all([](const T* p) { return load_two<T>(p); });
  }
}

// The cell of pair (half, q) with the recurrent gradient rec: v its dG
// (rounded as stored; zero outside the matrix), dc and the column sums
// updated. live / row_last: whether the row runs at this step, and whether
// it is the row's last.
template <typename T, int Q, typename Math>
__device__ __forceinline__ void backward_cell(const BackwardInputs<T, Q>& in,
                                              const BackwardArgs<T>& a, const Places<Q>& at,
                                              int half, int q, const float (&rec)[2], bool live,
                                              bool row_last, float (&dc)[2], float (&sums)[3][Q][2],
                                              Pair<T> (&v)[3]) {
  // The inputs read whether or not the row runs: see prefetch_backward.
  float gof[2], gf[3][2], cf[2];
  floats_of<T>(in.go[half][q], gof);
  floats_of<T>(in.c[half][q], cf);
#pragma unroll
  for (int g = 0; g < 3; ++g) floats_of<T>(in.g[half][q][g], gf[g]);
#pragma unroll
  for (int g = 0; g < 3; ++g) v[g] = Pair<T>{};
  if (!at.ok[half][q]) return;
  if (a.go == nullptr) gof[0] = gof[1] = 0.f;
  float d[3][2];
  backward_pair_from<T, Math>(live, rec, gof,
                              row_last && a.ghn != nullptr ? a.ghn + at.state[half][q] : nullptr,
                              gf, cf, dc, d);
#pragma unroll
  for (int g = 0; g < 3; ++g) {
    float r0v, r1v;
    v[g] = pack_rounded<T>(d[g][0], d[g][1], r0v, r1v);
    sums[g][q][0] += d[g][0];
    sums[g][q][1] += d[g][1];
  }
}

// The chunk's end: its last step is the earliest, so dc_reg is d c_{t0 - 1},
// to dc; the column sums over the block's rows (lanes with the same lane %
// 4 hold the same columns) added to the block's row of partial sums: this
// thread alone adds to these entries.
template <typename T, int Q, int kHalves>
__device__ __forceinline__ void finish_backward(const Places<Q>& at, const float (&dc_reg)[2][Q][2],
                                                const float (&sums)[3][Q][2], T* dc, float* partial,
                                                int64_t S) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (!at.ok[half][q]) continue;
      float a, b;
      store_pair(dc + at.state[half][q],
                 pack_rounded<T>(dc_reg[half][q][0], dc_reg[half][q][1], a, b));
    }
  }
#pragma unroll
  for (int g = 0; g < 3; ++g) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = sum_over_rows(sums[g][q][e]);
        const int64_t j = at.col + 8 * q + e;
        if (lane < 4 && j < S) partial[static_cast<int64_t>(blockIdx.y) * 3 * S + g * S + j] += v;
      }
    }
  }
}

//
// Steps t1 - 1 down to t0 of a backward chunk, with backward_tc_kernel's
// arguments and outputs: dG of step t to slot t - t0 of dG (and to shared
// memory, where the next step's product reads it), the chunk's first step
// reading slot K (the later chunk's last dG), dc of step t0 - 1 at the end,
// the bias-gradient sums of the block's rows added to row blockIdx.y of
// `partial` (summed in registers over the chunk, in a fixed order). The
// grid and clusters as the forward's; the kernels as forward_local's.
template <typename T, int Q, bool kPacked, bool kCluster, bool kSmallK, bool kFma, int kSplit,
          int64_t kRows>
__device__ __forceinline__ void backward_local(int64_t T_, int64_t t0, int64_t t1, int64_t K,
                                               int64_t B, int64_t S, const T* go, const T* ghn,
                                               const T* gcn, T* dG, const T* w_h, int64_t ld_w,
                                               T* dc, const T* gates, const T* cells, const T* c0,
                                               float* partial, const int64_t* bs) {
  constexpr int NT = Q;
  constexpr int kHalves = local_halves<kFma, kRows>();
  using Math = LocalMath<T, kFma>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t S3 = 3 * S;
  const int KC = static_cast<int>((S3 + kChunk<T> - 1) / kChunk<T>), KT = 2 * KC;
  // kFma: the row's turns of k, KM of them this warp's (kSplit warps a tile).
  static_assert(!kFma || 3 * kFmaTurns<kCluster, kSmallK> % kSplit == 0, "whole turns a warp");
  constexpr int KM = kFma ? 3 * kFmaTurns<kCluster, kSmallK> / kSplit : 0;
  const int64_t ld = local_ld<T>(kFma ? KM * kSplit * kFmaK : S3);
  const TileShare share(S, Q);
  const int first = share.first, slices = share.slices;
  uint2* frag = reinterpret_cast<uint2*>(smem);
  // dG of the rows, two buffers: step t reads dG_{t+1} from buffer (t + 1)
  // % 2 and writes dG_t to t % 2.
  T* gbuf = reinterpret_cast<T*>(smem + (kFma ? 0 : share.per_block * weight_bytes(KT, NT)));
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int rows = static_cast<int>(local_rows(B, r0, kRows));
  // Slice w, tile nt: columns 8 (Q (first + w) + nt) .. + 7 of W_h ([3S, S],
  // rows of stride ld_w).
  if constexpr (!kFma) {
    load_weight_slices<T, true>(frag, slices, KT, NT,
                                [&](int w, int64_t k, int nt, int n) -> uint32_t {
                                  const int64_t j = 8 * (Q * (first + w) + nt) + n;
                                  if (k >= S3 || j >= S) return 0;
                                  return bits_of(w_h[k * ld_w + j]);
                                });
  }
  zero_shared(gbuf, 2 * kRows * ld);
  __syncthreads();
  const int64_t step_gates = B * S3, step_state = B * S;
  if (t1 < T_) {  // the later chunk's last dG (slot K) for the chunk's first step
    copy_rows<T, kFma, kRows>(gbuf + (t1 & 1) * kRows * ld, ld, dG + K * step_gates, S3, B, r0, S3);
  }
  Exchange x;
  if constexpr (kCluster) {
    x = make_exchange(gbuf, gbuf + 2 * kRows * ld, share, local_tiles(S, Q),
                      3 * rows * 8 * Q * sizeof(T));
  }
  local_barrier<kCluster>();  // the cluster's buffers are ready before the first step writes them

  // warp, khalf: as the forward's.
  const TileWarp<kSplit> tw(share);
  const int warp = tw.tile, khalf = tw.khalf;
  const int lane = threadIdx.x & 31;
  float* scratch = reinterpret_cast<float*>(gbuf + 2 * kRows * ld) + kLocalBarrierBytes / 4;
  const bool owner = warp < slices;
  if (kCluster && !owner) return;  // no tiles: no step waits for this warp
  const uint2* my_frag = frag + warp * KT * NT * 32;
  constexpr int RC = kFma ? 0 : kLocalBackwardRegChunks<kCluster, kSmallK>;
  RegChunks<RC, NT> wr;
  if (owner && !kFma) load_reg_chunks<NT, RC>(wr, my_frag, KC);
  const Places<Q> at(B, S, r0, ld, first + warp, lane);
  FmaWeights<KM, NT> wf;
  if (kFma && owner) {
    load_fma_weights<KM, NT>(wf, S3, khalf * KM, [&](int64_t k, int nt, int c) {
      const int64_t j = at.col + 8 * nt + c;
      return j < S ? to_acc(w_h[k * ld_w + j]) : 0.f;
    });
  }
  const uint32_t a_of_buf = a_lane<T, kRows>(shared_address(gbuf), ld, lane);
  const uint32_t buf_bytes = static_cast<uint32_t>(kRows * ld * sizeof(T));

  float dc_reg[2][Q][2] = {};
  // Column sums of the block's dG over the chunk (this thread's rows).
  float sums[3][Q][2] = {};
  // Step t's inputs in two sets, as the forward's P: step t uses set
  // (t1 - 1 - t) % 2 and then loads step t - 2 into it.
  using Inputs = BackwardInputs<T, Q>;
  Inputs in_set[2] = {};
  const BackwardArgs<T> args{go, ghn, gates,      cells,
                             c0, t0,  step_state, pairs_aligned<T>(go, gates, cells, c0)};
  auto prefetch = [&](Inputs& in, int64_t t, const T* g_t, const T* c_t) {
    prefetch_backward<T, Q, kHalves>(in, args, at, t, g_t, c_t);
  };
  if (owner) {
    const T* dc_in = t1 - 1 == T_ - 1 ? gcn : dc;
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (at.ok[half][q] && dc_in != nullptr)
          load_floats(dc_in + at.state[half][q], dc_reg[half][q]);
      }
    }
    prefetch(in_set[0], t1 - 1, gates + (t1 - 1) * step_gates, cells + (t1 - 1) * step_state);
    prefetch(in_set[1], t1 - 2, gates + (t1 - 2) * step_gates, cells + (t1 - 2) * step_state);
  }

  // Step t's rows of gates, cells and dG: moved a step at a time (no 64-bit
  // products a step).
  const T* g_t = gates + (t1 - 1) * step_gates;
  const T* c_t = cells + (t1 - 1) * step_state;
  T* dg_t = dG + (t1 - 1 - t0) * step_gates;

  auto step = [&](int64_t t, Inputs& in) {
    const bool last = t == T_ - 1;
    const int64_t n = kPacked ? rows_at(bs, B, T_, t) : B;
    const int64_t n_next = kPacked ? rows_at(bs, B, T_, t + 1) : 0;
    const int64_t write_at = (t & 1) * kRows * ld;
    // dG_{t+1} (not the chunk's first step's: from global memory) is in
    // buffer (t + 1) % 2, the (t1 - 2 - t)-th the chunk pushed, its phase
    // half that. Waited for even where the product is skipped: each phase
    // needs this block's arrivals in turn.
    if (kCluster && t < t1 - 1) x.wait((t + 1) & 1, (t1 - 2 - t) >> 1);
    float acc[NT][4] = {};
    // Rows with no step after this one (all, at the last): no recurrent
    // gradient (their dG_{t+1} rows are zero: skipping is only faster).
    if (owner && (kPacked ? r0 < n_next : !last)) {
      if constexpr (kFma) {
        fma_product<KM, NT>(acc, gbuf + ((t + 1) & 1) * kRows * ld + khalf * KM * kFmaK, ld, wf);
        if constexpr (kSplit > 1) combine_halves<NT, 2, kSplit>(acc, scratch, warp, khalf);
      } else {
        local_product<T, NT, 4, RC>(acc, a_of_buf + ((t + 1) & 1) * buf_bytes, KC, my_frag, wr);
      }
    }
    if (owner && khalf == 0) {
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
        const bool live = !kPacked || at.row[half] < n;
        const bool row_last = kPacked ? at.row[half] >= n_next : last;
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          const float rec[2] = {acc[q][2 * half], acc[q][2 * half + 1]};
          Pair<T> v[3];
          backward_cell<T, Q, Math>(in, args, at, half, q, rec, live, row_last, dc_reg[half][q],
                                    sums, v);
          // dG first to the peers and the block's buffer: the next step
          // waits for it.
          const int64_t b = write_at + at.buf[half][q];
          Pair<T> d_op[3];
#pragma unroll
          for (int g = 0; g < 3; ++g) d_op[g] = operand_pair<T, kFma>(v[g]);
          // The chunk's earliest dG is read from global memory. Rows done
          // (a packed run) push zeros: the peers count the bytes of every
          // row below B.
          if (kCluster && t > t0 && at.row[half] < B) {
            uint32_t off[3];
#pragma unroll
            for (int g = 0; g < 3; ++g) off[g] = static_cast<uint32_t>((b + g * S) * sizeof(T));
            x.push(off, t & 1, d_op);
          }
          if (!at.ok[half][q]) continue;
#pragma unroll
          for (int g = 0; g < 3; ++g) {
            store_pair(gbuf + b + g * S, d_op[g]);
            store_pair(dg_t + at.gate[half][q][g], v[g]);
          }
        }
      }
      prefetch(in, t - 2, g_t - 2 * step_gates, c_t - 2 * step_state);
    }
    if constexpr (kCluster) {
      if (t > t0 && khalf == 0) x.arrive(t & 1);
    } else {
      __syncthreads();  // dG_t written before the next step reads it
    }
    g_t -= step_gates;
    c_t -= step_state;
    dg_t -= step_gates;
  };
  steps_down(t1, t0, step, in_set);
  if (!owner || khalf != 0) return;
  finish_backward<T, Q, kHalves>(at, dc_reg, sums, dc, partial, S);
}

// kRows as forward_tc_local_kernel's.
template <typename T, int Q, bool kPacked, bool kCluster, bool kSmallK, int kRows>
__global__ void __launch_bounds__(local_max_threads<kCluster>(), 1)
    backward_tc_local_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                             const T* go, const T* ghn, const T* gcn, T* dG, const T* w_h,
                             int64_t ld_w, T* dc, const T* gates, const T* cells, const T* c0,
                             float* partial, const int64_t* bs) {
  backward_local<T, Q, kPacked, kCluster, kSmallK, false, 1, kRows>(
      T_, t0, t1, K, B, S, go, ghn, gcn, dG, w_h, ld_w, dc, gates, cells, c0, partial, bs);
}
// Full float32 (no TF32): the product on the FMA units, kSplit warps a tile.
template <bool kPacked, bool kCluster, bool kSmallK, int kSplit>
__global__ void __launch_bounds__(local_max_threads<kCluster>(), 1)
    backward_fma_local_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                              const float* go, const float* ghn, const float* gcn, float* dG,
                              const float* w_h, int64_t ld_w, float* dc, const float* gates,
                              const float* cells, const float* c0, float* partial,
                              const int64_t* bs) {
  backward_local<float, kLocalQ, kPacked, kCluster, kSmallK, true, kSplit, kLocalRowsOf<true>>(
      T_, t0, t1, K, B, S, go, ghn, gcn, dG, w_h, ld_w, dc, gates, cells, c0, partial, bs);
}

// -- backward by partial sums (clusters) ------------------------------------------------------
//
// backward_local's cluster kernels push each step's dG, 3S values a row,
// to every block, whose warps multiply the whole row by their columns of
// W_h. Here each block multiplies only its own dG columns (the three gates
// of its KB tiles: K = 24 KB) by those rows of W_h, for all S columns, and
// pushes each other block the float32 partial sums of that block's
// columns: S values a row in all, a third of float32's dG bytes and two
// thirds of a 16-bit one's (what the exchange costs follows its bytes,
// see Exchange::push). Each block adds the C partial sums of its columns
// in block order, a fixed order (results do not depend on timing). A step:
// the cell warps (one a tile) wait for the partial sums of dG_{t+1}, run
// the cells of step t and write dG_t to the block's buffer; a block
// barrier; every warp multiplies the buffer by its 8 NTo columns and pushes
// each block its share of them (into its own slots where that is this
// block). Every block holds KB tiles (S = 8 KB C), 8 rows a cluster, and
// the batch is whole (a packed one runs backward_local).

// Shared memory of backward_partial: (tensor cores) every warp's weight
// fragments, two dG buffers of the block's K columns, two sets (one a
// push's parity) of C slots of partial sums ([8 rows][8 KB] float32, slot
// c from block c), the mbarriers.
template <typename T>
inline size_t partial_backward_smem(bool fma, int C, int KB, int warps, int NTo) {
  const int64_t K = 24 * KB;
  const size_t weights = fma ? 0 : static_cast<size_t>(warps) * weight_bytes(k_tiles<T>(K), NTo);
  return weights + 2 * kLocalEightRows * local_ld<T>(K) * sizeof(T) +
         2 * static_cast<size_t>(C) * kLocalEightRows * 8 * KB * sizeof(float) + kLocalBarrierBytes;
}

// acc = the rows of the state buffer at `a` (this lane's ldmatrix address,
// see a_lane) times the KC chunks of weights in registers, two chunks of
// A loads in flight, the two k tiles of a chunk in separate chains.
template <typename T, int NT, int KC>
__device__ __forceinline__ void tc_partial_product(float (&acc)[NT][4], uint32_t a,
                                                   const RegChunks<KC, NT>& wr) {
  constexpr int G = kLocalGroup;
  float lo[NT][4] = {}, hi[NT][4] = {};
  uint32_t v[G][2][4];
#pragma unroll
  for (int c = 0; c < KC; c += G) {
    load_a_chunks<T, G>(v, a, c, KC);
    mma_reg_chunks<T, NT, G, KC>(lo, hi, v, c, KC, wr);
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = lo[nt][e] + hi[nt][e];
  }
}

// backward_local's steps (its arguments and outputs) by partial sums: KB
// tiles a block, NTo column tiles a warp; kFma: the product on the FMA
// units (full float32), else on the tensor cores.
template <typename T, bool kFma, int KB, int NTo>
__device__ __forceinline__ void backward_partial(int64_t T_, int64_t t0, int64_t t1, int64_t K,
                                                 int64_t B, int64_t S, const T* go, const T* ghn,
                                                 const T* gcn, T* dG, const T* w_h, int64_t ld_w,
                                                 T* dc, const T* gates, const T* cells, const T* c0,
                                                 float* partial) {
  constexpr int Q = 1, kHalves = 1;
  constexpr int64_t kRows = kLocalEightRows;
  constexpr int KB8 = 8 * KB, KK = 3 * KB8;  // the block's columns; its dG columns
  static_assert(kFma ? KK % 16 == 0 : KK % kChunk<T> == 0, "whole pairs / chunks of k");
  constexpr int KC = KK / kChunk<T>, KT = 2 * KC, KP = KK / 16;
  using Math = LocalMath<T, kFma>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int C = static_cast<int>(gridDim.x), rank = static_cast<int>(blockIdx.x);
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int w = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  const int64_t S3 = 3 * S, step_gates = B * S3, step_state = B * S;
  const int64_t ld = local_ld<T>(KK);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int rows = static_cast<int>(local_rows(B, r0, kRows));
  uint2* frag = reinterpret_cast<uint2*>(smem);
  T* gbuf = reinterpret_cast<T*>(smem + (kFma ? 0 : warps * weight_bytes(KT, NTo)));
  float* slots = reinterpret_cast<float*>(gbuf + 2 * kRows * ld);
  const uint64_t* bars = reinterpret_cast<const uint64_t*>(slots + 2 * C * kRows * KB8);
  // Column k of the block's dG (gate k / KB8, tile column k % KB8 of the
  // block's first tile on) is row w_row(k) of W_h.
  const int64_t first_col = int64_t(KB8) * rank;
  auto w_row = [&](int64_t k) { return (k / KB8) * S + first_col + k % KB8; };
  // This warp's columns: out0 .. out0 + 8 NTo - 1, in groups of kPerDest
  // tiles that are one block's each: one group where a warp's tiles are at
  // most a block's (NTo <= KB), else NTo / KB.
  constexpr int kPerDest = NTo < KB ? NTo : KB;
  static_assert(KB % kPerDest == 0 && NTo % kPerDest == 0, "whole groups of a block's tiles");
  const int out0 = 8 * NTo * w;
  if constexpr (!kFma) {
    load_weight_slices<T, true>(frag, warps, KT, NTo,
                                [&](int s, int64_t k, int nt, int n) -> uint32_t {
                                  if (k >= KK) return 0;
                                  return bits_of(w_h[w_row(k) * ld_w + 8 * (NTo * s + nt) + n]);
                                });
  }
  zero_shared(gbuf, 2 * kRows * ld);
  zero_shared(slots, 2 * C * kRows * KB8);
  __syncthreads();  // zero before the copy below writes
  // Every warp pushes partial sums: one arrival each; the other C - 1
  // blocks bring the block's columns of every row.
  const Exchange x = setup_exchange(slots, bars, rank, C, warps,
                                    static_cast<uint32_t>((C - 1) * rows * KB8 * sizeof(float)));
  // The chunk's first step reads the later chunk's last dG (slot K): the
  // block's columns of it into buffer 0, push 0. Push n holds the partial
  // sums of dG_{n_base - n}.
  const bool from_later = t1 < T_;
  const int64_t n_base = from_later ? t1 : t1 - 1;
  if (from_later) {
    const T* src = dG + K * step_gates + r0 * S3;
    batched_copy(
        rows * KK, [&](int e) { return operand_of<T, kFma>(src[(e / KK) * S3 + w_row(e % KK)]); },
        [&](int e, T v) { gbuf[(e / KK) * ld + e % KK] = v; });
  }
  __syncthreads();  // the weight fragments and the later chunk's dG are in shared memory
  RegChunks<kFma ? 0 : KC, NTo> wr;
  if constexpr (!kFma) load_reg_chunks<NTo, KC>(wr, frag + w * KT * NTo * 32, KC);
  // kFma: turns of 16 k (E = 2), the weights of this warp's columns.
  FmaWeights<kFma ? KP : 0, NTo, 2> wf;
  if constexpr (kFma) {
    load_fma_weights<KP, NTo, 2>(wf, KK, 0, [&](int64_t k, int nt, int c) {
      return to_acc(w_h[w_row(k) * ld_w + out0 + 8 * nt + 2 * (lane & 3) + c]);
    });
  }
  const uint32_t a_of_buf = a_lane<T, kRows>(shared_address(gbuf), ld, lane);
  const uint32_t buf_bytes = static_cast<uint32_t>(kRows * ld * sizeof(T));
  local_barrier<true>();  // the cluster's slots and mbarriers are ready before a push

  // Push n: the block's dG buffer n % 2 times this warp's columns, to
  // their block's slot `rank` of set n % 2; then this warp's arrival.
  const int row = lane >> 2;
  auto push = [&](int64_t n) {
    const int b = static_cast<int>(n & 1);
    float acc[NTo][4];
    if constexpr (kFma) {
      fma_product<KP, NTo, 2>(acc, gbuf + b * kRows * ld, ld, wf);
    } else {
      tc_partial_product<T, NTo, KC>(acc, a_of_buf + b * buf_bytes, wr);
    }
    if (row < rows) {
#pragma unroll
      for (int g0 = 0; g0 < NTo; g0 += kPerDest) {
        // Group g0's block, and the group's place in that block's slot.
        const int col = out0 + 8 * g0, dest = col / KB8;
        const int off =
            ((b * C + rank) * static_cast<int>(kRows) + row) * KB8 + col % KB8 + 2 * (lane & 3);
        if (dest == rank) {
#pragma unroll
          for (int nt = 0; nt < kPerDest; ++nt) {
            *reinterpret_cast<float2*>(slots + off + 8 * nt) =
                make_float2(acc[g0 + nt][0], acc[g0 + nt][1]);
          }
        } else {
          const uint32_t to = cluster_address(x.buf, static_cast<uint32_t>(dest));
          const uint32_t bar = cluster_address(x.bar_of(b), static_cast<uint32_t>(dest));
#pragma unroll
          for (int nt = 0; nt < kPerDest; ++nt) {
            store_async(to + 4 * (off + 8 * nt), make_float2(acc[g0 + nt][0], acc[g0 + nt][1]),
                        bar);
          }
        }
      }
    }
    x.arrive(b);
  };
  if (from_later) push(0);

  // The cells: warp w < KB, tile rank KB + w, this lane's row and pair.
  const bool cell_warp = w < KB;
  const Places<Q> at(B, S, r0, ld, rank * KB + w, lane);
  float dc_reg[2][Q][2] = {};
  float sums[3][Q][2] = {};
  using Inputs = BackwardInputs<T, Q>;
  Inputs in_set[2] = {};
  const BackwardArgs<T> args{go, ghn, gates,      cells,
                             c0, t0,  step_state, pairs_aligned<T>(go, gates, cells, c0)};
  const T* g_t = gates + (t1 - 1) * step_gates;
  const T* c_t = cells + (t1 - 1) * step_state;
  T* dg_t = dG + (t1 - 1 - t0) * step_gates;
  if (cell_warp) {
    const T* dc_in = t1 - 1 == T_ - 1 ? gcn : dc;
    if (at.ok[0][0] && dc_in != nullptr) load_floats(dc_in + at.state[0][0], dc_reg[0][0]);
    prefetch_backward<T, Q, kHalves>(in_set[0], args, at, t1 - 1, g_t, c_t);
    prefetch_backward<T, Q, kHalves>(in_set[1], args, at, t1 - 2, g_t - step_gates,
                                     c_t - step_state);
  }
  // This lane's place in the slots (set 0, slot 0) and in the dG buffers.
  const int slot_at = row * KB8 + 8 * w + 2 * (lane & 3);
  const int64_t buf_at = row * ld + 8 * w + 2 * (lane & 3);

  auto step = [&](int64_t t, Inputs& in) {
    const bool last = t == T_ - 1;
    if (cell_warp) {
      // The partial sums of dG_{t+1}, none at the last step.
      float rec[2] = {0.f, 0.f};
      if (!last) {
        const int64_t n = n_base - (t + 1);
        x.wait(n & 1, n >> 1);
        const float* from = slots + (n & 1) * C * kRows * KB8 + slot_at;
        for (int c = 0; c < C; ++c) {
          const float2 v = *reinterpret_cast<const float2*>(from + c * kRows * KB8);
          rec[0] += v.x;
          rec[1] += v.y;
        }
      }
      Pair<T> v[3];
      backward_cell<T, Q, Math>(in, args, at, 0, 0, rec, true, last, dc_reg[0][0], sums, v);
      if (t > t0) {  // the chunk's earliest dG multiplies nothing here
        T* to = gbuf + ((n_base - t) & 1) * kRows * ld + buf_at;
#pragma unroll
        for (int g = 0; g < 3; ++g) store_pair(to + g * KB8, operand_pair<T, kFma>(v[g]));
      }
      if (at.ok[0][0]) {
#pragma unroll
        for (int g = 0; g < 3; ++g) store_pair(dg_t + at.gate[0][0][g], v[g]);
      }
      prefetch_backward<T, Q, kHalves>(in, args, at, t - 2, g_t - 2 * step_gates,
                                       c_t - 2 * step_state);
    }
    if (t > t0) {
      __syncthreads();  // dG_t in the buffer before the warps multiply it
      push(n_base - t);
    }
    g_t -= step_gates;
    c_t -= step_state;
    dg_t -= step_gates;
  };
  steps_down(t1, t0, step, in_set);
  if (cell_warp) finish_backward<T, Q, kHalves>(at, dc_reg, sums, dc, partial, S);
}

// KB, NTo as backward_partial's; kernels named as their families'.
template <typename T, int KB, int NTo>
__global__ void __launch_bounds__(local_max_threads<true>(), 1)
    backward_tc_partial_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                               const T* go, const T* ghn, const T* gcn, T* dG, const T* w_h,
                               int64_t ld_w, T* dc, const T* gates, const T* cells, const T* c0,
                               float* partial, const int64_t* /*bs: whole batches only*/) {
  backward_partial<T, false, KB, NTo>(T_, t0, t1, K, B, S, go, ghn, gcn, dG, w_h, ld_w, dc, gates,
                                      cells, c0, partial);
}
// Full float32 (no TF32): the product on the FMA units.
template <int KB, int NTo>
__global__ void __launch_bounds__(local_max_threads<true>(), 1)
    backward_fma_partial_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                                const float* go, const float* ghn, const float* gcn, float* dG,
                                const float* w_h, int64_t ld_w, float* dc, const float* gates,
                                const float* cells, const float* c0, float* partial,
                                const int64_t* /*bs: whole batches only*/) {
  backward_partial<float, true, KB, NTo>(T_, t0, t1, K, B, S, go, ghn, gcn, dG, w_h, ld_w, dc,
                                         gates, cells, c0, partial);
}

}  // namespace tc
