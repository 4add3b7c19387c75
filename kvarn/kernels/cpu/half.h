// fp16 and bf16 conversions, and loads/stores of f32, f16 or bf16 elements (dtype 0, 1, 2).
// Internal linkage (an anonymous namespace), like vec.h, which includes this file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  uint32_t x; std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000; int32_t e = (int32_t)((x >> 23) & 0xff) - 112; uint32_t m = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (m ? 0x200 : 0));
  if (e >= 31) return (uint16_t)(sign | 0x7c00);
  if (e <= 0) {
    if (e < -10) return (uint16_t)sign;
    m |= 0x800000; uint32_t shift = (uint32_t)(14 - e), half = m >> shift, rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return (uint16_t)(sign | half);
  }
  uint32_t h = sign | ((uint32_t)e << 10) | (m >> 13), rem = m & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return (uint16_t)h;
#endif
}

inline float load(const void* p, int64_t i, int64_t dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (dtype == 1) return half_to_float(h);
  uint32_t bits = (uint32_t)h << 16; float f; std::memcpy(&f, &bits, 4); return f;
}

inline void store(void* p, int64_t i, float v, int64_t dtype) {
  if (dtype == 0) { static_cast<float*>(p)[i] = v; return; }
  uint16_t h;
  if (dtype == 1) {
    h = float_to_half(v);
  } else {  // bf16, round to nearest even
    uint32_t x; std::memcpy(&x, &v, 4);
    h = std::isnan(v) ? (uint16_t)((x >> 16) | 0x40) : (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
  }
  static_cast<uint16_t*>(p)[i] = h;
}

}  // namespace
