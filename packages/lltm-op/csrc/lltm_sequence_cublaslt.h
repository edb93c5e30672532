// The cuBLAS path's step products and a small call's chunk products (input
// projection, weight and input gradients) through cuBLASLt, called
// directly: the library torch itself loaded (libtorch_cuda links it), found
// by its soname with dlopen, with a matmul descriptor, layouts and an
// algorithm chosen once per shape and remembered.
//
// Why: a product through torch's dispatcher (aten::mm) costs 17-25 us of
// host time on the H100 machines measured, cublasLtMatmul with a chosen
// algorithm 9-15 us. Where a step's kernels take less (float32 on TF32,
// B256 S1024: a 10 us product and a 5 us cell), the loop ran at the host's
// pace; a small call is mostly host time.
//
// No cuBLAS header or link: the few functions and values used are
// cuBLASLt's C API (cublasLt.h, cublas_api.h, library_types.h), fixed within
// a major version, which is the soname's. Where the library is not loaded,
// a function is missing or no algorithm fits, the caller takes aten::mm.
#pragma once

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace lltm_op {
namespace seq {
namespace cublaslt {

// cudaDataType_t (library_types.h).
constexpr int kR32F = 0, kR16F = 2, kR16BF = 14;
// cublasComputeType_t (cublas_api.h).
constexpr int kCompute32F = 68, kCompute32FFastTf32 = 77;
// cublasOperation_t.
constexpr int32_t kOpN = 0, kOpT = 1;
// cublasLtMatmulDescAttributes_t.
constexpr int kDescTransA = 3, kDescTransB = 4;
// cublasLtMatrixLayoutAttribute_t.
constexpr int kLayoutBatchCount = 5, kLayoutBatchStride = 6;
// cublasLtMatmulPreferenceAttributes_t.
constexpr int kPrefMaxWorkspace = 1, kPrefAlignA = 5, kPrefAlignB = 6, kPrefAlignC = 7,
              kPrefAlignD = 8;

struct Algo {
  uint64_t data[8];
};
struct Heuristic {  // cublasLtMatmulHeuristicResult_t
  Algo algo;
  size_t workspace;
  int state;
  float waves;
  int reserved[4];
};

using Handle = void*;
struct Api {
  int (*create)(Handle*);
  int (*desc_create)(void**, int, int);
  int (*desc_destroy)(void*);
  int (*desc_set)(void*, int, const void*, size_t);
  int (*layout_create)(void**, int, uint64_t, uint64_t, int64_t);
  int (*layout_destroy)(void*);
  int (*layout_set)(void*, int, const void*, size_t);
  int (*pref_create)(void**);
  int (*pref_destroy)(void*);
  int (*pref_set)(void*, int, const void*, size_t);
  int (*heuristic)(Handle, void*, void*, void*, void*, void*, void*, int, Heuristic*, int*);
  int (*matmul)(Handle, void*, const void*, const void*, void*, const void*, void*, const void*,
                const void*, void*, void*, void*, const Algo*, void*, size_t, cudaStream_t);
};

// The functions of the cuBLASLt already in the process, or null.
inline const Api* api() {
  static const Api* found = []() -> const Api* {
    const std::string soname = "libcublasLt.so." + std::to_string(CUDART_VERSION / 1000);
    void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    static Api a;
    bool all = true;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      all = all && fn != nullptr;
    };
    get(a.create, "cublasLtCreate");
    get(a.desc_create, "cublasLtMatmulDescCreate");
    get(a.desc_destroy, "cublasLtMatmulDescDestroy");
    get(a.desc_set, "cublasLtMatmulDescSetAttribute");
    get(a.layout_create, "cublasLtMatrixLayoutCreate");
    get(a.layout_destroy, "cublasLtMatrixLayoutDestroy");
    get(a.layout_set, "cublasLtMatrixLayoutSetAttribute");
    get(a.pref_create, "cublasLtMatmulPreferenceCreate");
    get(a.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    get(a.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    get(a.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(a.matmul, "cublasLtMatmul");
    return all ? &a : nullptr;
  }();
  return found;
}

// This thread's handle for `device` (made on first use, kept: a handle is a
// host-side context; the autograd engine runs a device's backward on one
// long-lived thread).
inline Handle handle(int device) {
  thread_local std::vector<Handle> handles;
  if (device >= static_cast<int>(handles.size())) handles.resize(device + 1, nullptr);
  if (handles[device] == nullptr) {
    Handle h = nullptr;
    if (api()->create(&h) != 0) return nullptr;
    handles[device] = h;
  }
  return handles[device];
}

// One product's descriptors and algorithm (shared by the remembered copies;
// destroyed with the last).
struct Plan {
  std::shared_ptr<void> desc, a, b, c;
  Algo algo{};
  size_t workspace = 0;
  bool ok = false;
};

// The largest power of two (at most 256) that divides the address: the
// alignment the algorithm may assume (cuBLASLt's default is 256).
inline uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

// out (column-major m x n, ld ldc) (+)= op(A) op(B), column-major: A is
// k x m (ld lda) where transa is kOpT, else m x k; B is n x k (ldb) where
// transb is kOpT, else k x n. The step product is A^T B. batch > 1: that
// many such products, the i-th's matrices stride_a, stride_b and stride_c
// elements past the first's.
struct Shape {
  int dtype, compute;
  uint64_t m, n, k;
  int64_t lda, ldb, ldc;
  uint32_t align_a, align_b, align_c;
  int32_t transa = kOpT, transb = kOpN;
  int32_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  bool operator==(const Shape& o) const {
    return dtype == o.dtype && compute == o.compute && m == o.m && n == o.n && k == o.k &&
           lda == o.lda && ldb == o.ldb && ldc == o.ldc && align_a == o.align_a &&
           align_b == o.align_b && align_c == o.align_c && transa == o.transa &&
           transb == o.transb && batch == o.batch && stride_a == o.stride_a &&
           stride_b == o.stride_b && stride_c == o.stride_c;
  }
};

// The descriptors and the heuristic's first algorithm for `s`, with at most
// `max_workspace` bytes of workspace; ok false where any call fails or no
// algorithm fits.
inline Plan make_plan(Handle h, const Shape& s, size_t max_workspace) {
  const Api& f = *api();
  Plan p;
  auto own = [&](void* obj, int (*destroy)(void*)) {
    return std::shared_ptr<void>(obj, [destroy](void* o) {
      if (o != nullptr) destroy(o);
    });
  };
  void* desc = nullptr;
  if (f.desc_create(&desc, s.compute, kR32F) != 0) return p;
  p.desc = own(desc, f.desc_destroy);
  if (f.desc_set(desc, kDescTransA, &s.transa, sizeof(s.transa)) != 0 ||
      f.desc_set(desc, kDescTransB, &s.transb, sizeof(s.transb)) != 0) {
    return p;
  }
  const bool ta = s.transa == kOpT, tb = s.transb == kOpT;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  if (f.layout_create(&a, s.dtype, ta ? s.k : s.m, ta ? s.m : s.k, s.lda) != 0) return p;
  p.a = own(a, f.layout_destroy);
  if (f.layout_create(&b, s.dtype, tb ? s.n : s.k, tb ? s.k : s.n, s.ldb) != 0) return p;
  p.b = own(b, f.layout_destroy);
  if (f.layout_create(&c, s.dtype, s.m, s.n, s.ldc) != 0) return p;
  p.c = own(c, f.layout_destroy);
  if (s.batch > 1) {
    auto batched = [&](void* layout, int64_t stride) {
      return f.layout_set(layout, kLayoutBatchCount, &s.batch, sizeof(s.batch)) == 0 &&
             f.layout_set(layout, kLayoutBatchStride, &stride, sizeof(stride)) == 0;
    };
    if (!batched(a, s.stride_a) || !batched(b, s.stride_b) || !batched(c, s.stride_c)) return p;
  }
  void* pref = nullptr;
  if (f.pref_create(&pref) != 0) return p;
  const std::shared_ptr<void> pref_owner = own(pref, f.pref_destroy);
  const uint64_t ws = max_workspace;
  if (f.pref_set(pref, kPrefMaxWorkspace, &ws, sizeof(ws)) != 0 ||
      f.pref_set(pref, kPrefAlignA, &s.align_a, sizeof(uint32_t)) != 0 ||
      f.pref_set(pref, kPrefAlignB, &s.align_b, sizeof(uint32_t)) != 0 ||
      f.pref_set(pref, kPrefAlignC, &s.align_c, sizeof(uint32_t)) != 0 ||
      f.pref_set(pref, kPrefAlignD, &s.align_c, sizeof(uint32_t)) != 0) {
    return p;
  }
  Heuristic best{};
  int found = 0;
  if (f.heuristic(h, desc, a, b, c, c, pref, 1, &best, &found) != 0 || found < 1 ||
      best.state != 0) {
    return p;
  }
  p.algo = best.algo;
  p.workspace = best.workspace;
  p.ok = true;
  return p;
}

}  // namespace cublaslt
}  // namespace seq
}  // namespace lltm_op
