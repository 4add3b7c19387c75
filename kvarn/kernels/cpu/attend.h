// The decode kernel's loops over the vectors of vec.h: horizontal sums, exp, the online softmax,
// key scores and value sums (from float rows, or straight from packed codes), row loads, x @ M.
// Internal linkage, as vec.h.
#pragma once

#include <type_traits>

#include "vec.h"

namespace {

// the 8 lane sums of v[0..7], as one vector
inline v8f hsum8(const v8f* v) {
#if defined(__AVX__)
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_permute2f128_ps(ab, cd, 0x20) + _mm256_permute2f128_ps(ab, cd, 0x31);
#else
  v8f r;
  for (int i = 0; i < 8; ++i) { float x = 0.f; for (int k = 0; k < 8; ++k) x += v[i][k]; r[i] = x; }
  return r;
#endif
}

// exp of 8 lanes x <= 0 (Cephes' expf polynomial, relative error ~2e-7); lanes below -87 give 0
inline v8f exp_neg8(v8f x) {
  const v8i dead = x < splat(-87.f);
  x = dead ? splat(-87.f) : x;
  const v8f n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8f y = p * r * r + r + 1.f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return dead ? splat(0.f) : y * (v8f)bits;
}

inline float hmax8(v8f v) {
  float x = v[0];
  for (int i = 1; i < 8; ++i) x = std::max(x, v[i]);
  return x;
}

inline float hadd8(v8f v) {
  float x = 0.f;
  for (int i = 0; i < 8; ++i) x += v[i];
  return x;
}

// sum of a[i] * b[i], n a multiple of 8
inline float dot8(const float* a, const float* b, int64_t n) {
  v8f acc = splat(0.f);
  for (int64_t i = 0; i < n; i += 8) acc += loadv(a + i) * loadv(b + i);
  return hadd8(acc);
}

// online softmax over scores s[g * ld + t], t < n (a multiple of 8): rescales acc and l, turns s into
// probabilities; returns false when every score so far is -inf (nothing to accumulate)
inline bool softmax_step(float* s, int64_t G, int64_t n, int64_t ld, int64_t D, float* m, float* l, float* acc) {
  bool any = false;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * ld;
    v8f mv = splat(-INFINITY);
    for (int64_t t = 0; t < n; t += 8) { const v8f x = loadv(sg + t); mv = x > mv ? x : mv; }
    const float mn = std::max(m[g], hmax8(mv));
    if (mn == -INFINITY) {
      std::fill(sg, sg + n, 0.f);
      continue;
    }
    any = true;
    const float alpha = m[g] == -INFINITY ? 0.f : std::exp(m[g] - mn);
    v8f sum = splat(0.f);
    for (int64_t t = 0; t < n; t += 8) {
      const v8f p = exp_neg8(loadv(sg + t) - mn);
      storev(sg + t, p);
      sum += p;
    }
    l[g] = l[g] * alpha + hadd8(sum);
    if (alpha != 1.f)
      for (int64_t d = 0; d < D; d += 8) storev(acc + g * D + d, loadv(acc + g * D + d) * alpha);
    m[g] = mn;
  }
  return any;
}

// scores of rows 0..R-1 (R a multiple of 8) for query heads g0..g0+NG-1: s[g * ld + t]
template <int NG>
inline void key_scores(const float* rows, const float* qs, int64_t R, int64_t L, int64_t g0, float* s, int64_t ld,
                       v8f* red) {
  const float* q0 = qs + g0 * L;
  for (int64_t t8 = 0; t8 < R; t8 += 8) {
    for (int r = 0; r < 8; ++r) {
      const float* row = rows + (t8 + r) * L;
      v8f acc[NG];
      for (int k = 0; k < NG; ++k) acc[k] = splat(0.f);
      for (int64_t x = 0; x < L; x += 8) {
        const v8f v = loadv(row + x);
        for (int k = 0; k < NG; ++k) acc[k] += v * loadv(q0 + k * L + x);
      }
      for (int k = 0; k < NG; ++k) red[8 * k + r] = acc[k];
    }
    for (int k = 0; k < NG; ++k) storev(s + (g0 + k) * ld + t8, hsum8(red + 8 * k));
  }
}

// scores straight from packed key codes (no float copy of the rows): rows 0..T-1, query heads
// g0..g0+NG-1 whose plane-order queries are qs[g * L + x]; s[g * ld + t]
template <int BITS, int NG>
inline void packed_scores(const uint8_t* sec, int64_t T, int64_t D, const float* qs, int64_t L, int64_t g0, float* s,
                          int64_t ld, v8f* red) {
  const float* q0 = qs + g0 * L;
  for (int64_t t8 = 0; t8 < T; t8 += 8) {
    for (int r = 0; r < 8; ++r) {
      v8f acc[NG];
      for (int k = 0; k < NG; ++k) acc[k] = splat(0.f);
      const uint8_t* plane = sec;
      for (int pk = 0; pk < Planes<BITS>::N; ++pk) {
        const int w = Planes<BITS>::W[pk], p = 8 / w, mask = (1 << w) - 1, shift = Planes<BITS>::SHIFT[pk];
        const int64_t n = D / p;
        const uint8_t* row = plane + (t8 + r) * n;
        const float* qp = q0 + pk * D;
        for (int64_t c = 0; c < n; c += 8) {
          const v8i x = widen8(row + c);
          for (int j = 0; j < p; ++j) {
            const v8f v = __builtin_convertvector(((x >> (j * w)) & mask) << shift, v8f);
            for (int k = 0; k < NG; ++k) acc[k] += v * loadv(qp + k * L + j * n + c);
          }
        }
        plane += T * n;
      }
      for (int k = 0; k < NG; ++k) red[8 * k + r] = acc[k];
    }
    for (int k = 0; k < NG; ++k) storev(s + (g0 + k) * ld + t8, hsum8(red + 8 * k));
  }
}

// f(std::integral_constant<int, NG>, g0) for the query heads g0..g0+NG-1, four at a time
template <class F>
inline void head_groups(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

template <int BITS>
inline void packed_scores_all(const uint8_t* sec, int64_t T, int64_t D, const float* qs, int64_t L, int64_t G, float* s,
                              v8f* red) {
  head_groups(G, [&](auto ng, int64_t g0) { packed_scores<BITS, decltype(ng)::value>(sec, T, D, qs, L, g0, s, T, red); });
}

inline void key_scores_all(const float* rows, const float* qs, int64_t R, int64_t L, int64_t G, float* s, int64_t ld,
                           v8f* red) {
  head_groups(G, [&](auto ng, int64_t g0) { key_scores<decltype(ng)::value>(rows, qs, R, L, g0, s, ld, red); });
}

// tmp[g][x] += sum_t p[g * ld + t] * rows[t][x], t < R, for every query head; 64 columns at a time in registers
inline void value_sums(const float* rows, const float* p, int64_t R, int64_t L, int64_t G, int64_t ld, float* tmp) {
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * ld;
    for (int64_t x0 = 0; x0 < L; x0 += 64) {
      const int64_t nk = std::min<int64_t>(8, (L - x0) / 8);
      float* out = tmp + g * L + x0;
      v8f acc[8];
      for (int k = 0; k < nk; ++k) acc[k] = loadv(out + 8 * k);
      for (int64_t t = 0; t < R; ++t) {
        const v8f w = splat(pg[t]);
        const float* row = rows + t * L + x0;
        for (int k = 0; k < nk; ++k) acc[k] += w * loadv(row + 8 * k);
      }
      for (int k = 0; k < nk; ++k) storev(out + 8 * k, acc[k]);
    }
  }
}

// out[g * L + j * n + c] = sum_t p[g * ld + t] * code[t][j * n + c] for query heads g0..g0+NG-1, straight
// from one W-bit plane of packed value codes (plane order, as unpack_rows, times 2**shift): the codes
// of 8 bytes are widened once per row for NG heads and two of the P codes per byte, so that the
// 2 * NG accumulators, NG broadcast weights, the codes and the mask fit AVX2's 16 vector registers
template <int W, int NG>
inline void plane_value_group(const uint8_t* plane, int64_t T, int64_t D, int shift, const float* p, int64_t ld,
                              int64_t g0, int64_t L, float* out) {
  constexpr int P = 8 / W, PJ = P < 2 ? P : 2;
  constexpr int MASK = (1 << W) - 1;
  const int64_t n = D / P;
  const float* p0 = p + g0 * ld;
  for (int64_t c = 0; c < n; c += 8) {
    for (int j0 = 0; j0 < P; j0 += PJ) {
      v8f acc[NG][PJ];
      for (int k = 0; k < NG; ++k)
        for (int j = 0; j < PJ; ++j) acc[k][j] = splat(0.f);
      for (int64_t t = 0; t < T; ++t) {
        const v8i x = widen8(plane + t * n + c);
        for (int j = 0; j < PJ; ++j) {
          const v8f v = __builtin_convertvector(((x >> ((j0 + j) * W)) & MASK) << shift, v8f);
          for (int k = 0; k < NG; ++k) acc[k][j] += splat(p0[k * ld + t]) * v;
        }
      }
      for (int k = 0; k < NG; ++k)
        for (int j = 0; j < PJ; ++j) storev(out + (g0 + k) * L + (j0 + j) * n + c, acc[k][j]);
    }
  }
}

// every query head, four at a time
template <int W>
inline void plane_value_sums(const uint8_t* plane, int64_t T, int64_t D, int shift, const float* p, int64_t ld,
                             int64_t G, int64_t L, float* out) {
  head_groups(G, [&](auto ng, int64_t g0) {
    plane_value_group<W, decltype(ng)::value>(plane, T, D, shift, p, ld, g0, L, out);
  });
}

// out[g * L + x] = sum_t p[g * ld + t] * codes[t][x] over all T rows of a [T, D] code section (plane order)
template <int BITS>
inline void packed_value_sums(const uint8_t* sec, int64_t T, int64_t D, const float* p, int64_t ld, int64_t G,
                              float* out) {
  const int64_t L = Planes<BITS>::N * D;
  const uint8_t* plane = sec;
  for (int k = 0; k < Planes<BITS>::N; ++k) {
    const int w = Planes<BITS>::W[k], shift = Planes<BITS>::SHIFT[k];
    if (w == 8) plane_value_sums<8>(plane, T, D, shift, p, ld, G, L, out + k * D);
    else if (w == 4) plane_value_sums<4>(plane, T, D, shift, p, ld, G, L, out + k * D);
    else if (w == 2) plane_value_sums<2>(plane, T, D, shift, p, ld, G, L, out + k * D);
    else plane_value_sums<1>(plane, T, D, shift, p, ld, G, L, out + k * D);
    plane += T * D * w / 8;
  }
}

inline void packed_value_sums_any(int64_t bits, const uint8_t* sec, int64_t T, int64_t D, const float* p, int64_t ld,
                                  int64_t G, float* out) {
  switch (bits) {
    case 2: packed_value_sums<2>(sec, T, D, p, ld, G, out); break;
    case 3: packed_value_sums<3>(sec, T, D, p, ld, G, out); break;
    case 4: packed_value_sums<4>(sec, T, D, p, ld, G, out); break;
    default: packed_value_sums<8>(sec, T, D, p, ld, G, out); break;
  }
}

// row of D elements (f32, f16 or bf16) to floats; D is a multiple of 8
inline void load_row(const void* src, int64_t dtype, int64_t D, float* dst) {
  if (dtype == 0) {
    std::memcpy(dst, src, D * 4);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < D; d += 8) {
    if (dtype == 2) {  // bf16: the high half of a float
      typedef uint16_t v8u16 __attribute__((vector_size(16)));
      v8u16 x;
      std::memcpy(&x, h + d, 16);
      storev(dst + d, (v8f)(__builtin_convertvector(x, v8i) << 16));
    } else {
#if defined(__F16C__)
      storev(dst + d, half8(h + d));
#else
      for (int k = 0; k < 8; ++k) dst[d + k] = half_to_float(h[d + k]);
#endif
    }
  }
}

// y = x @ M for x [D], M [D, D] row-major (D a multiple of 8); 64 outputs at a time in registers
void vec_mat(const float* x, const float* M, int64_t D, float* y) {
  for (int64_t e0 = 0; e0 < D; e0 += 64) {
    const int64_t nk = std::min<int64_t>(8, (D - e0) / 8);
    v8f acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = splat(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const v8f xd = splat(x[d]);
      const float* row = M + d * D + e0;
      for (int k = 0; k < nk; ++k) acc[k] += xd * loadv(row + 8 * k);
    }
    for (int k = 0; k < nk; ++k) storev(y + e0 + 8 * k, acc[k]);
  }
}

}  // namespace
