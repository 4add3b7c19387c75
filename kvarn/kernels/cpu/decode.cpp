// Native CPU decode attention. One task per (sequence, KV head, split of SPLIT_TILES of its tiles)
// streams its tiles record by record: key scores straight from the packed codes for all G query
// heads of the KV head at once (score = kf * ((q_r * ks) . codes + q_r . ko)), an online softmax
// per tile, then value sums straight from the packed value codes, each code widened once for all G
// heads (acc_r += vf * ((p * vs) @ codes + p . vo)); one more task per (sequence, KV head) attends the
// exact rows (sink, tail) with the unrotated query. A second parallel loop merges the partial
// softmax states in a fixed order, un-rotates the tile part and writes the output in the query's dtype.
// Paths by what the build targets: AMX-INT8 key scores (where Linux also grants the tile state) with
// AVX-512 float for the rest; AVX-512 float throughout; 8-lane AVX2 (attend.h) without AVX-512.
#include "kernels.h"
#include "attend.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVARN_AMX 1  // the tile loop's AMX-INT8 key scores, where Linux grants the tile state
#include <sys/syscall.h>
#include <unistd.h>
#endif

using Args = kvarn::DecodeArgs;

namespace {

constexpr int HEADS_AMX = 5;  // query heads a tile product (KVARN_AMX): 3 rows (digits) each, of 16

// the AMX key path's buffers (64-byte aligned, in a thread's Scratch); a group is HEADS_AMX query heads
struct AmxBuffers {
  int8_t* qa;     // query digits [groups, L / 64, 16, 64]
  uint8_t* bt;    // code tiles [T / 16, L / 64, 16, 64]
  int32_t* cbuf;  // tiles of sums [groups, T / 16, 16, 16]
  float* kstep;   // [G]
};

int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// per-thread buffers, sized once per call (no allocation per task)
struct Scratch {
  std::vector<float> rows, qs, qp, c, s, tmp, ks, ko, kf, vs, vo, vf, kperm, vperm, accp, red16;
  std::vector<float> m, l, acc, q, qr;  // a task's softmax state and query
  std::vector<v8f> red;
  std::vector<int32_t> kidx, vidx;
  std::vector<uint8_t> amx_bytes;  // AmxBuffers' storage
  AmxBuffers amx{};
  void fit(int64_t G, int64_t T, int64_t D, int64_t KB, int64_t VB) {
    const int64_t L = 2 * D;  // at most two planes
    rows.resize(std::max<int64_t>(ROWS * L, D)); qs.resize(G * L); qp.resize(G * L); c.resize(G); s.resize(G * T);
    tmp.resize(G * L); ks.resize(D); ko.resize(D); kf.resize(T); vs.resize(T); vo.resize(T);
    vf.resize(D); kperm.resize(L); vperm.resize(L); accp.resize(G * L); red16.resize(4 * 16 * 16);
    m.resize(G); l.resize(G); acc.resize(G * D); q.resize(G * D); qr.resize(G * D);
    red.resize(4 * 8); kidx.resize(L); vidx.resize(L);
    plane_channels_any(KB, D, kidx.data());
    plane_channels_any(VB, D, vidx.data());
#if defined(KVARN_AMX)
    const int64_t groups = (G + HEADS_AMX - 1) / HEADS_AMX, blk = 16 * 64;  // L: the key planes' positions
    const int64_t qa = groups * (L / 64) * blk, bt = T / 16 * (L / 64) * blk, cb = groups * (T / 16) * blk;
    amx_bytes.assign(qa + bt + cb + 4 * G + 64, 0);  // zeros: the query tiles' unused rows
    uint8_t* base = amx_bytes.data() + (64 - reinterpret_cast<uintptr_t>(amx_bytes.data()) % 64) % 64;
    amx.qa = reinterpret_cast<int8_t*>(base); amx.bt = base + qa;
    amx.cbuf = reinterpret_cast<int32_t*>(base + qa + bt); amx.kstep = reinterpret_cast<float*>(base + qa + bt + cb);
#endif
  }
};

#if defined(__AVX512F__)
// 16-lane AVX-512 paths of the tile loop (the 8-lane path below is the fallback without AVX-512)

inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline void st16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// 16 bytes zero-extended to 16 int32 lanes; the 8 bytes twice (lanes 0..7 and 8..15)
inline __m512i widen16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i widen8x2(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(x, x));
}

// the value of each 4-bit index (the low 4 bits of a lane: _mm512_permutexvar_ps) as a W-bit code times 2**shift
template <int W>
inline __m512 code_table(int shift) {
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = (float)((i & ((1 << W) - 1)) << shift);
  return _mm512_load_ps(t);
}

// f(pos, v) for the codes of one row (n bytes) of a W-bit plane, 16 at a time: v holds the codes of the
// plane-order positions pos..pos+15 (vec.h) times 2**shift. Codes of W <= 4 bits go through a table
// lookup on the low 4 bits of each lane (no mask, no int->float conversion); a 1-bit plane of 8 bytes
// (head_dim 64) gives positions j*8 .. j*8+15 of two shifts at once.
template <int W, class F>
inline void row_codes(const uint8_t* row, int64_t n, const __m512 table, F&& f) {
  constexpr int P = 8 / W;
  if constexpr (W == 8) {
    for (int64_t c = 0; c < n; c += 16) f(c, _mm512_cvtepi32_ps(widen16(row + c)));
  } else {
    if (n % 16 == 0) {
      for (int64_t c = 0; c < n; c += 16) {
        const __m512i x = widen16(row + c);
        f(c, _mm512_permutexvar_ps(x, table));
        for (int j = 1; j < P; ++j) f(j * n + c, _mm512_permutexvar_ps(_mm512_srli_epi32(x, j * W), table));
      }
    } else {  // n == 8
      const __m512i x = widen8x2(row);
      for (int j = 0; j < P; j += 2) {
        const __m512i sh = _mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_set1_epi32(j * W), _mm512_set1_epi32((j + 1) * W));
        f(j * n, _mm512_permutexvar_ps(_mm512_srlv_epi32(x, sh), table));
      }
    }
  }
}

// as row_codes for two consecutive rows (n bytes apart): f(pos, v_row0, v_row1)
template <int W, class F>
inline void row_codes2(const uint8_t* row, int64_t n, const __m512 table, F&& f) {
  constexpr int P = 8 / W;
  if constexpr (W == 8) {
    for (int64_t c = 0; c < n; c += 16) f(c, _mm512_cvtepi32_ps(widen16(row + c)), _mm512_cvtepi32_ps(widen16(row + n + c)));
  } else {
    if (n % 16 == 0) {
      for (int64_t c = 0; c < n; c += 16) {
        const __m512i x = widen16(row + c), y = widen16(row + n + c);
        f(c, _mm512_permutexvar_ps(x, table), _mm512_permutexvar_ps(y, table));
        for (int j = 1; j < P; ++j)
          f(j * n + c, _mm512_permutexvar_ps(_mm512_srli_epi32(x, j * W), table),
            _mm512_permutexvar_ps(_mm512_srli_epi32(y, j * W), table));
      }
    } else {  // n == 8
      const __m512i x = widen8x2(row), y = widen8x2(row + n);
      for (int j = 0; j < P; j += 2) {
        const __m512i sh = _mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_set1_epi32(j * W), _mm512_set1_epi32((j + 1) * W));
        f(j * n, _mm512_permutexvar_ps(_mm512_srlv_epi32(x, sh), table), _mm512_permutexvar_ps(_mm512_srlv_epi32(y, sh), table));
      }
    }
  }
}

// the 16 lane sums of v[0..15] (stored at v + 16 * slot(r), slot(r) = (r & 3) * 4 + (r >> 2)), as one vector
inline int hsum_slot(int r) { return (r & 3) * 4 + (r >> 2); }
inline __m512 hsum16(const float* v) {
  __m512 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = ld16(v + 32 * i), b = ld16(v + 32 * i + 16);
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88), _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(l2[2 * i]), b = _mm512_castps_pd(l2[2 * i + 1]);
    l3[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
}

// exp of 16 lanes x <= 0, as exp_neg8
inline __m512 exp_neg16(__m512 x) {
  const __mmask16 dead = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_mask_mov_ps(x, dead, _mm512_set1_ps(-87.f));
  const __m512 big = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), big), big);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps((__mmask16)~dead, y, _mm512_castsi512_ps(bits));
}

// stored params (positives / offsets of vec.h), 16 at a time (n a multiple of 16)
inline void positives16(const uint8_t* src, int64_t n, bool log8, const float* lut, float* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    if (log8) st16(dst + i, _mm512_i32gather_ps(widen16(src + i), lut, 4));
    else st16(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i))));
  }
}

inline void offsets16(const uint8_t* src, int64_t n, bool log8, const float* scale, float* dst) {
  if (!log8) return positives16(src, n, false, nullptr, dst);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    st16(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(x), ld16(scale + i)));
  }
}

// s[g * ld + t] = sum_x qs[g * L + x] * codes[t][x] for query heads g0..g0+NG-1, all T rows of a key code
// section: one accumulator per head and row, 16 rows reduced at once (hsum16)
template <int BITS, int NG>
inline void scores16(const uint8_t* sec, int64_t T, int64_t D, const float* qs, int64_t L, int64_t g0, float* s,
                     int64_t ld, float* red) {
  const float* q0 = qs + g0 * L;
  __m512 tables[Planes<BITS>::N];
  for (int k = 0; k < Planes<BITS>::N; ++k) tables[k] = Planes<BITS>::W[k] == 8 ? _mm512_setzero_ps() : (
      Planes<BITS>::W[k] == 1 ? code_table<1>(Planes<BITS>::SHIFT[k]) : Planes<BITS>::W[k] == 2 ? code_table<2>(Planes<BITS>::SHIFT[k]) : code_table<4>(Planes<BITS>::SHIFT[k]));
  for (int64_t t16 = 0; t16 < T; t16 += 16) {
    for (int r = 0; r < 16; r += 2) {  // two rows at a time: each query vector loaded once for both
      __m512 acc[2][NG];
      for (int k = 0; k < NG; ++k) acc[0][k] = acc[1][k] = _mm512_setzero_ps();
      const uint8_t* plane = sec;
      for (int pk = 0; pk < Planes<BITS>::N; ++pk) {
        const float* qp = q0 + pk * D;
        const int w = Planes<BITS>::W[pk];
        const int64_t n = D * w / 8;
        const uint8_t* row = plane + (t16 + r) * n;
        auto fma2 = [&](int64_t pos, __m512 v0, __m512 v1) {
          for (int k = 0; k < NG; ++k) {
            const __m512 qv = ld16(qp + k * L + pos);
            acc[0][k] = _mm512_fmadd_ps(v0, qv, acc[0][k]);
            acc[1][k] = _mm512_fmadd_ps(v1, qv, acc[1][k]);
          }
        };
        if (w == 8) row_codes2<8>(row, n, tables[pk], fma2);
        else if (w == 4) row_codes2<4>(row, n, tables[pk], fma2);
        else if (w == 2) row_codes2<2>(row, n, tables[pk], fma2);
        else row_codes2<1>(row, n, tables[pk], fma2);
        plane += T * n;
      }
      for (int k = 0; k < NG; ++k) {
        st16(red + (k * 16 + hsum_slot(r)) * 16, acc[0][k]);
        st16(red + (k * 16 + hsum_slot(r + 1)) * 16, acc[1][k]);
      }
    }
    for (int k = 0; k < NG; ++k) st16(s + (g0 + k) * ld + t16, hsum16(red + k * 256));
  }
}

// out[g * L + pos] = sum_t p[g * ld + t] * codes[t][pos] over the T rows of one W-bit plane (n bytes a row)
// for query heads g0..g0+NG-1; up to 4 vectors of positions a pass, their 4 * NG sums in registers
template <int W, int NG>
inline void values16(const uint8_t* plane, int64_t T, int64_t n, int shift, const float* p, int64_t ld, int64_t g0,
                     int64_t L, float* out) {
  constexpr int P = 8 / W;
  const __m512 table = code_table<W == 8 ? 4 : W>(shift);
  const float* p0 = p + g0 * ld;
  if constexpr (W == 8) {
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
      const int nc = (int)std::min<int64_t>(4, (n - c0) / 16);
      __m512 acc[NG][4];
      for (int k = 0; k < NG; ++k) for (int j = 0; j < 4; ++j) acc[k][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < T; ++t) {
        for (int j = 0; j < 4; ++j) {
          if (j >= nc) break;
          const __m512 v = _mm512_cvtepi32_ps(widen16(plane + t * n + c0 + 16 * j));
          for (int k = 0; k < NG; ++k) acc[k][j] = _mm512_fmadd_ps(_mm512_set1_ps(p0[k * ld + t]), v, acc[k][j]);
        }
      }
      for (int k = 0; k < NG; ++k)
        for (int j = 0; j < nc; ++j) st16(out + (g0 + k) * L + c0 + 16 * j, acc[k][j]);
    }
  } else if (n % 16 == 0) {
    // one 16-byte column chunk gives P vectors; chunks of 4-bit planes two at a time
    constexpr int C = P >= 4 ? 1 : 4 / P, J = P >= 4 ? 4 : P;  // chunks and shifts a pass (C * J = 4)
    for (int64_t c0 = 0; c0 < n; c0 += 16 * C) {
      for (int j0 = 0; j0 < P; j0 += J) {
        __m512 acc[NG][C * J];
        for (int k = 0; k < NG; ++k) for (int v = 0; v < C * J; ++v) acc[k][v] = _mm512_setzero_ps();
        for (int64_t t = 0; t < T; ++t) {
          __m512 code[C * J];
          for (int c = 0; c < C; ++c) {
            const __m512i x = widen16(plane + t * n + c0 + 16 * c);
            for (int j = 0; j < J; ++j)
              code[c * J + j] = _mm512_permutexvar_ps(j0 + j ? _mm512_srli_epi32(x, (j0 + j) * W) : x, table);
          }
          for (int k = 0; k < NG; ++k) {
            const __m512 w = _mm512_set1_ps(p0[k * ld + t]);
            for (int v = 0; v < C * J; ++v) acc[k][v] = _mm512_fmadd_ps(w, code[v], acc[k][v]);
          }
        }
        for (int k = 0; k < NG; ++k)
          for (int c = 0; c < C; ++c)
            for (int j = 0; j < J; ++j) st16(out + (g0 + k) * L + (j0 + j) * n + c0 + 16 * c, acc[k][c * J + j]);
      }
    }
  } else {  // a 1-bit plane of 8 bytes a row: positions j*8 .. j*8+15 of shifts j, j+1
    __m512 acc[NG][4];
    for (int k = 0; k < NG; ++k) for (int v = 0; v < 4; ++v) acc[k][v] = _mm512_setzero_ps();
    __m512i sh[4];
    for (int v = 0; v < 4; ++v)
      sh[v] = _mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_set1_epi32(2 * v * W), _mm512_set1_epi32((2 * v + 1) * W));
    for (int64_t t = 0; t < T; ++t) {
      const __m512i x = widen8x2(plane + t * n);
      __m512 code[4];
      for (int v = 0; v < 4; ++v) code[v] = _mm512_permutexvar_ps(_mm512_srlv_epi32(x, sh[v]), table);
      for (int k = 0; k < NG; ++k) {
        const __m512 w = _mm512_set1_ps(p0[k * ld + t]);
        for (int v = 0; v < 4; ++v) acc[k][v] = _mm512_fmadd_ps(w, code[v], acc[k][v]);
      }
    }
    for (int k = 0; k < NG; ++k)
      for (int v = 0; v < 4; ++v) st16(out + (g0 + k) * L + 16 * v, acc[k][v]);
  }
}

#if defined(KVARN_AMX)
// AMX-INT8 key scores: one TDPBSUD multiplies a 16 x 64 tile of signed bytes (query digits) by a
// 64 x 16 tile of unsigned bytes (the codes of 16 rows, exact) into 16 x 16 int32 sums, so a tile's
// scores for up to 5 query heads are T / 16 tile products per 64 plane positions. The query times the
// key scales (qs, plane order) is rounded to 24-bit integers, qs ~ step * qi with step = max|qs| /
// QMAX per tile and head, written as three signed base-256 digits (one tile row each) whose exact
// sums are added in float: the only error is that rounding, |qs - step * qi| <= step / 2, 2**-24 of
// the head's largest |qs|. (Two digits, 16 bits, put outputs up to 1e-4 off the float path.)
constexpr float QMAX = 8355700.f;  // just under 127 * 65793: qi = 65536 hi + 256 mid + lo, digits in -128..127

// whether Linux lets this process use the tile registers (asked once; false: the float path)
bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// tile registers of 16 rows of 64 bytes: 0, 5 sums, 1 query digits, 2, 6 codes
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 7; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  _tile_loadconfig(&cfg);
}

// the sum of three digit rows of int32 sums (16 lanes each), as floats
inline __m512 digits_sum(const int32_t* c) {
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_load_si512(c)), mid = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16));
  return _mm512_add_ps(_mm512_fmadd_ps(hi, _mm512_set1_ps(65536.f), _mm512_mul_ps(mid, _mm512_set1_ps(256.f))),
                       _mm512_cvtepi32_ps(_mm512_load_si512(c + 32)));
}

// Query digits qa[((hg * chunks + c) * 16 + 3 * k + d) * 64 + x] (signed; d = 0 hi, 1 mid, 2 lo) of head
// 5 hg + k at plane position 64 c + x, and each head's step; false when a product is not finite or
// too small to scale (the float path then takes the tile). Rows past 3 heads' digits stay zero.
inline bool query_digits(const float* qs, int64_t L, int64_t G, int8_t* qa, float* step) {
  const int64_t chunks = L / 64;
  const __m512 inf = _mm512_set1_ps(INFINITY);
  const __m512i half = _mm512_set1_epi32(128), low = _mm512_set1_epi32(255);
  for (int64_t g = 0; g < G; ++g) {
    const float* q = qs + g * L;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t x = 0; x < L; x += 16) {
      const __m512 v = _mm512_abs_ps(ld16(q + x));
      bad |= _mm512_cmp_ps_mask(v, inf, _CMP_NLT_UQ);  // inf or NaN
      amax = _mm512_max_ps(amax, v);
    }
    const float mx = _mm512_reduce_max_ps(amax), inv = mx > 0.f ? QMAX / mx : 0.f;
    if (bad || !(inv < INFINITY)) return false;
    step[g] = mx / QMAX;
    int8_t* rows = qa + ((g / HEADS_AMX) * chunks * 16 + 3 * (g % HEADS_AMX)) * 64;
    for (int64_t x = 0; x < L; x += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(ld16(q + x), _mm512_set1_ps(inv)));
      const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(qi, half), low), half);
      const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(qi, lo), 8);
      const __m512i mid = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, half), low), half);
      const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(r, mid), 8);
      int8_t* dst = rows + (x / 64) * 16 * 64 + x % 64;
      _mm_store_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(hi));
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + 64), _mm512_cvtepi32_epi8(mid));
      _mm_store_si128(reinterpret_cast<__m128i*>(dst + 128), _mm512_cvtepi32_epi8(lo));
    }
  }
  return true;
}

// s[g * T + t] = step[g] * sum_x qi[g][x] * codes[t][x] for every head. The codes of each 16 rows are
// 64 x 16 byte tiles, one per 64 plane positions (tile row r: positions 4r..4r+3 of each of the 16
// rows), from one gather per 4 bytes of packed row; all tiles are written before the first product
// and all products stored before the first sum is read, two products in flight (tiles 0 and 5).
template <int BITS>
inline void scores_amx(const uint8_t* sec, int64_t T, int64_t D, const int8_t* qa, int64_t G, const float* step,
                       uint8_t* bt, int32_t* cbuf, float* s) {
  const int64_t L = Planes<BITS>::N * D, chunks = L / 64, blocks = T / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* plane = sec;
    uint8_t* tile = bt + b * chunks * 16 * 64;
    int64_t row = 0;
    for (int k = 0; k < Planes<BITS>::N; ++k) {
      const int w = Planes<BITS>::W[k], shift = Planes<BITS>::SHIFT[k];
      const int64_t n = D * w / 8, P = 8 / w;
      const __m512i mask = _mm512_set1_epi8((char)((1 << w) - 1));
      const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32((int)(n / 4)));
      for (int64_t m = 0; m < n / 4; ++m) {
        const __m512i x = _mm512_i32gather_epi32(index, plane + 16 * b * n + 4 * m, 4);
        for (int64_t j = 0; j < P; ++j) {
          const __m512i c = w == 8 ? x : _mm512_and_si512(j ? _mm512_srli_epi16(x, (int)(j * w)) : x, mask);
          _mm512_store_si512(tile + (row + j * n / 4 + m) * 64, shift ? _mm512_slli_epi16(c, shift) : c);
        }
      }
      row += D / 4;
      plane += T * n;
    }
  }
  for (int64_t g0 = 0; g0 < G; g0 += HEADS_AMX) {
    const int8_t* q = qa + (g0 / HEADS_AMX) * chunks * 16 * 64;
    int32_t* sums = cbuf + (g0 / HEADS_AMX) * blocks * 256;
    for (int64_t b = 0; b < blocks; b += 2) {
      _tile_zero(0);
      _tile_zero(5);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(1, q + c * 16 * 64, 64);
        _tile_loadd(2, bt + (b * chunks + c) * 16 * 64, 64);
        _tile_loadd(6, bt + ((b + 1) * chunks + c) * 16 * 64, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_dpbsud(5, 1, 6);
      }
      _tile_stored(0, sums + b * 256, 64);
      _tile_stored(5, sums + (b + 1) * 256, 64);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int32_t* sums = cbuf + (g / HEADS_AMX) * blocks * 256 + 3 * (g % HEADS_AMX) * 16;
    for (int64_t b = 0; b < blocks; ++b)
      st16(s + g * T + 16 * b, _mm512_mul_ps(digits_sum(sums + b * 256), _mm512_set1_ps(step[g])));
  }
}

#endif  // KVARN_AMX

template <int BITS>
inline void packed_values16(const uint8_t* sec, int64_t T, int64_t D, const float* p, int64_t ld, int64_t G, float* out) {
  const int64_t L = Planes<BITS>::N * D;
  const uint8_t* plane = sec;
  for (int k = 0; k < Planes<BITS>::N; ++k) {
    const int w = Planes<BITS>::W[k], shift = Planes<BITS>::SHIFT[k];
    const int64_t n = D * w / 8;
    head_groups(G, [&](auto ng, int64_t g0) {
      constexpr int NG = decltype(ng)::value;
      if (w == 8) values16<8, NG>(plane, T, n, shift, p, ld, g0, L, out + k * D);
      else if (w == 4) values16<4, NG>(plane, T, n, shift, p, ld, g0, L, out + k * D);
      else if (w == 2) values16<2, NG>(plane, T, n, shift, p, ld, g0, L, out + k * D);
      else values16<1, NG>(plane, T, n, shift, p, ld, g0, L, out + k * D);
    });
    plane += T * n;
  }
}

template <int BITS>
inline void packed_scores16(const uint8_t* sec, int64_t T, int64_t D, const float* qs, int64_t L, int64_t G, float* s,
                            float* red) {
  head_groups(G, [&](auto ng, int64_t g0) { scores16<BITS, decltype(ng)::value>(sec, T, D, qs, L, g0, s, T, red); });
}

// online softmax step over s[g * ld + t], t < n (a multiple of 16): as softmax_step
inline bool softmax16(float* s, int64_t G, int64_t n, int64_t ld, int64_t L, float* m, float* l, float* acc) {
  bool any = false;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * ld;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) mv = _mm512_max_ps(ld16(sg + t), mv);  // NaN scores are skipped
    const float mn = std::max(m[g], _mm512_reduce_max_ps(mv));
    if (mn == -INFINITY) {
      std::fill(sg, sg + n, 0.f);
      continue;
    }
    any = true;
    const float alpha = m[g] == -INFINITY ? 0.f : std::exp(m[g] - mn);
    __m512 sum = _mm512_setzero_ps();
    const __m512 mnv = _mm512_set1_ps(mn);
    for (int64_t t = 0; t < n; t += 16) {
      const __m512 p = exp_neg16(_mm512_sub_ps(ld16(sg + t), mnv));
      st16(sg + t, p);
      sum = _mm512_add_ps(sum, p);
    }
    l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);
    if (alpha != 1.f)
      for (int64_t x = 0; x < L; x += 16) st16(acc + g * L + x, _mm512_mul_ps(ld16(acc + g * L + x), _mm512_set1_ps(alpha)));
    m[g] = mn;
  }
  return any;
}

// s[g * ld + t] = sum_x q[g * D + x] * rows[t * D + x] for float rows t < R (a multiple of 16) and
// query heads g0..g0+NG-1, 16 rows reduced at once (hsum16)
template <int NG>
inline void row_scores16(const float* rows, const float* q, int64_t R, int64_t D, int64_t g0, float* s, int64_t ld,
                         float* red) {
  const float* q0 = q + g0 * D;
  for (int64_t t16 = 0; t16 < R; t16 += 16) {
    for (int r = 0; r < 16; ++r) {
      __m512 acc[NG];
      for (int k = 0; k < NG; ++k) acc[k] = _mm512_setzero_ps();
      const float* row = rows + (t16 + r) * D;
      for (int64_t x = 0; x < D; x += 16) {
        const __m512 v = ld16(row + x);
        for (int k = 0; k < NG; ++k) acc[k] = _mm512_fmadd_ps(v, ld16(q0 + k * D + x), acc[k]);
      }
      for (int k = 0; k < NG; ++k) st16(red + (k * 16 + hsum_slot(r)) * 16, acc[k]);
    }
    for (int k = 0; k < NG; ++k) st16(s + (g0 + k) * ld + t16, hsum16(red + k * 256));
  }
}

// out[g * D + x] = sum_t p[g * ld + t] * rows[t * D + x] over float rows t < R, every head; 64 columns
// at a time in registers
inline void row_values16(const float* rows, const float* p, int64_t R, int64_t D, int64_t G, int64_t ld, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t x0 = 0; x0 < D; x0 += 64) {
      const int64_t nk = std::min<int64_t>(4, (D - x0) / 16);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t t = 0; t < R; ++t) {
        const __m512 w = _mm512_set1_ps(p[g * ld + t]);
        for (int k = 0; k < 4; ++k)
          if (k < nk) acc[k] = _mm512_fmadd_ps(w, ld16(rows + t * D + x0 + 16 * k), acc[k]);
      }
      for (int k = 0; k < nk; ++k) st16(out + g * D + x0 + 16 * k, acc[k]);
    }
  }
}
#endif  // __AVX512F__

// Tiles t0..t1-1 of sequence b, KV head h, for the rotated query qr [G, D]. The query, the channel
// parameters and the accumulator live in the codes' plane order (vec.h), so that nothing is permuted
// per query head and tile; the accumulator returns to channel order (planes summed) once at the end.
void tiles_task(const Args& a, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t sink_n, const float* qr,
                float* m, float* l, float* acc, Scratch& w, bool amx) {
  const int64_t G = a.G, D = a.D, T = a.T;
  const int64_t KB = a.KB, VB = a.VB, LK = num_planes(KB) * D, LV = num_planes(VB) * D;
  const bool log8 = a.LOG8 != 0;
  float* qs = w.qs.data(); float* qp = w.qp.data(); float* c = w.c.data(); float* s = w.s.data();
  float* vsum = w.tmp.data(); float* accp = w.accp.data(); float* kperm = w.kperm.data(); float* vperm = w.vperm.data();
  const int32_t* kidx = w.kidx.data(); const int32_t* vidx = w.vidx.data();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t x = 0; x < LK; ++x) qp[g * LK + x] = qr[g * D + kidx[x]];
  std::fill(accp, accp + G * LV, 0.f);
  auto record = [&](int64_t i) { return a.cache + a.block_table[b * a.bt_sb + i] * a.cache_sb + h * a.cache_sh; };
  // records are scattered: every line of the next record is fetched while this one is computed, a
  // quarter at four points of the loop (a burst of a hundred prefetches stalls until the line fill
  // buffers drain; a record takes thousands of cycles)
  const int64_t rec_bytes = a.VF + (a.VF - a.VO) * D / T;  // the value factors [D] end the record
  const int64_t rec_lines = (rec_bytes + 2 * 63) / 64;     // lines may be unaligned
  auto prefetch = [&](int64_t i, int64_t part) {
    if (i >= t1) return;
    const uint8_t* r = record(i);
    for (int64_t line = part * rec_lines / 4; line < (part + 1) * rec_lines / 4; ++line) __builtin_prefetch(r + 64 * line);
  };
  for (int64_t part = 0; part < 4; ++part) prefetch(t0, part);
#if defined(KVARN_AMX)
  if (amx) configure_tiles();
#else
  (void)amx;
#endif
  for (int64_t i = t0; i < t1; ++i) {
    const uint8_t* rec = record(i);
    prefetch(i + 1, 0);
#if defined(__AVX512F__)
    positives16(rec + a.KS, D, log8, a.lut, w.ks.data());
    offsets16(rec + a.KO, D, log8, w.ks.data(), w.ko.data());
    positives16(rec + a.KF, T, log8, a.lut, w.kf.data());
    for (int64_t x = 0; x < LK; x += 16)
      st16(kperm + x, _mm512_i32gather_ps(_mm512_loadu_si512(kidx + x), w.ks.data(), 4));
    for (int64_t g = 0; g < G; ++g) {
      __m512 cg = _mm512_setzero_ps();
      for (int64_t x = 0; x < D; x += 16) cg = _mm512_fmadd_ps(ld16(qr + g * D + x), ld16(w.ko.data() + x), cg);
      c[g] = _mm512_reduce_add_ps(cg);
      for (int64_t x = 0; x < LK; x += 16) st16(qs + g * LK + x, _mm512_mul_ps(ld16(qp + g * LK + x), ld16(kperm + x)));
    }
#if defined(KVARN_AMX)
    if (amx && query_digits(qs, LK, G, w.amx.qa, w.amx.kstep)) {
      const AmxBuffers& x = w.amx;
      switch (KB) {
        case 2: scores_amx<2>(rec + a.KC, T, D, x.qa, G, x.kstep, x.bt, x.cbuf, s); break;
        case 3: scores_amx<3>(rec + a.KC, T, D, x.qa, G, x.kstep, x.bt, x.cbuf, s); break;
        case 4: scores_amx<4>(rec + a.KC, T, D, x.qa, G, x.kstep, x.bt, x.cbuf, s); break;
        default: scores_amx<8>(rec + a.KC, T, D, x.qa, G, x.kstep, x.bt, x.cbuf, s); break;
      }
    } else
#endif
    {
      switch (KB) {
        case 2: packed_scores16<2>(rec + a.KC, T, D, qs, LK, G, s, w.red16.data()); break;
        case 3: packed_scores16<3>(rec + a.KC, T, D, qs, LK, G, s, w.red16.data()); break;
        case 4: packed_scores16<4>(rec + a.KC, T, D, qs, LK, G, s, w.red16.data()); break;
        default: packed_scores16<8>(rec + a.KC, T, D, qs, LK, G, s, w.red16.data()); break;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 cg = _mm512_set1_ps(c[g]);
      for (int64_t t = 0; t < T; t += 16)
        st16(s + g * T + t, _mm512_mul_ps(ld16(w.kf.data() + t), _mm512_add_ps(ld16(s + g * T + t), cg)));
    }
    prefetch(i + 1, 1);
    if (i == 0 && sink_n > 0 && a.SINK_TOKENS > 0)  // attended from the exact copies instead
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < std::min(sink_n, T); ++t) s[g * T + t] = -INFINITY;
    prefetch(i + 1, 2);
    if (!softmax16(s, G, T, T, LV, m, l, accp)) continue;
    positives16(rec + a.VS, T, log8, a.lut, w.vs.data());
    offsets16(rec + a.VO, T, log8, w.vs.data(), w.vo.data());
    positives16(rec + a.VF, D, log8, a.lut, w.vf.data());
    for (int64_t x = 0; x < LV; x += 16)
      st16(vperm + x, _mm512_i32gather_ps(_mm512_loadu_si512(vidx + x), w.vf.data(), 4));
    for (int64_t g = 0; g < G; ++g) {
      __m512 cg = _mm512_setzero_ps();
      for (int64_t t = 0; t < T; t += 16) {
        const __m512 p = ld16(s + g * T + t);
        cg = _mm512_fmadd_ps(p, ld16(w.vo.data() + t), cg);
        st16(s + g * T + t, _mm512_mul_ps(p, ld16(w.vs.data() + t)));
      }
      c[g] = _mm512_reduce_add_ps(cg);
    }
    switch (VB) {
      case 2: packed_values16<2>(rec + a.VC, T, D, s, T, G, vsum); break;
      case 3: packed_values16<3>(rec + a.VC, T, D, s, T, G, vsum); break;
      case 4: packed_values16<4>(rec + a.VC, T, D, s, T, G, vsum); break;
      default: packed_values16<8>(rec + a.VC, T, D, s, T, G, vsum); break;
    }
    prefetch(i + 1, 3);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 cg = _mm512_set1_ps(c[g]);
      float* ag = accp + g * LV; const float* sg = vsum + g * LV;
      for (int64_t x = 0; x < D; x += 16)
        st16(ag + x, _mm512_fmadd_ps(ld16(vperm + x), _mm512_add_ps(ld16(sg + x), cg), ld16(ag + x)));
      for (int64_t x = D; x < LV; x += 16) st16(ag + x, _mm512_fmadd_ps(ld16(vperm + x), ld16(sg + x), ld16(ag + x)));
    }
#else
    for (int64_t part = 1; part < 4; ++part) prefetch(i + 1, part);
    positives(rec + a.KS, D, log8, a.lut, w.ks.data());
    offsets(rec + a.KO, D, log8, w.ks.data(), w.ko.data());
    positives(rec + a.KF, T, log8, a.lut, w.kf.data());
    for (int64_t x = 0; x < LK; ++x) kperm[x] = w.ks[kidx[x]];
    for (int64_t g = 0; g < G; ++g) {
      c[g] = dot8(qr + g * D, w.ko.data(), D);
      for (int64_t x = 0; x < LK; x += 8) storev(qs + g * LK + x, loadv(qp + g * LK + x) * loadv(kperm + x));
    }
    switch (KB) {
      case 2: packed_scores_all<2>(rec + a.KC, T, D, qs, LK, G, s, w.red.data()); break;
      case 3: packed_scores_all<3>(rec + a.KC, T, D, qs, LK, G, s, w.red.data()); break;
      case 4: packed_scores_all<4>(rec + a.KC, T, D, qs, LK, G, s, w.red.data()); break;
      default: packed_scores_all<8>(rec + a.KC, T, D, qs, LK, G, s, w.red.data()); break;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < T; t += 8) storev(s + g * T + t, loadv(w.kf.data() + t) * (loadv(s + g * T + t) + c[g]));
    if (i == 0 && sink_n > 0 && a.SINK_TOKENS > 0)  // attended from the exact copies instead
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < std::min(sink_n, T); ++t) s[g * T + t] = -INFINITY;
    if (!softmax_step(s, G, T, T, LV, m, l, accp)) continue;
    positives(rec + a.VS, T, log8, a.lut, w.vs.data());
    offsets(rec + a.VO, T, log8, w.vs.data(), w.vo.data());
    positives(rec + a.VF, D, log8, a.lut, w.vf.data());
    for (int64_t x = 0; x < LV; ++x) vperm[x] = w.vf[vidx[x]];
    for (int64_t g = 0; g < G; ++g) {
      v8f cg = splat(0.f);
      for (int64_t t = 0; t < T; t += 8) {
        const v8f p = loadv(s + g * T + t);
        cg += p * loadv(w.vo.data() + t);
        storev(s + g * T + t, p * loadv(w.vs.data() + t));
      }
      c[g] = hadd8(cg);
    }
    packed_value_sums_any(VB, rec + a.VC, T, D, s, T, G, vsum);
    // acc_g += vf * (sum_t p_t vs_t codes_t + sum_t p_t vo_t): the offset term once per channel (plane 0)
    for (int64_t g = 0; g < G; ++g) {
      const v8f cg = splat(c[g]);
      float* ag = accp + g * LV; const float* sg = vsum + g * LV;
      for (int64_t x = 0; x < D; x += 8) storev(ag + x, loadv(ag + x) + loadv(vperm + x) * (loadv(sg + x) + cg));
      for (int64_t x = D; x < LV; x += 8) storev(ag + x, loadv(ag + x) + loadv(vperm + x) * loadv(sg + x));
    }
#endif
  }
#if defined(KVARN_AMX)
  if (amx) _tile_release();
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t x = 0; x < LV; ++x) acc[g * D + vidx[x]] += accp[g * LV + x];
}

// exact rows (unrotated query q [G, D]): n rows of a [rows, D] slab at element stride st, ROWS at a time,
// through the same score / softmax / value-sum code as packed tiles
void rows_task(const Args& a, const char* k, const char* v, int64_t st, int64_t n, const float* q, float* m,
               float* l, float* acc, Scratch& w) {
  const int64_t G = a.G, D = a.D, es = a.DTYPE == 0 ? 4 : 2;
  float* s = w.s.data(); float* rows = w.rows.data(); float* qs = w.qs.data(); float* tmp = w.tmp.data();
  std::fill(w.qs.begin(), w.qs.end(), 0.f);
  std::copy(q, q + G * D, qs);
  for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
#if defined(__AVX512F__)
    const int64_t nb = std::min(ROWS, n - r0), n16 = (nb + 15) / 16 * 16;
    for (int64_t r = 0; r < n16; ++r) {
      if (r < nb) load_row(k + (r0 + r) * st * es, a.DTYPE, D, rows + r * D);
      else std::fill(rows + r * D, rows + (r + 1) * D, 0.f);
    }
    head_groups(G, [&](auto ng, int64_t g0) {
      row_scores16<decltype(ng)::value>(rows, qs, n16, D, g0, s, ROWS, w.red16.data());
    });
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = nb; r < n16; ++r) s[g * ROWS + r] = -INFINITY;
    if (!softmax16(s, G, n16, ROWS, D, m, l, acc)) continue;
    for (int64_t r = 0; r < nb; ++r) load_row(v + (r0 + r) * st * es, a.DTYPE, D, rows + r * D);
    row_values16(rows, s, nb, D, G, ROWS, tmp);
    for (int64_t x = 0; x < G * D; x += 16) st16(acc + x, _mm512_add_ps(ld16(acc + x), ld16(tmp + x)));
#else
    const int64_t nb = std::min(ROWS, n - r0), n8 = (nb + 7) / 8 * 8;
    for (int64_t r = 0; r < n8; ++r) {
      if (r < nb) load_row(k + (r0 + r) * st * es, a.DTYPE, D, rows + r * D);
      else std::fill(rows + r * D, rows + (r + 1) * D, 0.f);
    }
    key_scores_all(rows, qs, n8, D, G, s, ROWS, w.red.data());
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = nb; r < n8; ++r) s[g * ROWS + r] = -INFINITY;
    if (!softmax_step(s, G, n8, ROWS, D, m, l, acc)) continue;
    for (int64_t r = 0; r < nb; ++r) load_row(v + (r0 + r) * st * es, a.DTYPE, D, rows + r * D);
    std::fill(tmp, tmp + G * D, 0.f);
    value_sums(rows, s, nb, D, G, ROWS, tmp);
    for (int64_t x = 0; x < G * D; x += 8) storev(acc + x, loadv(acc + x) + loadv(tmp + x));
#endif
  }
}

int64_t sink_rows(const Args& a, int64_t b) {
  if (a.SINK_CAP == 0) return 0;
  int64_t cap = a.SINK_TOKENS > 0 ? std::min(a.SINK_CAP, a.SINK_TOKENS) : a.SINK_CAP;
  int64_t n = std::min<int64_t>(std::max<int64_t>(a.sink_lens[b], 0), cap);
  return (a.SINK_TOKENS > 0 && a.num_tiles[b] <= 0) ? 0 : n;
}

// see kvarn::decode_attention
int check_indices(const Args& a) {
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t n = a.num_tiles[b];
    if (n < 0 || n > a.BT_WIDTH) return 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t blk = a.block_table[b * a.bt_sb + i];
      if (blk < 0 || blk >= a.NUM_BLOCKS) return 2;
    }
    if (a.tail_lens[b] < 0 || a.tail_lens[b] > a.T) return 3;
    if (a.tail_slot && (a.tail_slot[b] < 0 || a.tail_slot[b] >= a.TAIL_SLOTS)) return 4;
    if (a.sink_slot && (a.sink_slot[b] < 0 || a.sink_slot[b] >= a.SINK_SLOTS)) return 5;
  }
  return 0;
}

}  // namespace

int kvarn::decode_attention(const Args& a) {
  if (const int bad = check_indices(a)) return bad;
  // Sequence b's tiles are cut into parts of SPLIT_TILES tiles whatever the batch and the thread
  // count, and the parts are merged in order: a row's result depends only on its own context.
  const int64_t B = a.B, H = a.H, G = a.G, D = a.D, W = D + 2;
  const int64_t S = std::max<int64_t>(1, (a.BT_WIDTH + a.SPLIT_TILES - 1) / a.SPLIT_TILES), P = S + 1;
  std::vector<float> part((size_t)(B * H * P * G * W));  // per (b, h, part, g): m, l, acc[D]
#if defined(KVARN_AMX)
  const bool amx = amx_usable();
#else
  const bool amx = false;
#endif
  std::vector<Scratch> scratch((size_t)std::max<int64_t>(1, a.NTHREADS));
  for (Scratch& w : scratch) w.fit(G, a.T, D, a.KB, a.VB);
  #pragma omp parallel for schedule(dynamic, 1) num_threads((int)a.NTHREADS)
  for (int64_t task = 0; task < B * H * P; ++task) {
    Scratch& w = scratch[(size_t)thread_index()];
    const int64_t b = task / (H * P), h = (task / P) % H, split = task % P;
    float* base = part.data() + task * G * W;
    std::vector<float>& m = w.m; std::vector<float>& l = w.l; std::vector<float>& acc = w.acc;
    std::vector<float>& q = w.q; std::vector<float>& qr = w.qr;
    std::fill(m.begin(), m.end(), -INFINITY); std::fill(l.begin(), l.end(), 0.f); std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        q[g * D + d] = load(a.q, b * a.q_sb + (h * G + g) * a.q_sh + d, a.DTYPE) * (float)a.scale;
    const int64_t sink_n = sink_rows(a, b);
    if (split == S) {  // the exact rows: sink, then tail
      if (sink_n > 0) {
        const int64_t slot = a.sink_slot ? a.sink_slot[b] : b, off = slot * a.sink_ss + h * a.sink_sh;
        const int64_t es = a.DTYPE == 0 ? 4 : 2;
        rows_task(a, static_cast<const char*>(a.sink_k) + off * es, static_cast<const char*>(a.sink_v) + off * es,
                  a.sink_st, sink_n, q.data(), m.data(), l.data(), acc.data(), w);
      }
      const int64_t slot = a.tail_slot ? a.tail_slot[b] : b, off = slot * a.tail_ss + h * a.tail_sh;
      const int64_t es = a.DTYPE == 0 ? 4 : 2;
      rows_task(a, static_cast<const char*>(a.tail_k) + off * es, static_cast<const char*>(a.tail_v) + off * es,
                a.tail_st, a.tail_lens[b], q.data(), m.data(), l.data(), acc.data(), w);
    } else {
      const int64_t n = a.num_tiles[b], t0 = split * a.SPLIT_TILES, t1 = std::min(n, t0 + a.SPLIT_TILES);
      if (t0 < t1) {
        if (a.rot) {
          for (int64_t g = 0; g < G; ++g) vec_mat(q.data() + g * D, a.rot, D, qr.data() + g * D);
        } else {
          qr = q;
        }
        tiles_task(a, b, h, t0, t1, sink_n, qr.data(), m.data(), l.data(), acc.data(), w, amx);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      base[g * W] = m[g]; base[g * W + 1] = l[g];
      std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, base + g * W + 2);
    }
  }
  #pragma omp parallel for schedule(static) num_threads((int)a.NTHREADS)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    std::vector<float> rot_acc(D), plain(D), unrot(D);
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t p = 0; p < P; ++p) mx = std::max(mx, part[((bh * P + p) * G + g) * W]);
      float denom = 0.f;
      std::fill(rot_acc.begin(), rot_acc.end(), 0.f);
      for (int64_t p = 0; p < P; ++p) {
        const float* src = part.data() + ((bh * P + p) * G + g) * W;
        if (src[0] == -INFINITY) continue;
        const float wgt = std::exp(src[0] - mx);
        denom += wgt * src[1];
        float* dst = p == S ? plain.data() : rot_acc.data();
        if (p == S) for (int64_t d = 0; d < D; ++d) dst[d] = wgt * src[2 + d];
        else for (int64_t d = 0; d < D; ++d) dst[d] += wgt * src[2 + d];
      }
      if (part[((bh * P + S) * G + g) * W] == -INFINITY) std::fill(plain.begin(), plain.end(), 0.f);
      // a NaN in the query row makes every score NaN, which the running max skips: give NaN, as softmax
      // does, unless the sequence has no token to attend (zeros)
      bool nan_query = false;
      if (a.num_tiles[b] > 0 || a.tail_lens[b] > 0 || sink_rows(a, b) > 0)
        for (int64_t d = 0; d < D; ++d) nan_query |= std::isnan(load(a.q, b * a.q_sb + (h * G + g) * a.q_sh + d, a.DTYPE));
      const float inv = nan_query ? NAN : denom > 0.f ? 1.f / denom : 0.f;
      if (a.rot) vec_mat(rot_acc.data(), a.rot_t, D, unrot.data());  // acc @ R^T
      else unrot = rot_acc;
      for (int64_t e = 0; e < D; ++e)
        store(a.out, b * a.out_sb + (h * G + g) * a.out_sh + e, (unrot[e] + plain[e]) * inv, a.DTYPE);
    }
  }
  return 0;
}
