// Native CPU dequantize: records of paged blocks -> unrotated keys and values in the query's dtype,
// for prefill attention over cached tiles (the contract: kvarn/kernels/cpu/dequant.py).
//
// Token-major: each row (one token, D channels) is unpacked straight into channel order, scaled,
// un-rotated with an in-register Walsh-Hadamard transform and written to the output in its dtype,
// so nothing is transposed or stored element by element. The butterflies run in the same order
// (distance 1, 2, 4, ...) on the same numbers as a channel-by-channel transform: the results do not
// depend on the vector width. 16-lane vectors with AVX-512, 8 lanes otherwise.
#include <memory>

#include "kernels.h"
#include "vec.h"

using DequantArgs = kvarn::DequantArgs;

namespace {

constexpr int64_t kMaxSide = 256;  // largest group size and head dim

#if defined(__AVX512F__)
constexpr int NL = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr vu kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
constexpr int NL = 8;
typedef v8f vf;
typedef v8i vi;
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));
constexpr vu kIota = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

inline vf ld(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf bcast(float x) { return vf{} + x; }

// lanes c*NL .. c*NL+NL-1 of a row of one W-bit plane (channel k at bits k*W.., low bits first)
template <int W>
inline vu chunk(const uint8_t* row, int64_t c) {
  if constexpr (W == 8) {
#if defined(__AVX512F__)
    return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * NL)));
#else
    return (vu)widen8(row + c * NL);  // GCC's generic 16-lane widening goes byte by byte
#endif
  } else {
    constexpr int BYTES = NL * W / 8;  // 1, 2, 4 or (16 lanes of 4 bits) 8
    constexpr uint32_t MASK = (1u << W) - 1;
    const uint8_t* p = row + c * BYTES;
    const vu shift = (kIota * W) & 31;
    vu w;
    if constexpr (BYTES == 8) {
#if defined(__AVX512F__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      w = (vu)_mm512_permutexvar_epi32(pick, _mm512_zextsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
      const uint32_t lo = p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24;
      const uint32_t hi = p[4] | p[5] << 8 | p[6] << 16 | (uint32_t)p[7] << 24;
      w = kIota < NL / 2 ? vu{} + lo : vu{} + hi;
#endif
    } else {
      uint32_t word = 0;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      std::memcpy(&word, p, BYTES);
#else
      for (int i = 0; i < BYTES; ++i) word |= (uint32_t)p[i] << (8 * i);
#endif
      w = vu{} + word;
    }
    return (w >> shift) & MASK;
  }
}

// code row t of a [T, D] section of `bits` bits as floats (3 bits: a 2-bit and a 1-bit plane)
template <int64_t D>
inline void code_row(int64_t bits, const uint8_t* sec, int64_t T, int64_t t, vf* x) {
  constexpr int64_t C = D / NL;
  switch (bits) {
    case 2:
      #pragma GCC unroll 32
      for (int64_t c = 0; c < C; ++c)
        x[c] = __builtin_convertvector((vi)chunk<2>(sec + t * (D / 4), c), vf);
      break;
    case 3:
      #pragma GCC unroll 32
      for (int64_t c = 0; c < C; ++c)
        x[c] = __builtin_convertvector((vi)(chunk<2>(sec + t * (D / 4), c) | chunk<1>(sec + T * (D / 4) + t * (D / 8), c) << 2), vf);
      break;
    case 4:
      #pragma GCC unroll 32
      for (int64_t c = 0; c < C; ++c)
        x[c] = __builtin_convertvector((vi)chunk<4>(sec + t * (D / 2), c), vf);
      break;
    default:
      #pragma GCC unroll 32
      for (int64_t c = 0; c < C; ++c)
        x[c] = __builtin_convertvector((vi)chunk<8>(sec + t * D, c), vf);
      break;
  }
}

// x[j] <- x[j] + x[j ^ H] where bit H of j is 0, x[j ^ H] - x[j] where it is 1 (H < NL)
template <int H>
inline vf butterfly(vf x) {
  const vi sel = (vi)(kIota ^ H);
  const vf sgn = __builtin_convertvector(1 + 2 * ((kIota & H) != 0), vf);  // 1, or -1 where bit H is set
  return x * sgn + __builtin_shuffle(x, sel);  // x * +-1 is exact: one rounding, as x + y or y - x
}

// the NL elements of x at out + i in `DTYPE`: 0 f32, 1 f16, 2 bf16 (round to nearest even, as store())
template <int DTYPE>
inline void put(void* out, int64_t i, vf x) {
  if constexpr (DTYPE == 0) {
    st(static_cast<float*>(out) + i, x);
  } else if constexpr (DTYPE == 1) {
    uint16_t* o = static_cast<uint16_t*>(out) + i;
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int k = 0; k < NL; ++k) o[k] = float_to_half(x[k]);
#endif
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    // one instruction, rounding to nearest even, NaN -> quiet NaN as store(); it flushes subnormal
    // inputs to zero, so a vector holding one (fpclass 0x20) takes the integer path below
    if (!_mm512_fpclass_ps_mask((__m512)x, 0x20)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), (__m256i)_mm512_cvtneps_pbh((__m512)x));
      return;
    }
#endif
    const vu u = (vu)x;
    const vu rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    const vu r = (u & 0x7fffffff) > 0x7f800000 ? (u >> 16) | 0x40 : rounded;
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), _mm512_cvtepi32_epi16((__m512i)r));
#else
    const vh h = __builtin_convertvector(r, vh);
    std::memcpy(static_cast<uint16_t*>(out) + i, &h, sizeof h);
#endif
  }
}

struct Workspace {
  alignas(64) float scale[kMaxSide], offset[kMaxSide], factor[kMaxSide], post[kMaxSide];

  // one side of the record at rec into out (element strides out_st along tokens, 1 along channels)
  template <int64_t D, int DTYPE, bool keys, bool rotate>
  void side(const uint8_t* rec, const DequantArgs& a, void* out) {
    constexpr int64_t C = D / NL;
    const int64_t T = a.T, bits = keys ? a.KB : a.VB;
    const bool log8 = a.LOG8 != 0;
    const int64_t SN = keys ? D : T, FN = keys ? T : D;  // scales and offsets per column of the grid
    const uint8_t* sec = rec + (keys ? a.KC : a.VC);
    positives(rec + (keys ? a.KS : a.VS), SN, log8, a.lut, scale);
    offsets(rec + (keys ? a.KO : a.VO), SN, log8, scale, offset);
    positives(rec + (keys ? a.KF : a.VF), FN, log8, a.lut, factor);
    if constexpr (rotate) {  // x @ R^T = (x @ H) / sqrt(D) * signs
      const float norm = 1.f / std::sqrt((float)D);
      for (int64_t d = 0; d < D; ++d) post[d] = a.signs ? a.signs[d] * norm : norm;
    }
    for (int64_t t = 0; t < T; ++t) {
      vf x[C];
      code_row<D>(bits, sec, T, t, x);
      // rotated values: keys (code * scale[d] + offset[d]) * factor[t]; values (code * scale[t] +
      // offset[t]) * factor[d]
      if constexpr (keys) {
        const vf f = bcast(factor[t]);
        #pragma GCC unroll 32
        for (int64_t c = 0; c < C; ++c)
          x[c] = (x[c] * ld(scale + c * NL) + ld(offset + c * NL)) * f;
      } else {
        const vf s = bcast(scale[t]), o = bcast(offset[t]);
        #pragma GCC unroll 32
        for (int64_t c = 0; c < C; ++c)
          x[c] = (x[c] * s + o) * ld(factor + c * NL);
      }
      if constexpr (rotate) {
        #pragma GCC unroll 32
        for (int64_t c = 0; c < C; ++c) {
          x[c] = butterfly<1>(x[c]);
          x[c] = butterfly<2>(x[c]);
          x[c] = butterfly<4>(x[c]);
          if constexpr (NL == 16) x[c] = butterfly<8>(x[c]);
        }
        #pragma GCC unroll 8
        for (int64_t h = 1; h < C; h *= 2)
          #pragma GCC unroll 32
          for (int64_t j = 0; j < C; ++j)
            if (!(j & h)) {
              const vf u = x[j], v = x[j + h];
              x[j] = u + v; x[j + h] = u - v;
            }
        #pragma GCC unroll 32
        for (int64_t c = 0; c < C; ++c) x[c] *= ld(post + c * NL);
      }
      #pragma GCC unroll 32
      for (int64_t c = 0; c < C; ++c) put<DTYPE>(out, t * a.out_st + c * NL, x[c]);
    }
  }

  template <int64_t D, int DTYPE>
  void side_d(const uint8_t* rec, bool keys, const DequantArgs& a, void* out) {
    if (keys) a.ROTATE ? side<D, DTYPE, true, true>(rec, a, out) : side<D, DTYPE, true, false>(rec, a, out);
    else a.ROTATE ? side<D, DTYPE, false, true>(rec, a, out) : side<D, DTYPE, false, false>(rec, a, out);
  }

  template <int64_t D>
  void side_d(const uint8_t* rec, bool keys, const DequantArgs& a, void* out) {
    switch (a.DTYPE) {
      case 0: side_d<D, 0>(rec, keys, a, out); break;
      case 1: side_d<D, 1>(rec, keys, a, out); break;
      default: side_d<D, 2>(rec, keys, a, out); break;
    }
  }

  void run(const uint8_t* rec, bool keys, const DequantArgs& a, void* out) {
    switch (a.D) {  // the codec's head dims (kvarn.schemes.scheme.ALLOWED_HEAD_DIMS)
      case 64: side_d<64>(rec, keys, a, out); break;
      case 128: side_d<128>(rec, keys, a, out); break;
      default: side_d<256>(rec, keys, a, out); break;
    }
  }
};

}  // namespace

void kvarn::dequantize_blocks(const DequantArgs& a) {
  const int64_t U = a.U, H = a.H;
  const int64_t esize = a.DTYPE == 0 ? 4 : 2;
  #pragma omp parallel for schedule(dynamic, 1) num_threads((int)a.NTHREADS)
  for (int64_t task = 0; task < U * H * 2; ++task) {
    const int64_t tile = task / 2, u = tile / H, h = tile % H;
    const bool keys = task % 2 == 0;
    thread_local std::unique_ptr<Workspace> ws(new Workspace());
    const uint8_t* rec = a.cache + a.block_ids[u] * a.cache_sb + h * a.cache_sh;
    const int64_t off = (h * a.out_sh + u * a.out_su) * esize;
    ws->run(rec, keys, a, static_cast<uint8_t*>(keys ? a.out_k : a.out_v) + off);
  }
}
