// Building blocks of the CPU kernels: 8-lane vectors, the record's parameter
// decoding, code unpacking in plane order (the decode kernel's loops: attend.h).
// Everything has internal linkage (an anonymous namespace): each translation unit gets its own copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "half.h"

namespace {

// 8-lane vectors (GCC/Clang vector extensions): AVX2 with -march=native, pairs of SSE otherwise
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));

inline v8f loadv(const float* p) { v8f v; std::memcpy(&v, p, 32); return v; }
inline void storev(float* p, v8f v) { std::memcpy(p, &v, 32); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

#if defined(__F16C__)
// 8 fp16 values (unaligned) to floats in one instruction (GCC's generic conversion goes element by element)
inline v8f half8(const void* p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
#endif

// stored params: fp16, or one log8 byte (scales, factors) / int8 zero point times the scale (offsets)
inline void positives(const uint8_t* src, int64_t n, bool log8, const float* lut, float* dst) {
  if (log8) {
    for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
    return;
  }
#if defined(__F16C__)
  for (int64_t i = 0; i < n; i += 8)  // n is a multiple of 8 (head_dim >= 64, group_size >= 32)
    storev(dst + i, half8(src + 2 * i));
#else
  for (int64_t i = 0; i < n; ++i) { uint16_t h; std::memcpy(&h, src + 2 * i, 2); dst[i] = half_to_float(h); }
#endif
}

inline void offsets(const uint8_t* src, int64_t n, bool log8, const float* scale, float* dst) {
  if (!log8) {
    positives(src, n, false, nullptr, dst);  // fp16 minimum, same decoding
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = (float)(int8_t)src[i] * scale[i];
}

// The codes of a [T, D] section are packed in planes (8 -> [8], 4 -> [4], 3 -> [2, 1], 2 -> [2]); in
// a W-bit plane byte i of row t holds channels i*P .. i*P+P-1 (P = 8/W), low bits first. A row is
// unpacked plane by plane in "plane order": position k*D + j*(D/P) + i holds channel i*P + j of plane
// k (times 2**shift), so unpacking reads and writes contiguously and vectorizes; the decode kernel
// keeps its query and accumulator in the same order instead (plane_channels maps back).
template <int BITS> struct Planes;
template <> struct Planes<8> { static constexpr int N = 1, W[1] = {8}, SHIFT[1] = {0}; };
template <> struct Planes<4> { static constexpr int N = 1, W[1] = {4}, SHIFT[1] = {0}; };
template <> struct Planes<2> { static constexpr int N = 1, W[1] = {2}, SHIFT[1] = {0}; };
template <> struct Planes<3> { static constexpr int N = 2, W[2] = {2, 1}, SHIFT[2] = {0, 2}; };

// 8 bytes zero-extended to 8 int32 lanes (GCC builds the generic form from scalar inserts)
inline v8i widen8(const uint8_t* p) {
#if defined(__AVX2__)
  return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  v8b raw;
  std::memcpy(&raw, p, 8);
  return __builtin_convertvector(raw, v8i);
#endif
}

// rows r0..r0+R-1 of one W-bit plane, in plane order: out[r * L + j * n + c] (L floats per row)
template <int W>
inline void plane_rows(const uint8_t* plane, int64_t D, int64_t r0, int64_t R, int shift, int64_t L, float* out) {
  constexpr int P = 8 / W;
  constexpr int MASK = (1 << W) - 1;
  const int64_t n = D / P;  // bytes per row, a multiple of 8 for every head_dim >= 64
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* row = plane + (r0 + r) * n;
    float* o = out + r * L;
    for (int64_t c = 0; c < n; c += 8) {
      const v8i x = widen8(row + c);
      for (int j = 0; j < P; ++j) storev(o + j * n + c, __builtin_convertvector(((x >> (j * W)) & MASK) << shift, v8f));
    }
  }
}

constexpr int64_t ROWS = 32;  // rows unpacked at a time: 32 x 2 x 256 floats at most, in L1/L2

// rows r0..r0+R-1 of a [T, D] code section: [R, L] floats, L = planes * D
template <int BITS>
inline void unpack_rows(const uint8_t* sec, int64_t T, int64_t D, int64_t r0, int64_t R, float* out) {
  const int64_t L = Planes<BITS>::N * D;
  const uint8_t* plane = sec;
  for (int k = 0; k < Planes<BITS>::N; ++k) {
    const int w = Planes<BITS>::W[k], shift = Planes<BITS>::SHIFT[k];
    if (w == 8) plane_rows<8>(plane, D, r0, R, shift, L, out + k * D);
    else if (w == 4) plane_rows<4>(plane, D, r0, R, shift, L, out + k * D);
    else if (w == 2) plane_rows<2>(plane, D, r0, R, shift, L, out + k * D);
    else plane_rows<1>(plane, D, r0, R, shift, L, out + k * D);
    plane += T * D * w / 8;
  }
}

// channel of each plane-order position: [N * D]
template <int BITS>
void plane_channels(int64_t D, int32_t* idx) {
  for (int k = 0; k < Planes<BITS>::N; ++k) {
    const int64_t P = 8 / Planes<BITS>::W[k], n = D / P;
    for (int64_t j = 0; j < P; ++j)
      for (int64_t i = 0; i < n; ++i) idx[k * D + j * n + i] = (int32_t)(i * P + j);
  }
}

// bits chosen at run time, once per block of rows (one compiled tile loop for every scheme)
inline int64_t num_planes(int64_t bits) { return bits == 3 ? 2 : 1; }

inline void unpack_rows_any(int64_t bits, const uint8_t* sec, int64_t T, int64_t D, int64_t r0, int64_t R, float* out) {
  switch (bits) {
    case 2: unpack_rows<2>(sec, T, D, r0, R, out); break;
    case 3: unpack_rows<3>(sec, T, D, r0, R, out); break;
    case 4: unpack_rows<4>(sec, T, D, r0, R, out); break;
    default: unpack_rows<8>(sec, T, D, r0, R, out); break;
  }
}

inline void plane_channels_any(int64_t bits, int64_t D, int32_t* idx) {
  switch (bits) {
    case 2: plane_channels<2>(D, idx); break;
    case 3: plane_channels<3>(D, idx); break;
    case 4: plane_channels<4>(D, idx); break;
    default: plane_channels<8>(D, idx); break;
  }
}

}  // namespace
