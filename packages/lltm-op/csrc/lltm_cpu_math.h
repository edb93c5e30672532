// float32 math for the CPU kernels that the compiler can vectorize.
//
// The C library's expf/expm1f/tanhf are scalar calls (tanhf alone costs about
// 25 ns here), so a loop that calls them cannot be vectorized and the cell
// would run many times slower than torch's own (SLEEF-vectorized) CPU ops.
// These are branch-free (selects only), call nothing and use only float and
// uint32 arithmetic, so GCC and Clang vectorize the element loops at -O3.
// Accuracy: exp within 2 ulp; expm1 and tanh within about 2e-7 relative
// (polynomials near 0, where exp-based formulas would cancel). NaN, +-inf,
// overflow and underflow come out as from the C library (up to signed zero
// and subnormal results flushed to 0).
#pragma once

#include <cstdint>
#include <cstring>

#include "lltm.h"  // LLTM_HD: always inlined

namespace lltm_op {
namespace cpu_math {

LLTM_HD float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
LLTM_HD uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// c ? a : b without control flow. GCC keeps `c ? a : b` on floats as a
// branch (sinking the arithmetic of each arm into it, which may not be
// speculated under the default -ftrapping-math) and then cannot vectorize the
// loop; a blend of the bits it can.
LLTM_HD float select(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return bits_to_float((float_to_bits(a) & m) | (float_to_bits(b) & ~m));
}

// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln(2)/2 (Cephes expf).
LLTM_HD float exp(float x) {
  constexpr float kMax = 88.72283935546875f;                           // exp(kMax) ~ FLT_MAX
  constexpr float kMin = -87.33654022216797f;                          // exp(kMin) ~ FLT_MIN
  const float xc = select(x > kMax, kMax, select(x < kMin, kMin, x));  // NaN stays NaN
  // Round x / ln2 to an integer with the 1.5 * 2^23 trick: n sits in the low
  // mantissa bits of t.
  const float t = xc * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  const int32_t ni = static_cast<int32_t>(float_to_bits(t) - float_to_bits(12582912.0f));
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n for n in [-126, 128]: 2^(n-1) * 2 keeps 128 finite in the exponent
  // field; n - 1 >= -127 would be subnormal, so negative n scale directly.
  const uint32_t up = static_cast<uint32_t>(ni + 126) << 23;
  const uint32_t down = static_cast<uint32_t>(ni + 127 > 0 ? ni + 127 : 1) << 23;
  // Both branches computed, then selected: no control flow in the loop.
  const float s_up = p * bits_to_float(up) * 2.0f;
  const float s_down = p * bits_to_float(down);
  const float scaled = select(ni > 0, s_up, s_down);
  const float out = select(x > kMax, __builtin_inff(), scaled);
  return select(x < kMin, 0.0f, out);
}

// expm1(x): a Taylor polynomial for |x| < 0.5 (relative error < 2e-7 there),
// exp(x) - 1 outside, where it does not cancel.
LLTM_HD float expm1(float x) {
  float p = 1.0f / 40320.0f;
  p = p * x + 1.0f / 5040.0f;
  p = p * x + 1.0f / 720.0f;
  p = p * x + 1.0f / 120.0f;
  p = p * x + 1.0f / 24.0f;
  p = p * x + 1.0f / 6.0f;
  p = p * x + 0.5f;
  p = p * x * x + x;
  const float e = exp(x) - 1.0f;
  return select(__builtin_fabsf(x) < 0.5f, p, e);  // NaN: the test is false, e is NaN
}

// tanh(x): the Cephes tanhf polynomial for |x| < 0.625, else
// sign(x) * (1 - 2 / (exp(2|x|) + 1)).
LLTM_HD float tanh(float x) {
  const float ax = __builtin_fabsf(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float big = 1.0f - 2.0f / (exp(2.0f * ax) + 1.0f);
  const float signed_big = __builtin_copysignf(big, x);  // NaN: big is NaN
  return select(ax < 0.625f, small, signed_big);
}

}  // namespace cpu_math

// The policy the CPU kernels use for float, float16 and bfloat16.
struct CpuVectorMath {
  static LLTM_HD float select(bool c, float a, float b) { return cpu_math::select(c, a, b); }
  static LLTM_HD float exp(float v) { return cpu_math::exp(v); }
  static LLTM_HD float expm1(float v) { return cpu_math::expm1(v); }
  static LLTM_HD float tanh(float v) { return cpu_math::tanh(v); }
  static LLTM_HD float sigmoid(float x) { return 1.0f / (1.0f + cpu_math::exp(-x)); }
};

}  // namespace lltm_op
