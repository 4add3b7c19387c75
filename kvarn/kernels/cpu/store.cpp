// Native CPU store: quantize rotated tiles into records with the reference codec's algorithm
// (kvarn.codec.tiles._encode_side) in float32 vector arithmetic (the contract and the tolerance:
// kvarn/kernels/cpu/store.py).
#include <memory>

#include "kernels.h"
#include "vec.h"

using StoreArgs = kvarn::StoreArgs;

namespace {

constexpr float kFp16Max = 65504.f;
constexpr float kMinMagnitude = 6.103515625e-05f;  // 2**-14
constexpr float kStdFloor = 1e-3f;
constexpr float kTiny = 1e-30f;
constexpr float kLog8Min = 1.0399892289569834e-06f;  // 2 ** ((1 - 160) / 8), as float32
constexpr int64_t kMaxSide = 256;                    // largest group size and head dim

// W-lane float vectors: 16 lanes where the CPU has AVX-512, 8 otherwise (GCC/Clang vector
// extensions; pairs of SSE registers without AVX). Every row the loops below walk (group sizes and
// head dims: 32..256) is a whole number of vectors.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint8_t vb __attribute__((vector_size(W)));
inline vf ld(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void st_(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf bc(float x) { return x - vf{}; }  // broadcast
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// square root lane by lane (correctly rounded, as std::sqrt)
inline vf vsqrt(vf v) {
#if defined(__AVX512F__)
  return (vf)_mm512_sqrt_ps((__m512)v);
#elif defined(__AVX__)
  return (vf)_mm256_sqrt_ps((__m256)v);
#else
  for (int j = 0; j < W; ++j) v[j] = std::sqrt(v[j]);
  return v;
#endif
}
// clamp(floor(u), 0, qmax) for finite u: truncation of u clamped to [0, qmax + 0.5]
inline vf code_of(vf u, vf top) { return __builtin_convertvector(__builtin_convertvector(vmin(vmax(u, vf{}), top), vi), vf); }

// float32 <-> fp16 bits (round to nearest even) over n elements, n a multiple of 8
inline void to_half(const float* x, uint16_t* h, int64_t n) {
#if defined(__F16C__)
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#else
  for (int64_t i = 0; i < n; ++i) h[i] = float_to_half(x[i]);
#endif
}
inline void from_half(const uint16_t* h, float* x, int64_t n) {
#if defined(__F16C__)
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#else
  for (int64_t i = 0; i < n; ++i) x[i] = half_to_float(h[i]);
#endif
}

// n elements (a multiple of 8) of a row of dtype 0 f32, 1 f16, 2 bf16 at p + off as floats
inline void load_row(const void* p, int64_t off, int64_t dtype, int64_t n, float* out) {
  if (dtype == 0) { std::memcpy(out, static_cast<const float*>(p) + off, n * 4); return; }
  const uint16_t* h = static_cast<const uint16_t*>(p) + off;
  if (dtype == 1) {
#if defined(__F16C__)
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#else
    for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
#endif
    return;
  }
  for (int64_t i = 0; i < n; ++i) { const uint32_t b = (uint32_t)h[i] << 16; std::memcpy(out + i, &b, 4); }
}

// dst [C, R] <- src [R, C] (R, C multiples of 8), by 8 x 8 blocks
inline void transpose(const float* __restrict src, int64_t R, int64_t C, float* __restrict dst) {
  for (int64_t r0 = 0; r0 < R; r0 += 8)
    for (int64_t c0 = 0; c0 < C; c0 += 8) {
      const float* s = src + r0 * C + c0; float* d = dst + c0 * R + r0;
#if defined(__AVX__)
      __m256 r[8], u[8], v[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * C);
      for (int i = 0; i < 8; i += 2) { u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); }
      for (int i = 0; i < 8; i += 4) {
        v[i] = _mm256_shuffle_ps(u[i], u[i + 2], 0x44); v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], 0xee);
        v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0x44); v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], 0xee);
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(d + i * R, _mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
        _mm256_storeu_ps(d + (i + 4) * R, _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
      }
#else
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) d[j * R + i] = s[i * C + j];
#endif
    }
}

// a non-negative float32 -> (stored raw value, the float32 it decodes to)
inline void store_positive(float x, bool log8, bool round_up, const float* lut, uint32_t* raw, float* val) {
  if (!log8) {
    uint16_t h = float_to_half(std::min(std::max(x, 0.f), kFp16Max));
    float hv = half_to_float(h);
    if (round_up && hv < x && hv < kFp16Max) { ++h; hv = half_to_float(h); }
    *raw = h; *val = hv;
    return;
  }
  float e = std::log2(std::max(x, kLog8Min)) * 8.f;
  e = round_up ? std::ceil(e - 1e-4f) : std::floor(e + 0.5f);
  const float c = std::min(std::max(e + 160.f, 1.f), 255.f);
  const uint32_t code = x > 0.f ? (uint32_t)c : 0u;
  *raw = code; *val = lut[code];
}

// One side (keys or values) of one tile and its workspace. Every loop over T * D elements runs along
// a contiguous axis with per-row and per-column constants only, so the compiler vectorizes it at the
// CPU's width (-march=native).
//
// The grid: keys are quantized per channel (scales per column of x [T, D]) with a normalization
// factor per token (row); values per token (scales per column of xt [D, T]) with a factor per channel.
struct Side {
  int64_t T = 0, D = 0, bits = 0, iters = 0;
  bool per_channel = false, log8 = false;
  const float* lut = nullptr;
  alignas(64) float x[kMaxSide * kMaxSide];   // [T, D]
  alignas(64) float xt[kMaxSide * kMaxSide];  // [D, T]
  alignas(64) float log_r[kMaxSide], log_c[kMaxSide], er[kMaxSide], ec[kMaxSide], stdv[kMaxSide];
  alignas(64) float f[kMaxSide], inv_f[kMaxSide];                       // factors of the grid's rows
  alignas(64) float s[kMaxSide], o[kMaxSide], inv_s[kMaxSide], bias[kMaxSide];  // of the grid's columns
  alignas(64) float sum[kMaxSide], sum2[kMaxSide], tmp[kMaxSide];
  alignas(64) uint16_t h16[kMaxSide];
  uint32_t f_raw[kMaxSide], s_raw[kMaxSide], q_raw[kMaxSide];
  uint32_t best_f_raw[kMaxSide], best_s_raw[kMaxSide], best_q_raw[kMaxSide];
  float best_f[kMaxSide], best_s[kMaxSide], best_o[kMaxSide], best_inv_s[kMaxSide], best_bias[kMaxSide];
  uint8_t codes[kMaxSide * kMaxSide];  // [T, D]

  // population std per column of y[r, c] = src[r, c] * rf[r] * cf[c] over the R rows of src [R, C],
  // into stdv[C]: sums of (y - y[0, c]) and its square (the shift keeps float32 sums of squares
  // accurate when a column's mean is large against its spread). NB vectors of columns at a time, their
  // sums held in registers down the rows.
  template <int NB>
  void col_std_block(const float* src, int64_t R, int64_t C, int64_t c0, const float* rf, const float* cf) {
    vf cfv[NB], sh[NB], a[NB] = {}, a2[NB] = {};
    for (int j = 0; j < NB; ++j) { cfv[j] = ld(cf + c0 + j * W); sh[j] = ld(src + c0 + j * W) * (bc(rf[0]) * cfv[j]); }
    for (int64_t r = 1; r < R; ++r) {
      const vf e = bc(rf[r]); const float* xs = src + r * C + c0;
      for (int j = 0; j < NB; ++j) {
        const vf v = ld(xs + j * W) * (e * cfv[j]) - sh[j];
        a[j] += v; a2[j] += v * v;
      }
    }
    const vf inv_r = bc(1.f / (float)R);
    for (int j = 0; j < NB; ++j) {
      const vf m = a[j] * inv_r, var = a2[j] * inv_r - m * m;
      st_(stdv + c0 + j * W, vsqrt(vmax(var, vf{})));
    }
  }
  void col_std(const float* src, int64_t R, int64_t C, const float* rf, const float* cf) {
    for (int64_t c0 = 0; c0 < C;) {
      if (C - c0 >= 4 * W) { col_std_block<4>(src, R, C, c0, rf, cf); c0 += 4 * W; }
      else { col_std_block<1>(src, R, C, c0, rf, cf); c0 += W; }
    }
  }

  static float mean(const float* v, int64_t n) {
    float acc = 0.f;
    for (int64_t i = 0; i < n; ++i) acc += v[i];
    return acc / (float)n;
  }

  // log += log(std + 1e-3 * mean(std) + 1e-30), then centred (geometric mean 1)
  void log_step(float* lg, int64_t n) {
    const float fl = kStdFloor * mean(stdv, n) + kTiny;
    for (int64_t i = 0; i < n; ++i) lg[i] += std::log(stdv[i] + fl);
    const float m = mean(lg, n);
    for (int64_t i = 0; i < n; ++i) lg[i] -= m;
  }

  // ec holds exp(-log_c) on entry (set by encode, then by the previous step)
  void sinkhorn_step() {
    for (int64_t t = 0; t < T; ++t) er[t] = std::exp(-log_r[t]);
    col_std(x, T, D, er, ec);  // per channel, over tokens
    log_step(log_c, D);
    for (int64_t d = 0; d < D; ++d) ec[d] = std::exp(-log_c[d]);
    col_std(xt, D, T, ec, er);  // per token, over channels
    log_step(log_r, T);
  }

  const float* grid_src() const { return per_channel ? x : xt; }
  int64_t grid_rows() const { return per_channel ? T : D; }
  int64_t grid_cols() const { return per_channel ? D : T; }

  // per-column minimum and maximum of y = src[r, c] / f[r] (NB vectors of columns at a time)
  template <int NB>
  void range_block(const float* src, int64_t R, int64_t C, int64_t c0, float* lo, float* hi) const {
    vf l[NB], h[NB];
    for (int j = 0; j < NB; ++j) { l[j] = bc(INFINITY); h[j] = bc(-INFINITY); }
    for (int64_t r = 0; r < R; ++r) {
      const vf g = bc(inv_f[r]); const float* xs = src + r * C + c0;
      for (int j = 0; j < NB; ++j) { const vf v = ld(xs + j * W) * g; l[j] = vmin(l[j], v); h[j] = vmax(h[j], v); }
    }
    for (int j = 0; j < NB; ++j) { st_(lo + c0 + j * W, l[j]); st_(hi + c0 + j * W, h[j]); }
  }

  // scale s, offset o (code k decodes to k * s + o) and the rounding constants of every column:
  // k = clamp(floor(y * inv_s + bias), 0, qmax) for y = x / f
  void params(float qmax) {
    const int64_t R = grid_rows(), C = grid_cols();
    const float* __restrict src = grid_src();
    float* lo = sum; float* hi = sum2;
    for (int64_t c0 = 0; c0 < C;) {
      if (C - c0 >= 4 * W) { range_block<4>(src, R, C, c0, lo, hi); c0 += 4 * W; }
      else { range_block<1>(src, R, C, c0, lo, hi); c0 += W; }
    }
    if (log8) {
      for (int64_t c = 0; c < C; ++c) {
        const float l = lo[c], h = hi[c];
        float sc;
        const float need = std::max((h - l) / qmax, std::fabs(l) / 127.f);
        store_positive(need, true, true, lut, &s_raw[c], &sc);
        const float safe = sc > 0.f ? sc : 1.f;
        float z = std::min(std::max(std::floor(l / safe + 0.5f), -128.f), 127.f);
        z = sc > 0.f ? z : 0.f;
        o[c] = z * sc; q_raw[c] = (uint32_t)(int32_t)z & 0xff;
        bias[c] = 0.5f - z;
        s[c] = sc; inv_s[c] = sc > 0.f ? 1.f / sc : 0.f;
      }
      return;
    }
    // fp16: the minimum rounded down to fp16 is the offset; the scale rounds up, so that the
    // maximum stays within the codes (branch-free over the columns, conversions W at a time)
    for (int64_t c = 0; c < C; ++c) tmp[c] = std::min(std::max(lo[c], -kFp16Max), kFp16Max);
    to_half(tmp, h16, C);
    from_half(h16, tmp, C);
    for (int64_t c = 0; c < C; ++c) {  // one fp16 step towards -inf where rounding went up
      const uint16_t b = h16[c];
      const uint16_t down = (b & 0x7fff) == 0 ? 0x8001 : (b & 0x8000) ? (uint16_t)(b + 1) : (uint16_t)(b - 1);
      h16[c] = tmp[c] > lo[c] ? down : b;
      q_raw[c] = h16[c];
    }
    from_half(h16, o, C);
    for (int64_t c = 0; c < C; ++c) hi[c] = std::min(std::max((hi[c] - o[c]) / qmax, 0.f), kFp16Max);  // scale asked
    to_half(hi, h16, C);
    from_half(h16, tmp, C);
    for (int64_t c = 0; c < C; ++c) h16[c] = tmp[c] < hi[c] && tmp[c] < kFp16Max ? (uint16_t)(h16[c] + 1) : h16[c];
    from_half(h16, s, C);
    for (int64_t c = 0; c < C; ++c) {
      s_raw[c] = h16[c];
      const bool pos = s[c] > 0.f;
      inv_s[c] = pos ? 1.f / s[c] : 0.f;
      bias[c] = pos ? 0.5f - o[c] * inv_s[c] : 0.f;
    }
  }

  // squared error of the grid against x over the columns c0 .. c0 + NB * W - 1
  template <int NB>
  float sq_err_block(int64_t R, int64_t C, int64_t c0, float qmax) const {
    const float* src = grid_src() + c0;
    const vf top = bc(qmax + 0.5f);
    vf is[NB], b[NB], sc[NB], of[NB], a[NB] = {};
    for (int j = 0; j < NB; ++j) {
      const int64_t c = c0 + j * W;
      is[j] = ld(inv_s + c); b[j] = ld(bias + c); sc[j] = ld(s + c); of[j] = ld(o + c);
    }
    for (int64_t r = 0; r < R; ++r) {
      const vf fr = bc(f[r]), g = bc(inv_f[r]); const float* xs = src + r * C;
      for (int j = 0; j < NB; ++j) {
        const vf x0 = ld(xs + j * W);
        const vf k = code_of(x0 * g * is[j] + b[j], top);
        const vf diff = (k * sc[j] + of[j]) * fr - x0;
        a[j] += diff * diff;
      }
    }
    vf t = a[0];
    for (int j = 1; j < NB; ++j) t += a[j];
    float e = 0.f;
    for (int j = 0; j < W; ++j) e += t[j];
    return e;
  }

  // squared error of the grid against x, summed over the tile
  double sq_err(float qmax) const {
    const int64_t R = grid_rows(), C = grid_cols();
    double e = 0.0;
    for (int64_t c0 = 0; c0 < C;) {
      if (C - c0 >= 4 * W) { e += sq_err_block<4>(R, C, c0, qmax); c0 += 4 * W; }
      else { e += sq_err_block<1>(R, C, c0, qmax); c0 += W; }
    }
    return e;
  }

  // codes [T, D] of the best iterate (factors and column constants in best_*)
  void final_codes(float qmax) {
    const vf top = bc(qmax + 0.5f);
    for (int64_t t = 0; t < T; ++t) {
      const float* xs = x + t * D; uint8_t* out = codes + t * D;
      for (int64_t d = 0; d < D; d += W) {
        // keys: a factor per row (token), constants per column (channel); values the other way round
        const vf u = per_channel ? ld(xs + d) * bc(1.f / best_f[t]) * ld(best_inv_s + d) + ld(best_bias + d)
                                 : ld(xs + d) * ld(inv_f + d) * bc(best_inv_s[t]) + bc(best_bias[t]);
        const vb k = __builtin_convertvector(__builtin_convertvector(vmin(vmax(u, vf{}), top), vi), vb);
        std::memcpy(out + d, &k, W);
      }
    }
  }

  // x [T, D] and xt [D, T] <- the tile at src (row stride st, dtype 0/1/2) rotated: xt's rows
  // (channels) times the signs, then the fast Walsh-Hadamard transform over the channel axis, whose
  // butterflies combine whole rows of xt (x @ H / sqrt(D), H the Sylvester Hadamard matrix). Rows are
  // loaded token by token with vector conversions, and moved between x and xt by 8 x 8 blocks.
  void load_tile(const void* src, int64_t st, int64_t dtype, int64_t rot, const float* signs) {
    for (int64_t t = 0; t < T; ++t) load_row(src, t * st, dtype, D, x + t * D);
    if (!rot) { transpose(x, T, D, xt); return; }
    transpose(x, T, D, xt);
    if (signs)
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < T; t += W) st_(xt + d * T + t, ld(xt + d * T + t) * bc(signs[d]));
    for (int64_t h = 1; h < D; h *= 2)
      for (int64_t i = 0; i < D; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          float* a = xt + j * T; float* b = xt + (j + h) * T;
          for (int64_t t = 0; t < T; t += W) {
            const vf u = ld(a + t), v = ld(b + t);
            st_(a + t, u + v); st_(b + t, u - v);
          }
        }
    const vf norm = bc(1.f / std::sqrt((float)D));
    for (int64_t i = 0; i < T * D; i += W) st_(xt + i, ld(xt + i) * norm);
    transpose(xt, D, T, x);
  }

  // the grid's row factors f, inv_f and their stored values f_raw from the logs lf[n]: exp(lf) * base
  // stored (fp16 rounded to nearest, W at a time; or log8)
  void factors(const float* lf, int64_t n, float base) {
    for (int64_t i = 0; i < n; ++i) tmp[i] = std::exp(lf[i]) * base;
    if (log8) {
      for (int64_t i = 0; i < n; ++i) {
        float fv; store_positive(tmp[i], true, false, lut, &f_raw[i], &fv);
        f[i] = std::max(fv, 1e-30f); inv_f[i] = 1.f / f[i];
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) tmp[i] = std::min(std::max(tmp[i], 0.f), kFp16Max);
    to_half(tmp, h16, n);
    from_half(h16, tmp, n);
    for (int64_t i = 0; i < n; ++i) { f_raw[i] = h16[i]; f[i] = std::max(tmp[i], 1e-30f); inv_f[i] = 1.f / f[i]; }
  }

  // encode x [T, D] (already in this->x) into the record at rec
  void encode(uint8_t* rec, int64_t code_off, int64_t scale_off, int64_t offset_off, int64_t factor_off) {
    const float qmax = (float)((1 << bits) - 1);
    vf m = vf{};
    for (int64_t i = 0; i < T * D; i += W) m = vmax(m, vmax(ld(x + i), -ld(x + i)));
    float amax = 0.f;
    for (int j = 0; j < W; ++j) amax = std::max(amax, m[j]);
    const float base = std::sqrt(std::max(amax, kMinMagnitude));
    std::fill(log_r, log_r + T, 0.f); std::fill(log_c, log_c + D, 0.f);
    for (int64_t d = 0; d < D; ++d) ec[d] = std::exp(-log_c[d]);
    const int64_t FN = per_channel ? T : D, SN = per_channel ? D : T, PB = log8 ? 1 : 2;
    double best = INFINITY;
    for (int64_t it = 0; it <= iters; ++it) {
      if (it > 0) sinkhorn_step();
      const float* lf = per_channel ? log_r : log_c;
      factors(lf, FN, base);
      params(qmax);
      const double e = sq_err(qmax);
      if (it == 0 || e < best) {
        best = e;
        std::copy(s_raw, s_raw + SN, best_s_raw); std::copy(q_raw, q_raw + SN, best_q_raw);
        std::copy(f_raw, f_raw + FN, best_f_raw);
        std::copy(f, f + FN, best_f);
        std::copy(inv_s, inv_s + SN, best_inv_s);
        std::copy(bias, bias + SN, best_bias);
      }
    }
    for (int64_t i = 0; i < SN; ++i) { put(rec + scale_off, i, best_s_raw[i], PB); put(rec + offset_off, i, best_q_raw[i], PB); }
    for (int64_t i = 0; i < FN; ++i) put(rec + factor_off, i, best_f_raw[i], PB);
    if (!per_channel)
      for (int64_t d = 0; d < D; ++d) inv_f[d] = 1.f / best_f[d];
    final_codes(qmax);
    pack(rec + code_off);
  }

  static void put(uint8_t* dst, int64_t i, uint32_t raw, int64_t pb) {
    if (pb == 2) { dst[2 * i] = (uint8_t)(raw & 0xff); dst[2 * i + 1] = (uint8_t)(raw >> 8); }
    else dst[i] = (uint8_t)raw;
  }

  // one w-bit plane of bits shift.. of the codes: byte k holds codes k*P .. k*P+P-1 (P = 8 / w), low
  // bits first (rows of D codes are whole bytes, so the tile packs as one flat run)
  template <int w>
  void pack_plane(uint8_t* __restrict out, int shift) const {
    constexpr int per = 8 / w, mask = (1 << w) - 1;
    const int64_t n = T * D / per;
    const uint8_t* __restrict c = codes;
    for (int64_t k = 0; k < n; ++k) {
      uint32_t byte = 0;
      for (int j = 0; j < per; ++j) byte |= (uint32_t)((c[k * per + j] >> shift) & mask) << (j * w);
      out[k] = (uint8_t)byte;
    }
  }

  void pack(uint8_t* out) const {  // planes (8 -> [8], 4 -> [4], 3 -> [2, 1], 2 -> [2]) packed along D
    switch (bits) {
      case 2: pack_plane<2>(out, 0); break;
      case 3: pack_plane<2>(out, 0); pack_plane<1>(out + T * D / 4, 2); break;
      case 4: pack_plane<4>(out, 0); break;
      default: std::memcpy(out, codes, T * D); break;
    }
  }
};

}  // namespace

void kvarn::store_tiles(const StoreArgs& a) {
  const int64_t N = a.N, H = a.H, T = a.T, D = a.D;
  #pragma omp parallel for schedule(dynamic, 1) num_threads((int)a.NTHREADS)
  for (int64_t task = 0; task < N * H * 2; ++task) {
    const int64_t tile = task / 2, n = tile / H, h = tile % H;
    const bool keys = task % 2 == 0;
    thread_local std::unique_ptr<Side> ws(new Side());
    Side& w = *ws;
    w.T = T; w.D = D; w.bits = keys ? a.KB : a.VB; w.per_channel = keys; w.log8 = a.LOG8 != 0;
    w.lut = a.lut; w.iters = a.ITERS;
    const void* src = keys ? a.keys : a.values;
    const int64_t off = keys ? n * a.k_sn + h * a.k_sh : n * a.v_sn + h * a.v_sh;
    const int64_t esize = a.DTYPE == 0 ? 4 : 2;
    w.load_tile(static_cast<const uint8_t*>(src) + off * esize, keys ? a.k_st : a.v_st, a.DTYPE, a.ROTATE, a.signs);
    uint8_t* rec = a.cache + a.block_ids[n] * a.cache_sb + h * a.cache_sh;
    if (keys) w.encode(rec, a.KC, a.KS, a.KO, a.KF);
    else w.encode(rec, a.VC, a.VS, a.VO, a.VF);
  }
}
