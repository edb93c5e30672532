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

#include "lltm.h"                // LLTM_HD: always inlined
#include "opscommon/dispatch.h"  // BFloat16, Half, acc_t

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

// -- storage <-> float ---------------------------------------------------------
//
// Branch-free conversions for the CPU row loops. c10's float -> bfloat16
// rounding tests for NaN with a branch, and its float16 conversions (software
// ones on x86-64: this code is built without -mf16c) select with branches;
// on aarch64 c10 converts float16 with the scalar FCVT instruction, through
// __fp16, which GCC 12 does not vectorize either (measured: the float16 rows
// stayed scalar, these conversions make them NEON code). In a loop
// that also uses the converted value (lltm_sequence rounds the pre-activation
// and computes with it) GCC then does not vectorize, and a bfloat16 row ran
// about 20x slower than a float32 one. Round to nearest even, bit for bit as
// c10 (a NaN becomes c10's quiet NaN).

LLTM_HD float widen(float v) { return v; }
LLTM_HD double widen(double v) { return v; }
LLTM_HD float widen(opscommon::BFloat16 v) {
  return bits_to_float(static_cast<uint32_t>(v.x) << 16);
}
// float16 -> float (the FP16 library's algorithm, as c10 without F16C).
LLTM_HD float widen(opscommon::Half v) {
  const uint32_t w = static_cast<uint32_t>(v.x) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal numbers, infinities and NaN: shift the exponent and mantissa into
  // place and rescale the exponent bias by 2^-112.
  const float normal = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Zero and subnormals: the mantissa under a fixed exponent, minus 0.5.
  const float subnormal = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t m = 0u - static_cast<uint32_t>(two_w < (1u << 27));
  return bits_to_float(sign | (float_to_bits(subnormal) & m) | (float_to_bits(normal) & ~m));
}

template <typename T>
LLTM_HD T narrow(opscommon::acc_t<T> v) {
  return v;  // float, double
}
template <>
LLTM_HD opscommon::BFloat16 narrow<opscommon::BFloat16>(float v) {
  const uint32_t u = float_to_bits(v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t m = 0u - static_cast<uint32_t>(v != v);  // NaN
  return opscommon::BFloat16(static_cast<uint16_t>((0x7FC0u & m) | (rounded & ~m)),
                             opscommon::BFloat16::from_bits());
}
// float -> float16 (the FP16 library's algorithm, as c10 without F16C): the
// float adder does the rounding, after scaling |v| so that the bits below
// float16's precision (or its subnormal step) fall off.
template <>
LLTM_HD opscommon::Half narrow<opscommon::Half>(float v) {
  const float scaled = (__builtin_fabsf(v) * 0x1.0p+112f) * 0x1.0p-110f;  // overflow -> inf
  const uint32_t w = float_to_bits(v);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  const uint32_t low = 0u - static_cast<uint32_t>(bias < 0x71000000u);
  bias = (0x71000000u & low) | (bias & ~low);
  const uint32_t bits = float_to_bits(bits_to_float((bias >> 1) + 0x07800000u) + scaled);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
  return opscommon::Half(static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan)),
                         opscommon::Half::from_bits());
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
