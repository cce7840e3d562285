// Portable bit-level conversions used by the KV-write kernels, identical on the GPU and on the
// CPU shim: fp16 / bf16 bits -> float (exact), and float -> fp8 e4m3 (saturating,
// round-to-nearest-even) for the two fp8 formats torch knows:
//
//   format       bias  max finite          NaN          negative zero
//   e4m3fn         7   448  = 0x7E         S.1111.111   0x80
//   e4m3fnuz       8   240  = 0x7F         0x80 only    none (-0 -> 0x00)
//
// Only integer arithmetic is used, so the result does not depend on the denormal or rounding
// mode of the device (HIP 5.2 has no hip_fp8.h; torch's own conversion is the reference).
// The contract, checked bit-for-bit in tests/test_hip_kernels.py:
//   float_to_fp8_sat<FNUZ>(f) == torch.tensor(f).clamp(finfo.min, finfo.max).to(fp8)
// i.e. |f| >= max finite (inf included) saturates to +-max, NaN -> the format's NaN.
#pragma once

#include <stdint.h>

namespace rocdraft {

__host__ __device__ inline uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

__host__ __device__ inline float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// IEEE binary16 bits -> float, exact (subnormals normalised, NaN payload kept).
__host__ __device__ inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  int32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // value = mantissa * 2^-24: shift until the implicit bit (bit 10) is set.
    exponent = 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      exponent -= 1;
    }
    mantissa &= 0x3ffu;
  }
  // half exponent e (bias 15) -> float exponent e - 15 + 127 = e + 112
  return bits_to_float(sign | ((uint32_t)(exponent + 112) << 23) | (mantissa << 13));
}

// bfloat16 bits are the upper half of a float.
__host__ __device__ inline float bf16_bits_to_float(uint16_t b) {
  return bits_to_float((uint32_t)b << 16);
}

// Round-to-nearest-even right shift of a significand: (value >> shift) rounded, shift >= 1.
__host__ __device__ inline uint32_t shift_right_rne(uint32_t value, int shift) {
  if (shift > 31) return 0;
  const uint32_t kept = value >> shift;
  const uint32_t dropped = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const bool round_up = dropped > half || (dropped == half && (kept & 1u));
  return kept + (round_up ? 1u : 0u);
}

// float -> fp8 e4m3 bits; FNUZ selects e4m3fnuz (bias 8), otherwise e4m3fn (bias 7).
template <bool FNUZ>
__host__ __device__ inline uint8_t float_to_fp8_sat(float f) {
  constexpr int kBias = FNUZ ? 8 : 7;
  constexpr uint32_t kMaxBits = FNUZ ? 0x43700000u : 0x43E00000u;  // 240.0f / 448.0f
  constexpr uint8_t kMaxCode = FNUZ ? 0x7F : 0x7E;
  const uint32_t bits = float_to_bits(f);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;

  if (magnitude > 0x7f800000u) return FNUZ ? (uint8_t)0x80 : (uint8_t)(sign | 0x7F);  // NaN
  if (magnitude >= kMaxBits) return (uint8_t)(sign | kMaxCode);  // saturate (inf included)

  const int exponent = (int)(magnitude >> 23);  // biased float exponent, 0 for subnormals
  const uint32_t mantissa = magnitude & 0x7fffffu;
  uint32_t code;
  if (exponent >= 127 - kBias + 1) {
    // Normal fp8: keep 3 of the 23 mantissa bits. A carry out of the mantissa bumps the
    // exponent field, which is the correct encoding; it cannot pass kMaxCode (see above).
    code = shift_right_rne(((uint32_t)(exponent - 127 + kBias) << 23) | mantissa, 20);
  } else {
    // Subnormal fp8, unit 2^(1 - kBias - 3). Significand m (implicit bit added for normal
    // floats) is worth m * 2^(e - 150) with e = max(exponent, 1), so the value in units is
    // m >> (148 - kBias - e). Rounding up to 8 units gives 0x08, the smallest normal: correct.
    const uint32_t significand = exponent == 0 ? mantissa : (mantissa | 0x800000u);
    const int e = exponent == 0 ? 1 : exponent;
    code = shift_right_rne(significand, 148 - kBias - e);
  }
  if (FNUZ && code == 0) return 0;  // e4m3fnuz has no negative zero
  return (uint8_t)(sign | code);
}

}  // namespace rocdraft
