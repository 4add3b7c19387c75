// Native CPU store: quantize rotated tiles into records, following kvarn.codec.tiles._encode_side
// step for step (the contract and the tolerance: kvarn/kernels/cpu/store.py).
#include "kernels.h"
#include "vec.h"

#if defined(__clang__)
#pragma clang fp contract(off) exceptions(ignore)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")  // no FMA; selects vectorize
#endif

using StoreArgs = kvarn::StoreArgs;

namespace {

constexpr float kFp16Max = 65504.f;
constexpr float kMinMagnitude = 6.103515625e-05f;  // 2**-14
constexpr float kStdFloor = 1e-3f;
constexpr float kTiny = 1e-30f;
constexpr float kLog8Min = 1.0399892289569834e-06f;  // 2 ** ((1 - 160) / 8), as float32

// <cmath>/<algorithm> were declared before the pragma above and GCC does not inline a function into
// one compiled with other options: the hot loops use these (and builtins) instead of std::
inline float fmin_(float a, float b) { return a < b ? a : b; }
inline float fmax_(float a, float b) { return a > b ? a : b; }
inline float floor_(float x) { return __builtin_floorf(x); }

inline float exp_rn(float x) { return (float)std::exp((double)x); }
inline float log_rn(float x) { return (float)std::log((double)x); }

inline uint16_t half_bits(float x) {  // round to nearest even, x finite
  return float_to_half(x);
}

// a non-negative float32 -> (stored raw value, the float32 it decodes to)
inline void store_positive(float x, bool log8, bool round_up, const float* lut, uint32_t* raw, float* val) {
  if (!log8) {
    uint16_t h = half_bits(std::min(std::max(x, 0.f), kFp16Max));
    float hv = half_to_float(h);
    if (round_up && hv < x && hv < kFp16Max) { ++h; hv = half_to_float(h); }
    *raw = h; *val = hv;
    return;
  }
  float e = (float)std::log2((double)std::max(x, kLog8Min)) * 8.f;
  e = round_up ? std::ceil(e - 1e-4f) : std::floor(e + 0.5f);
  float c = std::min(std::max(e + 160.f, 1.f), 255.f);
  uint32_t code = x > 0.f ? (uint32_t)c : 0u;
  *raw = code; *val = lut[code];
}

struct Side {  // one side of one tile, with its workspace
  int64_t T, D, bits;
  bool per_channel, log8;
  const float* lut;
  std::vector<float> x, xt, y, log_r, log_c, er, ec, stdv, f, s, q, o, best_f, best_s, best_q;
  std::vector<double> acc, acc2;
  std::vector<uint32_t> f_raw, s_raw, q_raw;
  std::vector<uint8_t> codes;

  void fit() {
    const int64_t L = std::max(T, D);
    x.resize(T * D); xt.resize(T * D); y.resize(T * D); codes.resize(T * D);
    for (auto* v : {&log_r, &log_c, &er, &ec, &stdv, &f, &s, &q, &o, &best_f, &best_s, &best_q}) v->resize(L);
    acc.resize(L); acc2.resize(L); f_raw.resize(L); s_raw.resize(L); q_raw.resize(L);
  }

  // population std of y along rows of src [R, C] (y[r, c] = src[r, c] * (er[r] * ec[c])), per column, into
  // stdv[C]: one pass of double sums of y and y^2 (a float32 y squared is exact in double, so the only
  // rounding left is the sums', far below the float32 result's)
  void col_std(const float* src, int64_t R, int64_t C, const float* rf, const float* cf) {
    double* a = acc.data(); double* a2 = acc2.data();
    std::fill(a, a + C, 0.0); std::fill(a2, a2 + C, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const float e = rf[r]; const float* xs = src + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const double v = (double)(xs[c] * (e * cf[c]));
        a[c] += v; a2[c] += v * v;
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      const double m = a[c] / (double)R, var = a2[c] / (double)R - m * m;
      stdv[c] = (float)std::sqrt(var > 0.0 ? var : 0.0);
    }
  }

  // float32 mean in torch's CPU order for a contiguous row (n a multiple of 32: tiles and head dims
  // are): four 8-lane accumulators, added one after the other, then the lanes in order; matched
  // torch.mean bit for bit on 400 random rows of 64 and 128 (a double mean differs in two thirds)
  static float torch_mean(const float* v, int64_t n) {
    float acc[4][8] = {};
    for (int64_t i = 0; i < n; i += 32)
      for (int k = 0; k < 4; ++k)
        for (int j = 0; j < 8; ++j) acc[k][j] = acc[k][j] + v[i + k * 8 + j];
    float s = 0.f;
    for (int j = 0; j < 8; ++j) s = s + (((acc[0][j] + acc[1][j]) + acc[2][j]) + acc[3][j]);
    return s / (float)n;
  }

  // log += log(std + 1e-3 * mean(std) + 1e-30), then centred (geometric mean 1)
  void log_step(float* lg, int64_t n) {
    const float floor_ = kStdFloor * torch_mean(stdv.data(), n) + kTiny;
    for (int64_t i = 0; i < n; ++i) lg[i] = lg[i] + log_rn(stdv[i] + floor_);
    const float mean = torch_mean(lg, n);
    for (int64_t i = 0; i < n; ++i) lg[i] = lg[i] - mean;
  }

  void sinkhorn_step() {
    for (int64_t t = 0; t < T; ++t) er[t] = exp_rn(-log_r[t]);
    for (int64_t d = 0; d < D; ++d) ec[d] = exp_rn(-log_c[d]);
    col_std(x.data(), T, D, er.data(), ec.data());  // per channel, over tokens
    log_step(log_c.data(), D);
    for (int64_t d = 0; d < D; ++d) ec[d] = exp_rn(-log_c[d]);
    col_std(xt.data(), D, T, ec.data(), er.data());  // per token, over channels
    log_step(log_r.data(), T);
  }

  // the quantization grid: rows of src [R, C] are scaled by 1/f[r]; scales/zero points per column
  // (keys: src = x, rows = tokens; values: src = x^T, rows = channels)
  const float* grid_src() const { return per_channel ? x.data() : xt.data(); }
  int64_t grid_rows() const { return per_channel ? T : D; }
  int64_t grid_cols() const { return per_channel ? D : T; }

  void params(float qmax) {
    const int64_t R = grid_rows(), C = grid_cols();
    const float* src = grid_src(); float* yy = y.data();
    float* lo = s.data(); float* hi = q.data();  // reused: range first, then scale / zero point
    std::fill(lo, lo + C, INFINITY); std::fill(hi, hi + C, -INFINITY);
    for (int64_t r = 0; r < R; ++r) {
      const float fr = f[r]; const float* xs = src + r * C; float* yr = yy + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const float v = xs[c] / fr; yr[c] = v;
        lo[c] = v < lo[c] ? v : lo[c]; hi[c] = v > hi[c] ? v : hi[c];
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      const float l = lo[c], h = hi[c];
      if (log8) {
        const float need = std::max((h - l) / qmax, std::fabs(l) / 127.f);
        float sc; store_positive(need, true, true, lut, &s_raw[c], &sc);
        const float safe = sc > 0.f ? sc : 1.f;
        float z = std::min(std::max(std::floor(l / safe + 0.5f), -128.f), 127.f);
        z = sc > 0.f ? z : 0.f;
        s[c] = sc; q[c] = z; o[c] = z * sc; q_raw[c] = (uint32_t)(int32_t)z & 0xff;
      } else {
        uint16_t lb = half_bits(std::min(std::max(l, -kFp16Max), kFp16Max));
        if (half_to_float(lb) > l) {  // one fp16 step towards -inf
          if ((lb & 0x7fff) == 0) lb = 0x8001;
          else if (lb & 0x8000) ++lb;
          else --lb;
        }
        const float off = half_to_float(lb);
        float sc; store_positive((h - off) / qmax, false, true, lut, &s_raw[c], &sc);
        s[c] = sc; q[c] = off; o[c] = off; q_raw[c] = lb;
      }
    }
  }

  // code of v = x / f in column c (branch-free, so the loops over columns vectorize)
  static inline float code_fp16(float v, float sc, float lo, float qmax) {
    const float safe = sc > 0.f ? sc : 1.f;
    const float k = floor_((v - lo) / safe + 0.5f);
    return fmin_(fmax_(sc > 0.f ? k : 0.f, 0.f), qmax);
  }
  static inline float code_log8(float v, float sc, float z, float qmax) {
    const float safe = sc > 0.f ? sc : 1.f;
    const float k = floor_(v / safe + 0.5f) - z;
    return fmin_(fmax_(sc > 0.f ? k : 0.f, 0.f), qmax);
  }
  inline float code(float v, int64_t c, float qmax) const {
    return log8 ? code_log8(v, s[c], q[c], qmax) : code_fp16(v, s[c], q[c], qmax);
  }

  template <bool LOG8>
  double sq_err_impl(float qmax) {  // of the grid in y (x / f) against x
    const int64_t R = grid_rows(), C = grid_cols();
    const float* src = grid_src(); const float* yy = y.data();
    const float* sp = s.data(); const float* qp = q.data(); const float* op = o.data();
    double* a = acc.data();
    std::fill(a, a + C, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const float fr = f[r]; const float* xs = src + r * C; const float* yr = yy + r * C;
      for (int64_t c = 0; c < C; ++c) {
        const float k = LOG8 ? code_log8(yr[c], sp[c], qp[c], qmax) : code_fp16(yr[c], sp[c], qp[c], qmax);
        const float diff = (k * sp[c] + op[c]) * fr - xs[c];
        a[c] += (double)(diff * diff);
      }
    }
    double e = 0.0;
    for (int64_t c = 0; c < C; ++c) e += a[c];
    return e;
  }
  double sq_err(float qmax) { return log8 ? sq_err_impl<true>(qmax) : sq_err_impl<false>(qmax); }

  // encode x [T, D] (already in this->x) into the record at rec
  void encode(uint8_t* rec, int64_t code_off, int64_t scale_off, int64_t offset_off, int64_t factor_off) {
    const float qmax = (float)((1 << bits) - 1);
    float amax = 0.f;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) { const float v = x[t * D + d]; xt[d * T + t] = v; amax = fmax_(amax, __builtin_fabsf(v)); }
    const float base = std::sqrt(std::max(amax, kMinMagnitude));
    std::fill(log_r.begin(), log_r.end(), 0.f); std::fill(log_c.begin(), log_c.end(), 0.f);
    const int64_t FN = per_channel ? T : D, SN = per_channel ? D : T, PB = log8 ? 1 : 2;
    double best = INFINITY;
    for (int64_t it = 0; it <= iters; ++it) {
      if (it > 0) sinkhorn_step();
      const float* lf = per_channel ? log_r.data() : log_c.data();
      for (int64_t i = 0; i < FN; ++i) {
        float fv; store_positive(exp_rn(lf[i]) * base, log8, false, lut, &f_raw[i], &fv);
        f[i] = std::max(fv, 1e-30f);
      }
      params(qmax);
      const double err = sq_err(qmax);
      if (it == 0 || err < best) {
        best = err;
        for (int64_t i = 0; i < SN; ++i) { put(rec + scale_off, i, s_raw[i], PB); put(rec + offset_off, i, q_raw[i], PB); }
        for (int64_t i = 0; i < FN; ++i) put(rec + factor_off, i, f_raw[i], PB);
        std::copy(f.begin(), f.begin() + FN, best_f.begin());
        std::copy(s.begin(), s.begin() + SN, best_s.begin());
        std::copy(q.begin(), q.begin() + SN, best_q.begin());
      }
    }
    // codes of the best iterate, in [T, D] order
    std::copy(best_f.begin(), best_f.begin() + FN, f.begin());
    std::copy(best_s.begin(), best_s.begin() + SN, s.begin());
    std::copy(best_q.begin(), best_q.begin() + SN, q.begin());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        const float v = x[t * D + d];
        codes[t * D + d] = per_channel ? (uint8_t)code(v / f[t], d, qmax) : (uint8_t)code(v / f[d], t, qmax);
      }
    pack(rec + code_off);
  }

  static void put(uint8_t* dst, int64_t i, uint32_t raw, int64_t pb) {
    if (pb == 2) { dst[2 * i] = (uint8_t)(raw & 0xff); dst[2 * i + 1] = (uint8_t)(raw >> 8); }
    else dst[i] = (uint8_t)raw;
  }

  void pack(uint8_t* out) const {  // planes (8 -> [8], 4 -> [4], 3 -> [2, 1], 2 -> [2]) packed along D
    const int widths3[2] = {2, 1}, one[1] = {(int)bits};
    const int* ws = bits == 3 ? widths3 : one;
    const int n = bits == 3 ? 2 : 1;
    int shift = 0;
    for (int k = 0; k < n; ++k) {
      const int w = ws[k], per = 8 / w, mask = (1 << w) - 1;
      const int64_t nb = D / per;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < nb; ++i) {
          uint32_t byte = 0;
          for (int j = 0; j < per; ++j) byte |= (uint32_t)((codes[t * D + i * per + j] >> shift) & mask) << (j * w);
          out[t * nb + i] = (uint8_t)byte;
        }
      out += T * nb;
      shift += w;
    }
  }

  int64_t iters = 0;
};

}  // namespace

void kvarn::store_tiles(const StoreArgs& a) {
  const int64_t N = a.N, H = a.H, T = a.T, D = a.D;
  #pragma omp parallel for schedule(dynamic, 1) num_threads((int)a.NTHREADS)
  for (int64_t task = 0; task < N * H * 2; ++task) {
    const int64_t tile = task / 2;
    const bool keys = task % 2 == 0;
    thread_local Side w;
    w.T = T; w.D = D; w.bits = keys ? a.KB : a.VB; w.per_channel = keys; w.log8 = a.LOG8 != 0;
    w.lut = a.lut; w.iters = a.ITERS;
    w.fit();
    const float* src = (keys ? a.keys : a.values) + tile * T * D;
    std::copy(src, src + T * D, w.x.begin());
    uint8_t* rec = a.cache + a.block_ids[tile / H] * a.cache_sb + (tile % H) * a.cache_sh;
    if (keys) w.encode(rec, a.KC, a.KS, a.KO, a.KF);
    else w.encode(rec, a.VC, a.VS, a.VO, a.VF);
  }
}
