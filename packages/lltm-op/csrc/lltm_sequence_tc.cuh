// lltm_op: the tensor-core persistent kernels of the LLTM sequence (sm_80+):
// float16 and bfloat16 on mma.sync.m16n8k16, and float32 on TF32 tensor cores
// (mma.sync.m16n8k8, operands rounded to TF32, float32 accumulation) where
// the caller allows TF32 as torch's float32 matmul setting does. Included by
// lltm_sequence_cuda.cu inside its anonymous namespace (it uses that file's
// to_acc / to_storage / MathFor and row_arrive / row_wait).
//
// One launch runs every step of the forward (or of a backward chunk). The
// grid is (column blocks) x (batch blocks), all resident at once:
//
// * a block owns NJ = 8 * Q state columns j0 .. j0 + NJ - 1 and bm batch rows;
//   its slice of the recurrent weights (forward: the 3 * NJ columns of W_h^T
//   of its columns' three gates, K = S; backward: the NJ columns of W_h,
//   K = 3S) is loaded ONCE into shared memory, already in the register
//   layout of the tensor cores' B operand, and stays there for every step;
// * each step, the block's warps multiply the previous step's state rows
//   (h_{t-1} forward, dG_{t+1} backward; written by other blocks, read from
//   L2 straight into A-operand registers) by that slice with mma.sync
//   (float32 accumulation), split over the k dimension
//   when the block has fewer 16-row tiles than warps (then reduced in shared
//   memory), and finish the cell in registers: an accumulator element of
//   gate g sits in the same thread, at the same (row, column), for all three
//   gates;
// * the blocks of a batch block meet at a barrier between steps: a block
//   arrives once its step's state rows are written (row_arrive), stores the
//   rest and fetches the next step's inputs, then waits (row_wait).
//
// Same arithmetic contract as the other paths: float32 products and cell
// (the cell on the hardware exp2 and reciprocal, and in 16-bit types the
// hardware tanh: TcMathFor),
// the pre-activation rounded to the storage type before the cell (what the
// backward recomputes from), bias gradient summed per block row in a fixed
// order (deterministic).
#pragma once

namespace tc {

constexpr int kTcWarps = 8;
constexpr int kTcThreads = 32 * kTcWarps;
// Batch rows a block may own: past this a step's cuBLAS product is the
// better engine (the block would re-read too much state a step).
constexpr int64_t kTcMaxRows = 128;

// The raw bits of an element (16 or 32 of them).
template <typename T>
using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
template <typename T>
__device__ __forceinline__ Bits<T> bits_of(T v) {
  Bits<T> b;
  memcpy(&b, &v, sizeof(b));
  return b;
}

// float32 to TF32 (round to nearest; the low 13 bits zero): ties to even
// on sm_90+, where that is one instruction (F2FP), away from zero below
// (cvt.rna, the only rounding there, is three: with one, the float32
// global-barrier kernels' step loops have 7% fewer instructions on sm_90).
__device__ __forceinline__ uint32_t to_tf32(uint32_t f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("cvt.rn.tf32.f32 %0, %1;" : "=r"(r) : "r"(f));
  return r;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "r"(f));
  return r;
#else
  return f;
#endif
}

// Elements of k a thread loads per row and chunk (16 bytes), and the chunk:
// four threads side by side, two k tiles of the mma (k16 for 16-bit types,
// k8 for TF32).
template <typename T>
constexpr int kPerThread = 16 / static_cast<int>(sizeof(T));
template <typename T>
constexpr int kChunk = 4 * kPerThread<T>;

// D += A B for one k tile (16x8x16 for 16-bit types, 16x8x8 for TF32;
// row-major A, column-major B, float32 D).
template <typename T>
__device__ __forceinline__ void mma_tile(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, float>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  } else if constexpr (std::is_same_v<T, opscommon::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  }
#else
  __trap();  // never launched below sm_80 (the host checks the device)
#endif
}

// How a block splits its work over its warps: I = bm / 16 row tiles; with
// fewer tiles than warps, KS warps share a tile's k range.
struct Split {
  int I, KS;
  __host__ __device__ Split(int64_t bm) : I(static_cast<int>(bm / 16)) {
    KS = I >= kTcWarps ? 1 : kTcWarps / I;
  }
};

// The k dimension is read in chunks (kChunk: 32 for 16-bit types, 16 for
// float32): a thread loads 16 consecutive bytes of each of its two rows per
// chunk, and the chunk's two k tiles are a permutation of its k values, the
// same one in the weight fragments (see load_weights), such that the loaded
// registers are the A fragments as they are. Logical k l of tile 2c + sub:
//   16-bit: k = 32c + 8 (l % 8 / 2) + 4 sub + 2 (l / 8) + l % 2  (l < 16)
//   TF32:   k = 16c + 4 (l % 4) + 2 sub + l / 4                  (l < 8)
template <typename T>
__device__ __forceinline__ int64_t permuted_k(int64_t kt, int l) {
  if constexpr (sizeof(T) == 4) {
    return 16 * (kt / 2) + 4 * (l % 4) + 2 * (kt % 2) + l / 4;
  } else {
    return 32 * (kt / 2) + 8 * ((l % 8) / 2) + 4 * (kt % 2) + 2 * (l / 8) + l % 2;
  }
}

// Shared memory of a block: the weight slice (KT x NT fragments of 32 lanes
// x 8 bytes), the k-split reduction, the bias sums (backward).
__host__ __device__ inline size_t weight_bytes(int64_t KT, int NT) {
  return static_cast<size_t>(KT) * NT * 32 * sizeof(uint2);
}
__host__ __device__ inline size_t reduce_bytes(const Split& s, int nacc) {
  return static_cast<size_t>(s.KS - 1) * s.I * nacc * 32 * sizeof(float);
}
// k tiles of a K-long product.
template <typename T>
__host__ __device__ inline int64_t k_tiles(int64_t K) {
  return 2 * ((K + kChunk<T> - 1) / kChunk<T>);
}
template <typename T>
inline size_t forward_smem(int64_t S, int Q, int64_t bm) {
  const Split s(bm);
  return weight_bytes(k_tiles<T>(S), 3 * Q) + reduce_bytes(s, 12 * Q);
}
// The spread-cell forward (kSpread, see forward_tc_kernel): every warp's
// partial sums, [warp][tile nt][row half][lane] float2, in place of the
// k-split reduction.
__host__ __device__ inline size_t spread_reduce_bytes(int Q) {
  return static_cast<size_t>(kTcWarps) * 3 * Q * 2 * 32 * sizeof(float2);
}
template <typename T>
inline size_t forward_smem_spread(int64_t S, int Q) {
  return weight_bytes(k_tiles<T>(S), 3 * Q) + spread_reduce_bytes(Q);
}
// The cluster variant's two state buffers of [bm, 8Q] elements.
template <typename T>
inline size_t cluster_state_bytes(int Q, int64_t bm) {
  return 2 * static_cast<size_t>(bm) * 8 * Q * sizeof(T);
}
template <typename T>
inline size_t backward_smem(int64_t S, int Q, int64_t bm) {
  const Split s(bm);
  return weight_bytes(k_tiles<T>(3 * S), Q) + reduce_bytes(s, 4 * Q) +
         static_cast<size_t>(s.I) * 3 * 8 * Q * sizeof(float);
}

// Element (k, c) of W_h^T, read in place from W_h ([3S, S], rows of stride
// ld_w): the forward kernels load their weight slices from it once, with
// no transposed copy.
template <typename T>
__device__ __forceinline__ T w_hT_at(const T* w_h, int64_t ld_w, int64_t k, int64_t c) {
  return w_h[c * ld_w + k];
}

// One weight fragment: lane `lane` of k tile kt holds the B operand of
// column lane / 4 of its tile: logical rows 2 (lane % 4) + {0, 1} and
// + {8, 9} (16-bit types, two to a register) or lane % 4 and + 4 (TF32),
// each mapped to its k by permuted_k (kNatural: k = kt * tile + row, for
// A fragments that ldmatrix loads in k order); `w(k, n)` returns the bits
// of the element at k of the tile's column n (zero outside the matrix).
template <typename T, bool kNatural = false>
__device__ __forceinline__ int64_t fragment_k(int64_t kt, int l) {
  if constexpr (kNatural) {
    return kt * (sizeof(T) == 4 ? 8 : 16) + l;
  } else {
    return permuted_k<T>(kt, l);
  }
}
template <typename T, bool kNatural = false, typename Fn>
__device__ __forceinline__ uint2 make_fragment(int64_t kt, int lane, Fn w) {
  const int n = lane >> 2;
  auto at = [&](int l) { return w(fragment_k<T, kNatural>(kt, l), n); };
  uint2 f;
  if constexpr (sizeof(T) == 4) {
    const int l = lane & 3;
    f.x = to_tf32(at(l));
    f.y = to_tf32(at(l + 4));
  } else {
    const int l = 2 * (lane & 3);  // logical k of b0's first element
    f.x = uint32_t(at(l)) | (uint32_t(at(l + 1)) << 16);
    f.y = uint32_t(at(l + 8)) | (uint32_t(at(l + 9)) << 16);
  }
  return f;
}

// put(e, get(e)) for e = threadIdx.x, + blockDim.x, ... below n, kBatch a
// thread at a time: a batch's gets (global loads) all issue before its
// first put, where one at a time each waited for its load. A block's
// prologue (its weights and state rows) held an eighth of the samples of
// an ncu profile of the float32 block-local backward (S = 128, T256 B64);
// batched, the block-local kernels took 1-4% less time at S >= 96 (H100).
// get sees e clamped to n - 1 (its loads stay in bounds, unused past n).
template <int kBatch = 8, typename Get, typename Put>
__device__ __forceinline__ void batched_copy(int n, Get get, Put put) {
  const int stride = static_cast<int>(blockDim.x);
  for (int e0 = static_cast<int>(threadIdx.x); e0 < n; e0 += kBatch * stride) {
    decltype(get(0)) v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = get(std::min(e0 + i * stride, n - 1));
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (e0 + i * stride < n) put(e0 + i * stride, v[i]);
    }
  }
}

// batched_copy over e = o * n_inner + i of an n_outer x n_inner range:
// put(o, i, get(o, i)), the pair (o, i) of each e advanced by additions
// (no division by the runtime n_inner an element); get sees o clamped to
// n_outer - 1.
template <int kBatch = 8, typename Get, typename Put>
__device__ __forceinline__ void batched_copy_2d(int n_outer, int n_inner, Get get, Put put) {
  const int stride = static_cast<int>(blockDim.x);
  int o = static_cast<int>(threadIdx.x) / n_inner, i = static_cast<int>(threadIdx.x) % n_inner;
  while (o < n_outer) {
    decltype(get(0, 0)) v[kBatch];
    int os[kBatch], is[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      os[b] = o;
      is[b] = i;
      v[b] = get(std::min(o, n_outer - 1), i);
      for (i += stride; i >= n_inner; i -= n_inner) ++o;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (os[b] < n_outer) put(os[b], is[b], v[b]);
    }
  }
}

// Fill `slices` slices of weight fragments, one after the other: in slice
// s, fragment (kt, nt) of lane l at frag[((s * KT + kt) * NT + nt) * 32 + l]
// (see make_fragment); `w(s, k, nt, n)` returns the bits of one element of
// tile nt.
template <typename T, bool kNatural = false, typename Fn>
__device__ __forceinline__ void load_weight_slices(uint2* frag, int slices, int64_t KT, int NT,
                                                   Fn w) {
  const int per_slice = static_cast<int>(KT) * NT * 32;
  batched_copy(
      slices * per_slice,
      [&](int e) {
        const int slice = e / per_slice, tile = (e % per_slice) / 32;
        const int nt = tile % NT;
        return make_fragment<T, kNatural>(tile / NT, e % 32,
                                          [&](int64_t k, int n) { return w(slice, k, nt, n); });
      },
      [&](int e, uint2 f) { frag[e] = f; });
}

// The block's one slice of weight fragments (`w(k, nt, n)`), then a barrier.
template <typename T, typename Fn>
__device__ __forceinline__ void load_weights(uint2* frag, int64_t KT, int NT, Fn w) {
  load_weight_slices<T>(frag, 1, KT, NT,
                        [&](int, int64_t k, int nt, int n) { return w(k, nt, n); });
  __syncthreads();
}

constexpr int kGroup = 4;  // chunks whose loads are in flight together

// 16 bytes of float32 rounded to TF32 (the A operand), or as they are.
template <typename T>
__device__ __forceinline__ uint4 a_operand(uint4 v) {
  if constexpr (sizeof(T) == 4) {
    return make_uint4(to_tf32(v.x), to_tf32(v.y), to_tf32(v.z), to_tf32(v.w));
  } else {
    return v;
  }
}

// The weight fragments' layouts in shared memory: k permuted (see
// permuted_k; load_weights), k in order (kNatural, the block-local
// kernels) and wgmma's canonical one (load_weights_canonical).
enum class FragLayout { kPermuted, kNatural, kCanonical };

// Whether rows of K elements at `base`, `ld` apart, can be read 16 bytes at
// a time (load_fragment_rows): K and ld whole 16-byte runs, base aligned.
template <typename T>
__device__ __forceinline__ bool rows_vectorizable(const T* base, int64_t ld, int64_t K) {
  return K % kPerThread<T> == 0 && ld % kPerThread<T> == 0 &&
         reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

// A unit of a weight load: slice s's fragments of tile nt in k chunk c (k
// tiles 2c and 2c + 1), 16 bytes a lane.
struct FragUnit {
  int s, c, nt;
};

// The units (s, c, nt) of `slices` slices of KC chunks by NT tiles, u = (s KC
// + c) NT + nt, over the block's warps: warp w takes u = w, w + warps, ...,
// kBatch at a time: all of a batch's load(unit) (global reads) issue before
// its first store(unit, value). The units advance by additions: with the
// unit divided out of a running index, the index arithmetic was most of
// the loads' instructions (about 190 a 16-byte load, Nsight Compute).
template <int kBatch = 8, typename Load, typename Store>
__device__ __forceinline__ void for_warp_units(int slices, int KC, int NT, Load load, Store store) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int warps = static_cast<int>(blockDim.x) / 32, units = slices * KC * NT;
  const int step_nt = warps % NT, step_c = warps / NT % KC, step_s = warps / (NT * KC);
  FragUnit at{warp / (NT * KC), warp / NT % KC, warp % NT};
  for (int u0 = warp; u0 < units; u0 += kBatch * warps) {
    uint4 v[kBatch];
    FragUnit w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      w[b] = at;
      v[b] = u0 + b * warps < units ? load(at) : make_uint4(0, 0, 0, 0);
      at.nt += step_nt;
      if (at.nt >= NT) at.nt -= NT, ++at.c;
      at.c += step_c;
      if (at.c >= KC) at.c -= KC, ++at.s;
      at.s += step_s;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (u0 + b * warps < units) store(w[b], v[b]);
    }
  }
}

// `slices` slices of KT = 2 KC by NT weight fragments (placed as
// load_weight_slices places them, or as load_weights_canonical) whose tile
// nt's column n of slice s is the row row(s, nt, n) (its elements k < K,
// rows_vectorizable; null: zeros), then no barrier. Lane l of a unit reads
// row l / 4's run at k = c kChunk + kPerThread (l % 4): the same lane's
// fragments of the chunk's two k tiles in the permuted layout as they are;
// in the natural one, k tile 2c + l / 2 % 2's half l % 2 of lanes 4 (l / 4)
// .. + 3, exchanged with the neighbour lane to store two whole fragments.
// make_fragment's 2-byte reads cost about 300 instructions a fragment and
// used a fifth of the sectors they fetched: the weight loads were 70% of a
// T1 float16 B64 S1024 forward (Nsight Compute). The backward's slices
// (columns of W_h) keep make_fragment: a load of rows transposed with
// movmatrix was no faster there.
template <typename T, FragLayout kLayout, typename Row>
__device__ __forceinline__ void load_fragment_rows(unsigned char* smem, int slices, int KC, int NT,
                                                   int64_t K, Row row) {
  const int KT = 2 * KC, lane = static_cast<int>(threadIdx.x) % 32;
  const int k_lane = kPerThread<T> * (lane % 4);
  for_warp_units(
      slices, KC, NT,
      [&](const FragUnit& u) {
        const T* r = row(u.s, u.nt, lane / 4);
        const int64_t k = static_cast<int64_t>(u.c) * kChunk<T> + k_lane;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r != nullptr && k < K) v = *reinterpret_cast<const uint4*>(r + k);
        return v;
      },
      [&](const FragUnit& u, uint4 v) {
        v = a_operand<T>(v);                                // TF32 rounding
        const int tile = (u.s * KT + 2 * u.c) * NT + u.nt;  // of k tile 2c; + NT: 2c + 1
        if constexpr (kLayout == FragLayout::kPermuted) {
          uint2* f = reinterpret_cast<uint2*>(smem);
          f[tile * 32 + lane] = make_uint2(v.x, v.y);
          f[(tile + NT) * 32 + lane] = make_uint2(v.z, v.w);
        } else if constexpr (kLayout == FragLayout::kCanonical) {
          uint32_t* w = reinterpret_cast<uint32_t*>(smem);
          w[tile * 64 + lane] = v.x;
          w[tile * 64 + 32 + lane] = v.y;
          w[(tile + NT) * 64 + lane] = v.z;
          w[(tile + NT) * 64 + 32 + lane] = v.w;
        } else {
          // Half h's word m is lane m's b0 (h = 0) or b1 (h = 1): lane h = 0
          // keeps lanes 0 and 1 of the tile, h = 1 lanes 2 and 3.
          const bool h = lane & 1;
          const uint32_t s0 = __shfl_xor_sync(0xffffffffu, h ? v.x : v.z, 1);
          const uint32_t s1 = __shfl_xor_sync(0xffffffffu, h ? v.y : v.w, 1);
          const uint4 out = h ? make_uint4(s0, v.z, s1, v.w) : make_uint4(v.x, s0, v.y, s1);
          uint4* f = reinterpret_cast<uint4*>(smem);
          f[((tile + (lane >> 1 & 1) * NT) * 32 + 4 * (lane / 4) + 2 * h) / 2] = out;
        }
      });
}

// A thread's share of the k range of a product: chunks c0 .. c1 of K-long
// rows (K a multiple of 8: a thread's 16 bytes of a chunk are all in or
// all out), set up once before the steps: `first`, the element of chunk c0
// where the thread's 16 bytes start; `chunks`, c1 - c0 (the same for the
// warp: its mma run over all of them); `valid`, those of them whose 16
// bytes are inside the row for this thread (zeros past them).
struct KRange {
  int c0, chunks, valid, first;
  template <typename T>
  __device__ __forceinline__ static KRange of(int64_t K, int64_t c0, int64_t c1) {
    KRange r;
    r.c0 = static_cast<int>(c0);
    r.chunks = static_cast<int>(c1 - c0);
    const int64_t first = c0 * kChunk<T> + kPerThread<T> * (threadIdx.x & 3);
    const int64_t in_row = first < K ? (K - first + kChunk<T> - 1) / kChunk<T> : 0;
    r.valid = static_cast<int>(std::min<int64_t>(r.chunks, in_row));
    r.first = static_cast<int>(first);
    return r;
  }
};

// Loads of chunks u .. u + G - 1 of the range (zero past `valid`) of both
// rows: `get(r, u)` returns the thread's 16 bytes of chunk u of row r (0:
// the thread's first row, 1: the row 8 below; zero, not loaded, where
// kSecond is false: see kHalfRows). Loaded into zeroed registers under a
// predicate: no branch between the loads.
template <typename T, int G, bool kSecond, typename Get>
__device__ __forceinline__ void load_group(uint4 (&v)[G][2], Get& get, const KRange& kr, int u0) {
#pragma unroll
  for (int u = 0; u < G; ++u) {
    uint4 a = make_uint4(0, 0, 0, 0), b = a;
    if (u0 + u < kr.valid) {
      a = get(0, u0 + u);
      if constexpr (kSecond) b = get(1, u0 + u);
    }
    v[u][0] = a_operand<T>(a);
    v[u][1] = a_operand<T>(b);
  }
}

// Both k tiles of chunks u0 .. u0 + G - 1 of the range into acc[nt].
template <typename T, int NT, int G>
__device__ __forceinline__ void mma_group(float (&acc)[NT][4], const uint4 (&v)[G][2],
                                          const KRange& kr, int u0, const uint2* frag) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < G; ++u) {
    if (u0 + u >= kr.chunks) break;
    const uint32_t a_lo[4] = {v[u][0].x, v[u][1].x, v[u][0].y, v[u][1].y};
    const uint32_t a_hi[4] = {v[u][0].z, v[u][1].z, v[u][0].w, v[u][1].w};
    const uint2* f = frag + (kr.c0 + u0 + u) * 2 * NT * 32 + lane;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_tile<T>(acc[nt], a_lo, f[nt * 32]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_tile<T>(acc[nt], a_hi, f[(NT + nt) * 32]);
  }
}

// acc[nt] += A[the thread's rows; the range's chunks] @ fragments, one
// chain per tile, A read by `get` (see load_group) into a ring of NB
// groups of G chunks: NB - 1 groups' loads in flight during a group's
// products (L2's latency needs more loads in flight than shared
// memory's). The ring's registers are the same at G NB = 8; how they are
// cut changes ptxas's schedule: the float32 (TF32) backward took less time
// on 8 groups of one chunk than on 2 of 4 (H200, T256 backward kernel, B8
// S1024 1370 against 1605 us), the 16-bit kernels as much or more
// (bfloat16 B256 S1024 3650-3710 against 3350-3360).
template <typename T, int NT, bool kSecond = true, int G = kGroup, int NB = 2, typename Get>
__device__ __forceinline__ void tile_product(float (&acc)[NT][4], Get get, const KRange& kr,
                                             const uint2* frag) {
  uint4 v[NB][G][2];
#pragma unroll
  for (int b = 0; b + 1 < NB; ++b) load_group<T, G, kSecond>(v[b], get, kr, b * G);
  for (int u = 0; u < kr.chunks; u += NB * G) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      load_group<T, G, kSecond>(v[(b + NB - 1) % NB], get, kr, u + (b + NB - 1) * G);
      mma_group<T, NT, G>(acc, v[b], kr, u + b * G, frag);
    }
  }
}

// A in global memory, row-major, rows 16-byte aligned: the thread's 16
// bytes of chunk u of rows ra and rb (each pointing at the element of the
// range's first chunk where the thread's bytes start), read from L2
// (other blocks of this launch wrote them).
template <typename T>
struct GlobalRows {
  const T* ra;
  const T* rb;
  __device__ __forceinline__ uint4 operator()(int r, int u) const {
    return __ldcg(reinterpret_cast<const uint4*>((r ? rb : ra) + u * kChunk<T>));
  }
};

// -- warpgroup MMA (sm_90a) ------------------------------------------------------------------
//
// kWgmma (the global-barrier forward, 16-bit types, 4 or 8 row tiles a
// block): the four warps of a warpgroup (warps 4 i .. 4 i + 3, row tiles
// mt = 0..3 of one k share, or 4..7) run their 64 rows' product as one
// wgmma.mma_async m64 n(24 Q) k16 per k tile, A (the state rows) from the
// same registers as the mma.sync path and B (the weight slice) read from
// shared memory once a warpgroup, where mma.sync reads it once a warp: at
// float16 B256 S1024 those reads were about a third of a step's cycles in
// an Nsight Compute profile. The accumulators come out in the mma.sync
// layout, so the reduction and the cells are the same code. The slice is
// stored in the canonical K-major layout without swizzle: k tile kt's
// columns n at kt * NT * 256 bytes, each 8-column group (tile nt) 256
// bytes, its two 8 x 8 core matrices (logical k 0-7, 8-15) 128 apart, a
// column's 8 elements of one core matrix 16 contiguous bytes; logical k
// mapped by permuted_k as the A registers are. Only an sm_90a build has
// wgmma (kWgmmaBuilt); elsewhere these kernels run the mma.sync product.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaBuilt = true;
#else
constexpr bool kWgmmaBuilt = false;
#endif

// wgmma.mma_async m64 n(8 NT) k16, float32 accumulators d (the mma.sync
// layout, see above), A from registers, B from the descriptor, the inputs
// float16 or bfloat16 (kBf16). One asm statement a shape: its dtype is the
// one word the two differ in (LLTM_OP_WGMMA_RUN(TY), defined in each).
template <int NT>
struct Wgmma;
#define LLTM_OP_WGMMA_INPUTS "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)

template <>
struct Wgmma<8> {
  template <bool kBf16>
  __device__ __forceinline__ static void run(float (&d)[8][4], const uint32_t (&a)[4],
                                             uint64_t desc) {
#define LLTM_OP_WGMMA_RUN(TY)                                                                     \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                        \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                               \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
        "+f"(d[7][2]), "+f"(d[7][3])                                                              \
      : LLTM_OP_WGMMA_INPUTS)
    if constexpr (kBf16) {
      LLTM_OP_WGMMA_RUN("bf16");
    } else {
      LLTM_OP_WGMMA_RUN("f16");
    }
#undef LLTM_OP_WGMMA_RUN
  }
};

template <>
struct Wgmma<3> {
  template <bool kBf16>
  __device__ __forceinline__ static void run(float (&d)[3][4], const uint32_t (&a)[4],
                                             uint64_t desc) {
#define LLTM_OP_WGMMA_RUN(TY)                                                                     \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n24k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "                                     \
      "{%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"                                               \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])  \
      : LLTM_OP_WGMMA_INPUTS)
    if constexpr (kBf16) {
      LLTM_OP_WGMMA_RUN("bf16");
    } else {
      LLTM_OP_WGMMA_RUN("f16");
    }
#undef LLTM_OP_WGMMA_RUN
  }
};

template <>
struct Wgmma<6> {
  template <bool kBf16>
  __device__ __forceinline__ static void run(float (&d)[6][4], const uint32_t (&a)[4],
                                             uint64_t desc) {
#define LLTM_OP_WGMMA_RUN(TY)                                                                     \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n48k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
      "%19, %20, %21, %22, %23}, "                                                                \
      "{%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"                                               \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])  \
      : LLTM_OP_WGMMA_INPUTS)
    if constexpr (kBf16) {
      LLTM_OP_WGMMA_RUN("bf16");
    } else {
      LLTM_OP_WGMMA_RUN("f16");
    }
#undef LLTM_OP_WGMMA_RUN
  }
};

template <>
struct Wgmma<12> {
  template <bool kBf16>
  __device__ __forceinline__ static void run(float (&d)[12][4], const uint32_t (&a)[4],
                                             uint64_t desc) {
#define LLTM_OP_WGMMA_RUN(TY)                                                                      \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"                                                 \
      "wgmma.mma_async.sync.aligned.m64n96k16.f32." TY "." TY                                      \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "    \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, " \
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "                                   \
      "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"                                                \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),  \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),  \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),  \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),  \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),  \
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),  \
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),                \
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]),            \
        "+f"(d[11][2]), "+f"(d[11][3])                                                             \
      : LLTM_OP_WGMMA_INPUTS)
    if constexpr (kBf16) {
      LLTM_OP_WGMMA_RUN("bf16");
    } else {
      LLTM_OP_WGMMA_RUN("f16");
    }
#undef LLTM_OP_WGMMA_RUN
  }
};

#undef LLTM_OP_WGMMA_INPUTS

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_wait_all() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// The accumulators as written here, for the compiler: their reads stay
// after the wait, their writes before the next wgmma.
template <int NT>
__device__ __forceinline__ void fence_operands(float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[nt][e])::"memory");
  }
}
// Shared memory written by the threads (the generic proxy), made visible to
// wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The block's weight slice in the canonical layout (see above; `w(k, nt,
// n)` as load_weights'), then a barrier: lane l's fragment words of tile
// (kt, nt) (make_fragment: logical k 2 (l % 4) + {0, 1} and + {8, 9} of
// column l / 4) are words l and 32 + l of the tile's 64.
template <typename T, typename Fn>
__device__ __forceinline__ void load_weights_canonical(uint32_t* words, int64_t KT, int NT, Fn w) {
  batched_copy(
      static_cast<int>(KT) * NT * 32,
      [&](int e) {
        const int tile = e / 32, nt = tile % NT;
        return make_fragment<T>(tile / NT, e % 32, [&](int64_t k, int n) { return w(k, nt, n); });
      },
      [&](int e, uint2 f) {
        uint32_t* t = words + (e / 32) * 64 + e % 32;
        t[0] = f.x;
        t[32] = f.y;
      });
  fence_proxy_async_shared();
  __syncthreads();
}

// The descriptor of k tile 0's B operand (no swizzle; leading byte offset
// 128, the next core matrix in k; stride byte offset 256, the next 8
// columns), the slice at shared-memory address `base`; k tile kt's is kt *
// wgmma_tile_step<NT> more (its address field counts 16 bytes).
__device__ __forceinline__ uint64_t weight_descriptor(uint32_t base) {
  return static_cast<uint64_t>((base & 0x3FFFF) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}
template <int NT>
constexpr uint64_t wgmma_tile_step = NT * 256 / 16;

// Both k tiles of the G chunks of a group into acc (the warpgroup's wgmma;
// every warp of it runs this with the same range), `desc` the group's first
// k tile's: always whole groups (see wgmma_tile_product), no branch between
// the wgmma, whose registers ptxas would otherwise reuse between them.
template <typename T, int NT, int G>
__device__ __forceinline__ void wgmma_group(float (&acc)[NT][4], const uint4 (&v)[G][2],
                                            uint64_t desc) {
  fence_operands(acc);
  wgmma_fence();
#pragma unroll
  for (int u = 0; u < G; ++u) {
    const uint32_t a_lo[4] = {v[u][0].x, v[u][1].x, v[u][0].y, v[u][1].y};
    const uint32_t a_hi[4] = {v[u][0].z, v[u][1].z, v[u][0].w, v[u][1].w};
    Wgmma<NT>::template run<std::is_same_v<T, opscommon::BFloat16>>(
        acc, a_lo, desc + (2 * u) * wgmma_tile_step<NT>);
    Wgmma<NT>::template run<std::is_same_v<T, opscommon::BFloat16>>(
        acc, a_hi, desc + (2 * u + 1) * wgmma_tile_step<NT>);
  }
  wgmma_commit();
  wgmma_wait_all();
  fence_operands(acc);
}

// The loads of load_group for the wgmma, every one issued, none in a
// branch (A registers written in a branch make ptxas serialize the wgmma)
// and none waited for here: past `valid` a thread loads its row's first
// 16 bytes, finite state the zero weights of k past K multiply (a thread's
// 16 bytes are all in or all out of the row).
template <typename T, int G>
__device__ __forceinline__ void load_group_unconditional(uint4 (&v)[G][2],
                                                         const GlobalRows<T>& rows,
                                                         const KRange& kr, int u0) {
#pragma unroll
  for (int u = 0; u < G; ++u) {
    const int64_t off = u0 + u < kr.valid ? static_cast<int64_t>(u0 + u) * kChunk<T> : -kr.first;
    v[u][0] = __ldcg(reinterpret_cast<const uint4*>(rows.ra + off));
    v[u][1] = __ldcg(reinterpret_cast<const uint4*>(rows.rb + off));
  }
}

// tile_product on the warpgroup's wgmma, the state rows from L2 (rows at
// the range's first element, as GlobalRows), the range a whole number of
// pairs of groups (wgmma_whole_groups: the plan checks): the next group's
// loads issue before this one's products, which finish before its
// registers load again.
constexpr int kWgmmaGroups = 2 * kGroup;
template <typename T, int NT>
__device__ __forceinline__ void wgmma_tile_product(float (&acc)[NT][4], const GlobalRows<T>& rows,
                                                   KRange kr, uint32_t base) {
  constexpr int G = kGroup;
  // The range is the warpgroup's: from lane 0, so that ptxas sees its loop
  // uniform.
  kr.c0 = __shfl_sync(0xffffffffu, kr.c0, 0);
  kr.chunks = __shfl_sync(0xffffffffu, kr.chunks, 0);
  const uint64_t desc = weight_descriptor(base) + 2 * kr.c0 * wgmma_tile_step<NT>;
  uint4 va[G][2], vb[G][2];
  load_group_unconditional<T, G>(va, rows, kr, 0);
  int u = 0;
  for (; u + 2 * G < kr.chunks; u += 2 * G) {
    load_group_unconditional<T, G>(vb, rows, kr, u + G);
    wgmma_group<T, NT, G>(acc, va, desc + 2 * u * wgmma_tile_step<NT>);
    load_group_unconditional<T, G>(va, rows, kr, u + 2 * G);
    wgmma_group<T, NT, G>(acc, vb, desc + 2 * (u + G) * wgmma_tile_step<NT>);
  }
  // The last pair, with no loads past the range.
  load_group_unconditional<T, G>(vb, rows, kr, u + G);
  wgmma_group<T, NT, G>(acc, va, desc + 2 * u * wgmma_tile_step<NT>);
  wgmma_group<T, NT, G>(acc, vb, desc + 2 * (u + G) * wgmma_tile_step<NT>);
}
// Whether every warpgroup's k range (chunks of kChunk) is whole pairs of
// groups: S's chunks split evenly over the KS shares, each a multiple of
// kWgmmaGroups.
template <typename T>
inline bool wgmma_whole_groups(int64_t S, int64_t bm) {
  const Split s(bm);
  const int64_t kc = (S + kChunk<T> - 1) / kChunk<T>;
  return kc % s.KS == 0 && (kc / s.KS) % kWgmmaGroups == 0;
}

// -- thread block clusters (sm_90) -----------------------------------------------------------
//
// The forward's cluster variant: the column blocks of one batch block form
// one cluster. Each block keeps its own columns of the step's h for its rows
// in shared memory (two buffers, by step parity); the next step's product
// reads the whole rows from the cluster's blocks (distributed shared memory)
// instead of L2, and the blocks meet at the cluster's hardware barrier
// instead of a counter in global memory: both are on every step's critical
// path.

// This thread's shared-memory address of p (a shared-memory pointer).
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The four 8x8 matrices of 16-bit elements (or 8x4 of 32-bit ones) whose
// rows the lanes' `addr` give (lanes 8 m .. 8 m + 7: matrix m), one a
// register: lane l gets row l / 4, elements 2 (l % 4) + {0, 1} (32-bit:
// element l % 4) of each, the layout of an mma A fragment (sm_75+).
__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  __trap();  // never launched below sm_80 (the host checks the device)
#endif
}

// The address in the cluster's shared memory window of this block's
// shared-memory address `addr` in the cluster's block `rank`.
__device__ __forceinline__ uint32_t cluster_address(uint32_t addr, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
#else
  __trap();  // never launched below sm_90 (the host checks the device)
  return 0;
#endif
}

// 16 bytes at shared-memory address `addr` of the cluster's block `rank`.
__device__ __forceinline__ uint4 load_cluster_v4(uint32_t addr, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t remote = cluster_address(addr, rank);
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(remote));
  return v;
#else
  __trap();  // never launched below sm_90 (the host checks the device)
  return make_uint4(0, 0, 0, 0);
#endif
}

// Every thread of every block of the cluster arrives (its shared-memory
// writes released) and waits for all (theirs acquired).
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
#else
  __trap();
#endif
}

// -- mbarriers (sm_90): the block-local kernels' exchange in a cluster ------------------------
//
// Each block holds one mbarrier per state buffer. A step's writer pushes its
// columns into the other blocks' buffers with st.async, which counts the
// bytes on the receiving block's mbarrier; the block's own warps arrive on
// it once their columns are in its own buffer (one of them also posting
// the bytes the peers will send). A phase completes when every local warp
// arrived and every byte came: no cluster-wide barrier, no fence that waits
// for the step's global stores, each block going on once its own inputs
// are there.

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
  // Visible to the peers' complete_tx before the cluster barrier that follows.
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  __trap();
#endif
}

// This thread's arrival at the mbarrier at `bar` (its earlier shared-memory
// writes released to the waiters), posting `tx` more bytes to come.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar, uint32_t tx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 state, [%0], %1;\n"
      "}" ::"r"(bar),
      "r"(tx)
      : "memory");
#else
  __trap();
#endif
}

// Until the phase of parity `parity` of the mbarrier at `bar` completed (the
// peers' bytes acquired at cluster scope). Relaxed polls followed by one
// acquire fence restricted to shared memory were slower (H200, T256,
// kernel time: float32 TF32 B8 S128 inference 280 against 244 us, B64 S128
// 336 against 289, float16 B8 S512 456 against 446). An acquire at CTA
// scope, which drops the L1 invalidation (CCTL.IVALL) that follows the
// wait, gained 0-2% (float32 TF32 B64 S128 inference 325 against 330 us,
// float16 B8 S512 462 against 464): the wait is for the peers, not for the
// invalidation, and the cluster scope stays.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}" ::"r"(bar),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

// v (4 or 8 bytes) to the cluster shared-memory address `addr`, its bytes
// counted on the mbarrier at cluster address `bar` (the same block's).
__device__ __forceinline__ void store_async(uint32_t addr, uint32_t v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(addr),
      "r"(v), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}
// 16 bytes (16-byte aligned), as above.
__device__ __forceinline__ void store_async(uint32_t addr, uint4 v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(addr),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void store_async(uint32_t addr, float2 v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
          addr),
      "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(bar)
      : "memory");
#else
  __trap();
#endif
}

// A from the cluster's state buffers: rows la / lb (rows of the batch
// block) of the [bm, NJ] buffers at shared address `buf` of each block,
// block b holding columns b * NJ .. + NJ - 1 (NJ a multiple of 8: a
// thread's 16 bytes are in one block); chunk u of the thread's range (see
// KRange) starts at column first + u * chunk of the whole row.
struct ClusterRows {
  uint32_t buf;
  int la, lb, NJ, elem;  // elem: bytes an element
  int first, chunk;
  __device__ __forceinline__ uint4 operator()(int r, int u) const {
    const int off = first + u * chunk;
    const uint32_t rank = static_cast<uint32_t>(off / NJ);
    const uint32_t col = static_cast<uint32_t>(off - static_cast<int>(rank) * NJ);
    return load_cluster_v4(buf + ((r ? lb : la) * NJ + col) * elem, rank);
  }
};

// Sum the k-split partial accumulators into those of the ks == 0 warps.
// Every thread of the block calls it (it holds a barrier).
template <int NACC>
__device__ __forceinline__ void reduce_k_split(float* acc, float* red, const Split& s, int warp,
                                               bool active) {
  const int lane = threadIdx.x & 31;
  const int ks = warp / s.I, mt = warp % s.I;
  if (active && ks > 0) {
    float* dst = red + ((ks - 1) * s.I + mt) * NACC * 32 + lane;
#pragma unroll
    for (int e = 0; e < NACC; ++e) dst[e * 32] = acc[e];
  }
  __syncthreads();
  if (active && ks == 0) {
    for (int p = 1; p < s.KS; ++p) {
      const float* src = red + ((p - 1) * s.I + mt) * NACC * 32 + lane;
#pragma unroll
      for (int e = 0; e < NACC; ++e) acc[e] += src[e * 32];
    }
  }
}

// The wgmma forward's two k halves (KS == 2, Q even) exchanged by column
// groups instead of summed into the first: warp (ks, mt) keeps the column
// groups q of its own half (ks Q / 2 .. + Q / 2 - 1), writes the other
// half's partial sums for its partner (1 - ks, mt) and adds the partner's
// into its own, so that both warpgroups run cells (half each) where the
// first ran them all while the second waited. The same sums as
// reduce_k_split's, bit for bit (one addition of the two partials, which
// commutes). red is reduce_k_split's buffer (the same bytes: each warp
// passes half its sums). Every thread of the block calls it (it holds a
// barrier).
template <int Q>
__device__ __forceinline__ void exchange_k_halves(float (&acc)[3 * Q][4], float* red, int I,
                                                  int warp, bool active) {
  static_assert(Q % 2 == 0, "whole halves of the column groups");
  constexpr int H = Q / 2, N = 3 * H * 4;  // floats a thread passes its partner
  const int lane = threadIdx.x & 31, ks = warp / I, mt = warp % I;
  // Compile-time indices into acc on both sides of the branch (a runtime
  // index would put it in local memory).
  auto pass = [&](auto first) {
    constexpr int mine = decltype(first)::value ? 0 : H, theirs = H - mine;
    float* dst = red + (ks * I + mt) * N * 32 + lane;
    if (active) {
#pragma unroll
      for (int g = 0; g < 3; ++g) {
#pragma unroll
        for (int q = 0; q < H; ++q) {
#pragma unroll
          for (int e = 0; e < 4; ++e) dst[((g * H + q) * 4 + e) * 32] = acc[g * Q + theirs + q][e];
        }
      }
    }
    __syncthreads();
    if (active) {
      const float* src = red + ((1 - ks) * I + mt) * N * 32 + lane;
#pragma unroll
      for (int g = 0; g < 3; ++g) {
#pragma unroll
        for (int q = 0; q < H; ++q) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[g * Q + mine + q][e] += src[((g * H + q) * 4 + e) * 32];
        }
      }
    }
  };
  if (ks == 0) {
    pass(std::true_type{});
  } else {
    pass(std::false_type{});
  }
}

// -- per-thread state -----------------------------------------------------------------------
//
// A block has at most kTcMaxRows = 128 rows, so at most 8 row tiles: warp w
// < I owns row tile w (rows r0 + 16 w + lane / 4 and + 8) for the block's
// columns j0 + 8 q + 2 (lane % 4) + {0, 1}, q < Q, every step. What it owns
// stays in registers across steps (the cell state forward, its gradient
// backward, the bias), and the next step's inputs that no other block
// writes are loaded before the barrier, so their latency hides behind it.

// Two neighbouring columns of one row: packed in one register (16-bit
// types) or a float2 (float32).
template <typename T>
using Pair = std::conditional_t<sizeof(T) == 2, uint32_t, float2>;

template <typename T>
__device__ __forceinline__ T from_bits(uint16_t b) {
  T v;
  memcpy(&v, &b, sizeof(v));
  return v;
}
template <typename T>
__device__ __forceinline__ float elem_of(Pair<T> w, int e) {
  if constexpr (sizeof(T) == 4) {
    return e ? w.y : w.x;
  } else {
    return to_acc(from_bits<T>(static_cast<uint16_t>(e ? w >> 16 : w & 0xffffu)));
  }
}
// Two elements at p, p + 1 read one at a time (p may be aligned to one
// element only: the caller's c0 and bias).
template <typename T>
__device__ __forceinline__ Pair<T> load_two(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return make_float2(p[0], p[1]);
  } else {
    return uint32_t(bits_of(p[0])) | (uint32_t(bits_of(p[1])) << 16);
  }
}
// Two elements at p in one access, p aligned to the pair (buffers this op
// allocated, even offsets).
template <typename T>
__device__ __forceinline__ Pair<T> load_pair(const T* p) {
  return *reinterpret_cast<const Pair<T>*>(p);
}
// Two elements at p, in one access where `one` (p aligned to the pair).
// A prefetch that is only used steps later must not combine two 16-bit
// loads into a pair where it issues them: that waits for both to arrive.
template <typename T>
__device__ __forceinline__ Pair<T> load_pair_if(const T* p, bool one) {
  if constexpr (sizeof(T) == 4) {
    return load_two(p);  // two registers: nothing to combine
  } else {
    return one ? load_pair(p) : load_two(p);
  }
}
// Whether the pairs of these tensors are aligned (their element offsets
// are even: S is a multiple of 8 on these kernels).
template <typename T>
__device__ __forceinline__ bool pairs_aligned(const void* a, const void* b, const void* c,
                                              const void* d) {
  const uintptr_t any = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                        reinterpret_cast<uintptr_t>(c) | reinterpret_cast<uintptr_t>(d);
  return any % (2 * sizeof(T)) == 0;
}
template <typename T>
__device__ __forceinline__ void store_pair(T* p, Pair<T> v) {
  *reinterpret_cast<Pair<T>*>(p) = v;
}

// a, b rounded to T, packed; ra, rb: the rounded values.
template <typename T>
__device__ __forceinline__ Pair<T> pack_rounded(float a, float b, float& ra, float& rb) {
  if constexpr (sizeof(T) == 4) {
    ra = a;
    rb = b;
    return make_float2(a, b);
  } else {
    const T x = to_storage<T>(a), y = to_storage<T>(b);
    ra = to_acc(x);
    rb = to_acc(y);
    return uint32_t(bits_of(x)) | (uint32_t(bits_of(y)) << 16);
  }
}

// The two elements at p (see load_two) as floats.
template <typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[2]) {
  const Pair<T> v = load_two(p);
  out[0] = elem_of<T>(v, 0);
  out[1] = elem_of<T>(v, 1);
}

// v summed over the warp's lanes of one lane % 4, which hold the same
// columns of 8 rows (an accumulator tile's rows lane / 4).
__device__ __forceinline__ float sum_over_rows(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}

// The forward product's part of a pair, rec[g][e]: the accumulator tile of
// gate g, columns 8q .. (tiles g * Q + q), row half `half`, column e.
template <int Q>
__device__ __forceinline__ void gates_of_pair(const float (&acc)[3 * Q][4], int q, int half,
                                              float (&rec)[3][2]) {
#pragma unroll
  for (int g = 0; g < 3; ++g) {
    rec[g][0] = acc[g * Q + q][2 * half];
    rec[g][1] = acc[g * Q + q][2 * half + 1];
  }
}

// The cell's math in these kernels: the hardware exp2 and reciprocal in
// every dtype, as FastMath, but flushing subnormal inputs and results to
// zero (.ftz): without it each exp2 and reciprocal carries a range check
// and rescale (three or four more instructions), on every step's chain.
// float32 here is on TF32 tensor cores, whose products carry about 1e-3
// relative error: the cell's 1e-6 is nothing beside it, and a result below
// 2^-126 (a sigmoid of under -87) is zero instead of a subnormal.
using TcMath = HardwareMath<true>;
// float16 and bfloat16 (TcMathFor): tanh and the sigmoids on the hardware
// tanh (tanh.approx.f32, sm_75 and newer, about 2^-11 relative error;
// sigmoid(x) = tanh(x / 2) / 2 + 1 / 2), one multifunction-unit
// instruction each where exp2 and a reciprocal took two: 4 a cell forward
// where there were 7. Their error is that of the 16-bit result's rounding
// (2^-11, 2^-8); float32 on TF32 keeps TcMath.
struct TanhMath : TcMath {
  static __device__ __forceinline__ float tanh(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    float r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
#else
    return TcMath::tanh(v);
#endif
  }
  static __device__ __forceinline__ float sigmoid(float x) {
    return fmaf(0.5f, tanh(0.5f * x), 0.5f);
  }
};
template <typename T>
using TcMathFor = std::conditional_t<sizeof(T) == 2, TanhMath, TcMath>;

// The two elements of a prefetched pair as floats, read by an instruction
// of their own (float32: an add of +0, exact but for the sign of a zero
// input, which the cell does not tell apart). The block-local kernels read
// their prefetched registers this way before a row's branch: a register a
// load may still be writing on one path makes ptxas wait for every load
// of that scoreboard before reusing it, and those are the next steps'.
template <typename T>
__device__ __forceinline__ void floats_of(Pair<T> v, float (&f)[2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    f[e] = elem_of<T>(v, e);
    if constexpr (sizeof(T) == 4) f[e] = __fadd_rn(f[e], 0.f);
  }
}

// The forward cell of two neighbouring columns of one row (a pair) from the
// gates' pre-activations z[g] = p[g] + rec[g] + bias[g] in float32: rounded
// to T, packed into pre[g] (what the backward recomputes from); the cell
// from the rounded values and c (updated as stored); h and c packed into
// hv, cv. M: the cell's math (full float32's block-local kernels: the
// accurate one).
template <typename T, typename M = TcMathFor<T>>
__device__ __forceinline__ void forward_pair_from(const float (&z)[3][2], float (&c)[2],
                                                  Pair<T> (&pre)[3], Pair<T>& hv, Pair<T>& cv) {
  float x[3][2];
#pragma unroll
  for (int g = 0; g < 3; ++g) pre[g] = pack_rounded<T>(z[g][0], z[g][1], x[g][0], x[g][1]);
  float nh[2], nc[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    cell_forward_math<float, M>(x[0][e], x[1][e], x[2][e], c[e], nh[e], nc[e]);
  }
  hv = pack_rounded<T>(nh[0], nh[1], nh[0], nh[1]);
  cv = pack_rounded<T>(nc[0], nc[1], c[0], c[1]);
}
// The same from p (T), rec and bias.
template <typename T>
__device__ __forceinline__ void forward_pair(const Pair<T> (&p)[3], const float (&rec)[3][2],
                                             const float (&bias)[3][2], float (&c)[2],
                                             Pair<T> (&pre)[3], Pair<T>& hv, Pair<T>& cv) {
  float z[3][2];
#pragma unroll
  for (int g = 0; g < 3; ++g) {
#pragma unroll
    for (int e = 0; e < 2; ++e) z[g][e] = elem_of<T>(p[g], e) + rec[g][e] + bias[g][e];
  }
  forward_pair_from<T>(z, c, pre, hv, cv);
}

// The backward cell of a pair from floats: grad_h = rec + go (+ grad_h_n
// at ghn where not null), d[g] the pre-activation gradients of the three
// gates (g[g] their pre-activations, c the previous cell state), dc
// updated (rounded as stored). A row that does not run (!live) gets zero
// d, its dc held. M as forward_pair_from's.
template <typename T, typename M = TcMathFor<T>>
__device__ __forceinline__ void backward_pair_from(bool live, const float (&rec)[2],
                                                   const float (&go)[2], const T* ghn,
                                                   const float (&g)[3][2], const float (&c)[2],
                                                   float (&dc)[2], float (&d)[3][2]) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    d[0][e] = d[1][e] = d[2][e] = 0.f;
    if (!live) continue;
    float grad_h = rec[e] + go[e];
    if (ghn != nullptr) grad_h += to_acc(ghn[e]);
    float d_c;
    cell_backward_math<float, M>(grad_h, dc[e], g[0][e], g[1][e], g[2][e], c[e], d[0][e], d[1][e],
                                 d[2][e], d_c);
    dc[e] = to_acc(to_storage<T>(d_c));
  }
}
// The same from pairs of T.
template <typename T>
__device__ __forceinline__ void backward_pair(bool live, const float (&rec)[2], Pair<T> go,
                                              const T* ghn, const Pair<T> (&g)[3], Pair<T> c,
                                              float (&dc)[2], float (&d)[3][2]) {
  float gof[2], gf[3][2], cf[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    gof[e] = elem_of<T>(go, e);
    cf[e] = elem_of<T>(c, e);
#pragma unroll
    for (int k = 0; k < 3; ++k) gf[k][e] = elem_of<T>(g[k], e);
  }
  backward_pair_from<T>(live, rec, gof, ghn, gf, cf, dc, d);
}

// -- forward --------------------------------------------------------------------------------
//
// kPacked (both kernels): bs holds a packed run's batch sizes in device
// memory (see rows_at): step t runs rows below rows_at(t) and skips the
// product of row tiles past it; a row writes h_n / c_n at its own last step
// (forward), gets grad_h_n there and zero pre-activation gradients past it
// (backward). Without it the kernels are the whole batch's, with none of
// the per-step checks (they cost the forward about 15% at T256).
//
// kCluster (forward): the launch's clusters are its batch blocks (gridDim.x
// blocks each, sm_90): a step's h is exchanged in distributed shared memory
// and the barrier is the cluster's (see above). Arrivals are unused then.
//
// kHalfRows (both kernels, B <= 8: one row tile, its second half past the
// batch): the product skips the loads of the second row half, whose
// results nothing stores, instead of loading row B - 1 for it; half the
// loads a step from L2. A template parameter, not a flag: a runtime flag
// (a branch or a predicated load) made the kernels slower where it was
// off (H100: float16 B64 S1024 3-4%, float32 TF32 B8 S512
// forward+backward 7.7 -> 9.0 ms at T1024), where at B8 it took float16
// S1024's forward step from 3.34-3.56 to 3.07-3.20 us.

//
// kSpread (forward, KS = kTcWarps / I > 1 warps a row tile, not kCluster): the
// cells of a step are spread over all the block's threads instead of its
// tiles' first warps. Every warp writes its partial sums (its share of k)
// to shared memory; thread x then owns the pairs x, x + kTcThreads, ...
// of the block's 64 I Q column pairs (lane, q, tile, row half; half 1
// last, none under kHalfRows), sums their KS partials and runs their cells,
// its cell state in registers across steps. Without it a tile's first
// warp read the other warps' sums and ran all of its 2Q pairs' cells while
// the block's other warps waited at the barrier: a quarter of a float16
// B8 S1024 step in an Nsight Compute profile (H100, warp stall sampling).
//
// kWgmma (forward, 16-bit types, 4 or 8 row tiles a block, none of the
// above): the product on the warpgroups' wgmma (see above) where the build
// has it, else as without. With 4 row tiles (two warpgroups, each half of
// k) and Q even, the halves' sums are exchanged by column groups
// (exchange_k_halves) and both warpgroups run cells, half each.
//
// alternate_cells (an inference chunk, ForwardSteps): step t's cell state
// goes to slot t & 1 of cells.
template <typename T, int Q, bool kPacked, bool kCluster = false, bool kHalfRows = false,
          bool kSpread = false, bool kWgmma = false>
__global__ void __launch_bounds__(kTcThreads, 1)
    forward_tc_kernel(int64_t steps, int64_t B, int64_t S, int64_t bm, T* gates, const T* bias,
                      const T* h0, const T* w_h, int64_t ld_w, const T* c0, T* outs, T* cells,
                      bool alternate_cells, T* h_n, T* c_n, const int64_t* bs,
                      unsigned long long* arrivals) {
  constexpr int NT = 3 * Q, NACC = 4 * NT;
  extern __shared__ __align__(16) unsigned char smem[];
  const Split sp(bm);
  const int64_t KC = (S + kChunk<T> - 1) / kChunk<T>, KT = 2 * KC;  // k chunks, tiles
  uint2* frag = reinterpret_cast<uint2*>(smem);
  float* red = reinterpret_cast<float*>(smem + weight_bytes(KT, NT));
  // kCluster: the state buffers [2][bm][NJ], after the reduction buffer.
  T* state = reinterpret_cast<T*>(smem + weight_bytes(KT, NT) + reduce_bytes(sp, 4 * NT));
  constexpr int NJ = 8 * Q;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * 8 * Q;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * bm;
  static_assert(!kWgmma || (sizeof(T) == 2 && !kCluster && !kHalfRows && !kSpread),
                "the wgmma forward is the 16-bit padded and packed kernels'");
  constexpr bool kWg = kWgmma && kWgmmaBuilt;
  // Tile nt = g * Q + q: gate g, columns j0 + 8q .. + 7 (of W_h^T, see
  // w_hT_at). The 16-byte loads' row lambda below maps the columns again,
  // as forward_local's two loaders do: there, one lambda for both cost the
  // step loop 11% (see forward_local), so each loader keeps its own.
  auto weight = [&](int64_t k, int nt, int n) -> uint32_t {
    const int64_t j = j0 + 8 * (nt % Q) + n;
    if (k >= S || j >= S) return 0;
    return bits_of(w_hT_at(w_h, ld_w, k, (nt / Q) * S + j));
  };
  if (rows_vectorizable(w_h, ld_w, S)) {
    constexpr FragLayout kLayout = kWg ? FragLayout::kCanonical : FragLayout::kPermuted;
    load_fragment_rows<T, kLayout>(smem, 1, static_cast<int>(KC), NT, S,
                                   [&](int, int nt, int n) -> const T* {
                                     const int64_t j = j0 + 8 * (nt % Q) + n;
                                     return j < S ? w_h + ((nt / Q) * S + j) * ld_w : nullptr;
                                   });
    if constexpr (kWg) fence_proxy_async_shared();
    __syncthreads();
  } else if constexpr (kWg) {
    load_weights_canonical<T>(reinterpret_cast<uint32_t*>(smem), KT, NT, weight);
  } else {
    load_weights<T>(frag, KT, NT, weight);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t S3 = 3 * S, step_gates = B * S3, step_state = B * S;
  const bool active = warp < sp.I * sp.KS;
  const int ks = warp / sp.I, mt = warp % sp.I;
  // The warps that run cells (`owner`) and the column groups q whose cells
  // each runs (`owns`): the row tiles' first warps, all of them; with the
  // wgmma's two k halves (4 row tiles), every warp, its half of them
  // (exchange_k_halves).
  constexpr bool kHalvable = kWg && Q % 2 == 0;
  const bool halves = kHalvable && sp.KS == 2;
  const bool owner = halves ? active : warp < sp.I;
  const int q_lo = halves ? ks * (Q / 2) : 0, q_hi = halves ? q_lo + Q / 2 : Q;
  auto owns = [&](int q) { return !kWg || (q >= q_lo && q < q_hi); };
  const int64_t row_base = r0 + 16 * mt + (lane >> 2);
  const int64_t col_base = j0 + 2 * (lane & 3);
  auto valid = [&](int half, int q) {
    return owns(q) && row_base + 8 * half < B && col_base + 8 * q < S;
  };
  auto at = [&](int half, int q) { return (row_base + 8 * half) * S + col_base + 8 * q; };

  float c_reg[Q][2][2] = {}, b_reg[Q][3][2] = {};
  Pair<T> p_next[Q][2][3] = {};  // P_t of (q, half, gate): two columns
  auto prefetch_p = [&](int64_t t) {
    const T* g_t = gates + t * step_gates;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (!valid(half, q)) continue;
        const int64_t row = row_base + 8 * half, j = col_base + 8 * q;
#pragma unroll
        for (int g = 0; g < 3; ++g) p_next[q][half][g] = load_pair(g_t + row * S3 + g * S + j);
      }
    }
  };
  if (owner && !kSpread) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (valid(half, q)) load_floats(c0 + at(half, q), c_reg[q][half]);
      }
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        if (col_base + 8 * q < S) load_floats(bias + g * S + col_base + 8 * q, b_reg[q][g]);
      }
    }
    prefetch_p(0);
  }

  static_assert(!(kSpread && kCluster), "the cluster variant keeps its cells on the tiles' warps");
  // kSpread: the thread's pairs (see above), their cell state, bias and
  // next inputs.
  const int npairs = (kHalfRows ? 32 : 64) * sp.I * Q;
  struct SpreadPair {
    int mt, half, q, lane;
    int64_t row, j;
  };
  auto spread_pair = [&](int k) {
    const int p = static_cast<int>(threadIdx.x) + kTcThreads * k, g = p / 32;
    SpreadPair w;
    w.lane = p % 32;
    w.q = g % Q;
    w.mt = (g / Q) % sp.I;
    w.half = g / (Q * sp.I);
    w.row = r0 + 16 * w.mt + w.lane / 4 + 8 * w.half;
    w.j = j0 + 8 * w.q + 2 * (w.lane % 4);
    return w;
  };
  auto spread_valid = [&](int k) {
    const int p = static_cast<int>(threadIdx.x) + kTcThreads * k;
    if (p >= npairs) return false;
    const SpreadPair w = spread_pair(k);
    return w.row < B && w.j < S;
  };
  float wc[kSpread ? Q : 1][2] = {}, wb[kSpread ? Q : 1][3][2] = {};
  Pair<T> wp[kSpread ? Q : 1][3] = {};
  auto spread_prefetch = [&](int64_t t) {
    const T* g_t = gates + t * step_gates;
#pragma unroll
    for (int k = 0; k < (kSpread ? Q : 0); ++k) {
      if (!spread_valid(k)) continue;
      const SpreadPair w = spread_pair(k);
#pragma unroll
      for (int g = 0; g < 3; ++g) wp[k][g] = load_pair(g_t + w.row * S3 + g * S + w.j);
    }
  };
  if constexpr (kSpread) {
#pragma unroll
    for (int k = 0; k < Q; ++k) {
      if (!spread_valid(k)) continue;
      const SpreadPair w = spread_pair(k);
      load_floats(c0 + w.row * S + w.j, wc[k]);
#pragma unroll
      for (int g = 0; g < 3; ++g) load_floats(bias + g * S + w.j, wb[k][g]);
    }
    spread_prefetch(0);
  }

  const int64_t tile_row = r0 + 16 * mt;  // the warp's row tile's first row
  // The warp's k range and the thread's rows (clamped to the batch: the
  // rows past it load row B - 1 and are not stored), set up once: on every
  // step they stood between the barrier and the state's loads.
  const KRange kr = KRange::of<T>(S, KC * ks / sp.KS, KC * (ks + 1) / sp.KS);
  const int64_t ra = std::min<int64_t>(row_base, B - 1);
  const int64_t rb = std::min<int64_t>(row_base + 8, B - 1);
  const int64_t ra_at = ra * S + kr.first, rb_at = rb * S + kr.first;
  for (int64_t t = 0; t < steps; ++t) {
    const bool last = t == steps - 1;
    const int64_t n = kPacked ? rows_at(bs, B, steps, t) : B;
    const int64_t n_next = kPacked ? rows_at(bs, B, steps, t + 1) : 0;
    if (kPacked && r0 >= n) break;  // sizes do not increase: this block row is done
    const bool live = active && (!kPacked || tile_row < n);
    const T* h_prev = t ? outs + (t - 1) * step_state : h0;
    float acc[NT][4] = {};
    if constexpr (kWg) {
      // The whole warpgroup runs the product where any of its rows do (the
      // others', past n, are not stored).
      if (__shfl_sync(0xffffffffu, active && (!kPacked || r0 + 16 * (mt & ~3) < n), 0)) {
        // The wgmma's own accumulators, copied out (no code after them
        // writes the registers the wgmma use).
        float wacc[NT][4] = {};
        wgmma_tile_product<T, NT>(wacc, GlobalRows<T>{h_prev + ra_at, h_prev + rb_at}, kr,
                                  shared_address(smem));
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            asm volatile("mov.b32 %0, %1;" : "=f"(acc[nt][e]) : "f"(wacc[nt][e]));
          }
        }
      }
    } else if (live) {
      if (kCluster && t > 0) {
        const uint32_t buf = shared_address(state + ((t - 1) & 1) * bm * NJ);
        const ClusterRows rows{buf,      static_cast<int>(ra - r0),   static_cast<int>(rb - r0),
                               NJ,       static_cast<int>(sizeof(T)), kr.first,
                               kChunk<T>};
        tile_product<T, NT>(acc, rows, kr, frag);
      } else {
        tile_product<T, NT, !kHalfRows>(acc, GlobalRows<T>{h_prev + ra_at, h_prev + rb_at}, kr,
                                        frag);
      }
    }
    if constexpr (kSpread) {
      // Every warp's partial sums (zero where its tile did not run).
      float2* red2 = reinterpret_cast<float2*>(red);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int half = 0; half < (kHalfRows ? 1 : 2); ++half) {
          red2[((warp * NT + nt) * 2 + half) * 32 + lane] =
              make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
        }
      }
      __syncthreads();
    } else if (sp.KS > 1) {
      bool exchanged = false;
      if constexpr (kHalvable) {
        if (halves) {
          exchange_k_halves<Q>(acc, red, sp.I, warp, live);
          exchanged = true;
        }
      }
      if (!exchanged) reduce_k_split<NACC>(&acc[0][0], red, sp, warp, live);
    }
    // The cell; the step's h first, the one output the other blocks wait
    // for: the block arrives at the barrier once its h is written, and
    // fetches the next step's inputs while the other blocks arrive. Where
    // the pre-activations and c of the thread's pairs fit in registers
    // (kHold), their stores wait until after the arrival too.
    constexpr bool kHold = Q * sizeof(T) <= 4;
    Pair<T> pre[Q][2][3] = {}, cv[Q][2] = {};
    auto stored = [&](int half, int q) {
      return valid(half, q) && !(kPacked && row_base + 8 * half >= n);
    };
    auto store_rest = [&](int half, int q) {
      const int64_t row = row_base + 8 * half, j = col_base + 8 * q, i = row * S + j;
      T* g_t = gates + t * step_gates;
#pragma unroll
      for (int g = 0; g < 3; ++g) store_pair(g_t + row * S3 + g * S + j, pre[q][half][g]);
      store_pair(cells + cell_slot(t, alternate_cells) * step_state + i, cv[q][half]);
      if (kPacked ? row >= n_next : last) store_pair(c_n + i, cv[q][half]);  // the row's last step
    };
    Pair<T> wpre[kSpread ? Q : 1][3] = {}, wcv[kSpread ? Q : 1] = {};
    auto spread_stored = [&](int k) {
      return spread_valid(k) && !(kPacked && spread_pair(k).row >= n);
    };
    if constexpr (kSpread) {
      const float2* red2 = reinterpret_cast<const float2*>(red);
#pragma unroll
      for (int k = 0; k < Q; ++k) {
        if (!spread_stored(k)) continue;
        const SpreadPair w = spread_pair(k);
        float rec[3][2] = {};
        for (int ks = 0; ks < sp.KS; ++ks) {
#pragma unroll
          for (int g = 0; g < 3; ++g) {
            const float2 v =
                red2[(((ks * sp.I + w.mt) * NT + g * Q + w.q) * 2 + w.half) * 32 + w.lane];
            rec[g][0] += v.x;
            rec[g][1] += v.y;
          }
        }
        Pair<T> hv;
        forward_pair<T>(wp[k], rec, wb[k], wc[k], wpre[k], hv, wcv[k]);
        const int64_t i = w.row * S + w.j;
        store_pair(outs + t * step_state + i, hv);
        if (kPacked ? w.row >= n_next : last) store_pair(h_n + i, hv);
      }
    }
    if (owner && !kSpread) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          const int64_t row = row_base + 8 * half, j = col_base + 8 * q, i = row * S + j;
          if (!stored(half, q)) continue;
          float rec[3][2];
          gates_of_pair<Q>(acc, q, half, rec);
          Pair<T> hv;
          forward_pair<T>(p_next[q][half], rec, b_reg[q], c_reg[q][half], pre[q][half], hv,
                          cv[q][half]);
          store_pair(outs + t * step_state + i, hv);
          if (kCluster && !last) {
            store_pair(state + (t & 1) * bm * NJ + (row - r0) * NJ + (j - j0), hv);
          }
          if (kPacked ? row >= n_next : last) store_pair(h_n + i, hv);
          if constexpr (!kHold) store_rest(half, q);
        }
      }
    }
    if (!kCluster && !last) row_arrive(arrivals);
    if constexpr (kSpread) {
      T* g_t = gates + t * step_gates;
#pragma unroll
      for (int k = 0; k < Q; ++k) {
        if (!spread_stored(k)) continue;
        const SpreadPair w = spread_pair(k);
        const int64_t i = w.row * S + w.j;
#pragma unroll
        for (int g = 0; g < 3; ++g) store_pair(g_t + w.row * S3 + g * S + w.j, wpre[k][g]);
        store_pair(cells + cell_slot(t, alternate_cells) * step_state + i, wcv[k]);
        if (kPacked ? w.row >= n_next : last) store_pair(c_n + i, wcv[k]);
      }
      if (!last) spread_prefetch(t + 1);
    }
    if (owner && !kSpread) {
      if constexpr (kHold) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int q = 0; q < Q; ++q) {
            if (stored(half, q)) store_rest(half, q);
          }
        }
      }
      if (!last) prefetch_p(t + 1);
    }
    // Both barriers hold the block's threads too: the reduction buffer is
    // free again before the next step writes it.
    if (!last) {
      if constexpr (kCluster) {
        cluster_barrier();
      } else {
        row_wait(arrivals, static_cast<unsigned long long>(t + 1) * gridDim.x);
      }
    }
  }
  // No block of a cluster leaves while another may still read its buffers
  // (the last step's product; a packed cluster stops at one step, all its
  // blocks together).
  if constexpr (kCluster) cluster_barrier();
}

// -- backward -------------------------------------------------------------------------------

// The global-barrier backward kernels' running dc of the thread's pairs
// (see fetch_backward_inputs): loaded from `in` (none: zero) at a chunk's
// start, stored (rounded to T) to `out` at its end.
template <typename T, int Q, typename Valid, typename At>
__device__ __forceinline__ void load_backward_dc(const T* in, Valid valid, At at,
                                                 float (&dc)[Q][2][2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (valid(half, q) && in != nullptr) load_floats(in + at(half, q), dc[q][half]);
    }
  }
}
template <typename T, int Q, typename Valid, typename At>
__device__ __forceinline__ void store_backward_dc(T* out, Valid valid, At at,
                                                  const float (&dc)[Q][2][2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (!valid(half, q)) continue;
      float a, b;
      store_pair(out + at(half, q), pack_rounded<T>(dc[q][half][0], dc[q][half][1], a, b));
    }
  }
}

// The global-barrier backward kernels' cell inputs of step t, fetched a
// step ahead: grad_outputs[t] (left as it is without them), G_t of the
// three gates and c_{t-1} of the thread's pairs (row half, column group q;
// rows row_base + 8 half, columns col_base + 8 q) that `valid` takes, two
// columns a register.
template <typename T, int Q, typename Valid, typename At>
__device__ __forceinline__ void fetch_backward_inputs(
    int64_t t, const T* go, const T* gates, const T* cells, const T* c0, int64_t S, int64_t S3,
    int64_t step_gates, int64_t step_state, int64_t row_base, int64_t col_base, bool one,
    Valid valid, At at, Pair<T> (&n_go)[Q][2], Pair<T> (&n_g)[Q][2][3], Pair<T> (&n_c)[Q][2]) {
  const T* g_t = gates + t * step_gates;
  const T* c_prev = t ? cells + (t - 1) * step_state : c0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (!valid(half, q)) continue;
      const int64_t i = at(half, q), row = row_base + 8 * half, j = col_base + 8 * q;
      if (go != nullptr) n_go[q][half] = load_pair_if(go + t * step_state + i, one);
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        n_g[q][half][g] = load_pair_if(g_t + row * S3 + g * S + j, one);
      }
      n_c[q][half] = load_pair_if(c_prev + i, one);
    }
  }
}

// The step's backward cells of a thread's pairs (as fetch_backward_inputs
// takes them), from the tile product's sums `acc` (column group q's in
// acc[q]): `live(row)` whether the row runs the step, `row_last(row)`
// whether it is the row's last (grad_h_n comes in). Stores dG_t's pairs and
// adds them by column into `sums`, the bias gradient's over the thread's
// rows.
template <typename T, int Q, int N, typename Valid, typename At, typename Live, typename Last>
__device__ __forceinline__ void backward_cells(const float (&acc)[N][4], T* dg_t, int64_t S,
                                               int64_t S3, int64_t row_base, int64_t col_base,
                                               Valid valid, At at, Live live, Last row_last,
                                               const T* ghn, const Pair<T> (&n_go)[Q][2],
                                               const Pair<T> (&n_g)[Q][2][3],
                                               const Pair<T> (&n_c)[Q][2], float (&dc)[Q][2][2],
                                               float (&sums)[3][Q][2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (!valid(half, q)) continue;
      const int64_t i = at(half, q), row = row_base + 8 * half, j = col_base + 8 * q;
      const float rec[2] = {acc[q][2 * half], acc[q][2 * half + 1]};
      float d[3][2];
      backward_pair<T>(live(row), rec, n_go[q][half],
                       row_last(row) && ghn != nullptr ? ghn + i : nullptr, n_g[q][half],
                       n_c[q][half], dc[q][half], d);
#pragma unroll
      for (int g = 0; g < 3; ++g) {
        float r0v, r1v;
        store_pair(dg_t + row * S3 + g * S + j, pack_rounded<T>(d[g][0], d[g][1], r0v, r1v));
        sums[g][q][0] += d[g][0];
        sums[g][q][1] += d[g][1];
      }
    }
  }
}

// A warp's bias-gradient sums over its tile's 16 rows (lanes with the same
// lane % 4 hold the same columns) into `tile`, the tile's [3][W] sums
// (column group q's pair at 8 q + 2 (lane % 4)).
template <int Q>
__device__ __forceinline__ void store_tile_bias_sums(float* tile, int W,
                                                     const float (&sums)[3][Q][2], int lane) {
#pragma unroll
  for (int g = 0; g < 3; ++g) {
#pragma unroll
    for (int q = 0; q < Q; ++q) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = sum_over_rows(sums[g][q][e]);
        if (lane < 4) tile[g * W + 8 * q + 2 * lane + e] = v;
      }
    }
  }
}

// The block's bias-gradient sums of its W columns from j0, its `tiles`
// row tiles' in order (deterministic), added to `partial_row` ([3S]): this
// block alone adds to these entries.
__device__ __forceinline__ void add_block_bias_sums(float* partial_row, const float* bsum, int W,
                                                    int tiles, int64_t j0, int64_t S) {
  for (int e = threadIdx.x; e < 3 * W; e += blockDim.x) {
    const int g = e / W, c = e % W;
    const int64_t j = j0 + c;
    if (j >= S) continue;
    float s = 0.f;
    for (int m = 0; m < tiles; ++m) s += bsum[m * 3 * W + e];
    partial_row[g * S + j] += s;
  }
}

template <typename T, int Q, bool kPacked, bool kHalfRows = false>
__global__ void __launch_bounds__(kTcThreads, 1)
    backward_tc_kernel(int64_t T_, int64_t t0, int64_t t1, int64_t K, int64_t B, int64_t S,
                       int64_t bm, const T* go, const T* ghn, const T* gcn, T* dG, const T* w_h,
                       int64_t ld, T* dc, const T* gates, const T* cells, const T* c0,
                       float* partial, const int64_t* bs, unsigned long long* arrivals) {
  constexpr int NT = Q, NACC = 4 * NT, NJ = 8 * Q;
  extern __shared__ __align__(16) unsigned char smem[];
  const Split sp(bm);
  const int64_t S3 = 3 * S, KC = (S3 + kChunk<T> - 1) / kChunk<T>, KT = 2 * KC;
  uint2* frag = reinterpret_cast<uint2*>(smem);
  float* red = reinterpret_cast<float*>(smem + weight_bytes(KT, NT));
  float* bsum = red + reduce_bytes(sp, NACC) / sizeof(float);  // [I][3 * NJ]
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * NJ;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * bm;
  // Tile nt: columns j0 + 8 nt .. + 7 of W_h ([3S, S], rows of stride ld).
  load_weights<T>(frag, KT, NT, [&](int64_t k, int nt, int n) -> uint32_t {
    const int64_t j = j0 + 8 * nt + n;
    if (k >= S3 || j >= S) return 0;
    return bits_of(w_h[k * ld + j]);
  });
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t step_gates = B * S3, step_state = B * S;
  const bool active = warp < sp.I * sp.KS, owner = warp < sp.I;
  const int ks = warp / sp.I, mt = warp % sp.I;
  const int64_t row_base = r0 + 16 * mt + (lane >> 2);
  const int64_t col_base = j0 + 2 * (lane & 3);
  auto valid = [&](int half, int q) { return row_base + 8 * half < B && col_base + 8 * q < S; };
  auto at = [&](int half, int q) { return (row_base + 8 * half) * S + col_base + 8 * q; };

  // dc: the running gradient of the cell state, in registers for the chunk.
  float dc_reg[Q][2][2] = {};
  // Step t's inputs, fetched ahead: grad_outputs[t] (+ grad_h_n at the
  // last step), G_t of the three gates, c_{t-1}; two columns a register.
  Pair<T> n_go[Q][2] = {}, n_g[Q][2][3] = {}, n_c[Q][2] = {};
  const bool one = pairs_aligned<T>(go, gates, cells, c0);
  // Without grad_outputs n_go keeps its initial zero.
  auto prefetch = [&](int64_t t) {
    fetch_backward_inputs<T, Q>(t, go, gates, cells, c0, S, S3, step_gates, step_state, row_base,
                                col_base, one, valid, at, n_go, n_g, n_c);
  };
  if (owner) {
    load_backward_dc<T, Q>(t1 - 1 == T_ - 1 ? gcn : dc, valid, at, dc_reg);
    prefetch(t1 - 1);
  }

  const int64_t tile_row = r0 + 16 * mt;  // the warp's row tile's first row
  // The warp's k range and the thread's rows, set up once (see the forward).
  const KRange kr = KRange::of<T>(S3, KC * ks / sp.KS, KC * (ks + 1) / sp.KS);
  const int64_t ra_at = std::min<int64_t>(row_base, B - 1) * S3 + kr.first;
  const int64_t rb_at = std::min<int64_t>(row_base + 8, B - 1) * S3 + kr.first;
  for (int64_t t = t1 - 1; t >= t0; --t) {
    const bool last = t == T_ - 1;
    const int64_t n = kPacked ? rows_at(bs, B, T_, t) : B;
    const int64_t n_next = kPacked ? rows_at(bs, B, T_, t + 1) : 0;
    const int64_t next_slot = t + 1 < t1 ? t + 1 - t0 : K;
    const T* dG_next = dG + next_slot * step_gates;
    T* dg_t = dG + (t - t0) * step_gates;
    float acc[NT][4] = {};
    // Rows with no step after this one (all, at the last): no recurrent gradient.
    if (active && (kPacked ? tile_row < n_next : !last)) {
      // float32 (TF32): a ring of one-chunk groups (see tile_product).
      constexpr int G = sizeof(T) == 4 ? 1 : kGroup, NB = 8 / G;
      tile_product<T, NT, !kHalfRows, G, NB>(acc, GlobalRows<T>{dG_next + ra_at, dG_next + rb_at},
                                             kr, frag);
    }
    if (sp.KS > 1) reduce_k_split<NACC>(&acc[0][0], red, sp, warp, active);
    // The cell and the step's dG, the one output the other blocks wait for:
    // the block arrives at the barrier once it is written, and fetches the
    // next step's inputs and sums the bias gradient while the others arrive.
    float sums[3][Q][2] = {};
    if (owner) {
      backward_cells<T, Q>(
          acc, dg_t, S, S3, row_base, col_base, valid, at,
          [&](int64_t row) { return !kPacked || row < n; },
          [&](int64_t row) { return kPacked ? row >= n_next : last; }, ghn, n_go, n_g, n_c, dc_reg,
          sums);
    }
    if (t > t0) row_arrive(arrivals);
    if (owner) {
      if (t > t0) prefetch(t - 1);
      store_tile_bias_sums<Q>(bsum + mt * 3 * NJ, NJ, sums, lane);
    }
    __syncthreads();
    add_block_bias_sums(partial + static_cast<int64_t>(blockIdx.y) * S3, bsum, NJ, sp.I, j0, S);
    if (t > t0) row_wait(arrivals, static_cast<unsigned long long>(t1 - t) * gridDim.x);
  }
  // The chunk's last step is the earliest: its dc is d c_{t0 - 1}.
  if (owner) store_backward_dc<T, Q>(dc, valid, at, dc_reg);
}

}  // namespace tc
