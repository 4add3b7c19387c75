// Native CPU dequantize: records of paged blocks -> unrotated keys and values in the query's dtype,
// for prefill attention over cached tiles (the contract: kvarn/kernels/cpu/dequant.py).
#include <memory>

#include "kernels.h"
#include "vec.h"

using DequantArgs = kvarn::DequantArgs;

namespace {

constexpr int64_t kMaxSide = 256;  // largest group size and head dim

struct Workspace {
  alignas(64) float xt[kMaxSide * kMaxSide];   // [D, T], rotated then unrotated
  alignas(64) float rows[ROWS * 2 * kMaxSide];  // unpacked codes of ROWS rows, plane order
  alignas(64) float scale[kMaxSide], offset[kMaxSide], factor[kMaxSide];
  int32_t idx[2 * kMaxSide];                    // channel of each plane-order position

  // xt[d, t] = code[t, d] of the [T, D] code section sec (planes summed)
  void codes(int64_t bits, const uint8_t* sec, int64_t T, int64_t D) {
    const int64_t L = num_planes(bits) * D;
    plane_channels_any(bits, D, idx);
    std::fill(xt, xt + T * D, 0.f);
    for (int64_t r0 = 0; r0 < T; r0 += ROWS) {
      const int64_t R = std::min(ROWS, T - r0);
      unpack_rows_any(bits, sec, T, D, r0, R, rows);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t p = 0; p < L; ++p) xt[idx[p] * T + r0 + r] += rows[r * L + p];
    }
  }

  // one side of the record at rec into out (element strides out_st along tokens, 1 along channels)
  void side(const uint8_t* rec, bool keys, const DequantArgs& a, void* out) {
    const int64_t T = a.T, D = a.D;
    const bool log8 = a.LOG8 != 0;
    const int64_t SN = keys ? D : T, FN = keys ? T : D;  // scales and offsets per column of the grid
    codes(keys ? a.KB : a.VB, rec + (keys ? a.KC : a.VC), T, D);
    positives(rec + (keys ? a.KS : a.VS), SN, log8, a.lut, scale);
    offsets(rec + (keys ? a.KO : a.VO), SN, log8, scale, offset);
    positives(rec + (keys ? a.KF : a.VF), FN, log8, a.lut, factor);
    // rotated values: keys (code * scale[d] + offset[d]) * factor[t]; values (code * scale[t] +
    // offset[t]) * factor[d]; rows of xt are channels, so both vectorize along tokens
    for (int64_t d = 0; d < D; ++d) {
      float* row = xt + d * T;
      for (int64_t t = 0; t < T; t += 8) {
        const v8f c = loadv(row + t);
        storev(row + t, keys ? (c * splat(scale[d]) + splat(offset[d])) * loadv(factor + t)
                             : (c * loadv(scale + t) + loadv(offset + t)) * splat(factor[d]));
      }
    }
    // x @ R^T = (x @ H) / sqrt(D) * signs: butterflies over pairs of xt's rows
    if (a.ROTATE) {
      for (int64_t h = 1; h < D; h *= 2)
        for (int64_t i = 0; i < D; i += 2 * h)
          for (int64_t j = i; j < i + h; ++j) {
            float* u = xt + j * T; float* v = xt + (j + h) * T;
            for (int64_t t = 0; t < T; t += 8) {
              const v8f x = loadv(u + t), y = loadv(v + t);
              storev(u + t, x + y); storev(v + t, x - y);
            }
          }
      const float norm = 1.f / std::sqrt((float)D);
      for (int64_t d = 0; d < D; ++d) {
        const v8f s = splat(a.signs ? a.signs[d] * norm : norm);
        for (int64_t t = 0; t < T; t += 8) storev(xt + d * T + t, loadv(xt + d * T + t) * s);
      }
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) store(out, t * a.out_st + d, xt[d * T + t], a.DTYPE);
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
    ws->side(rec, keys, a, static_cast<uint8_t*>(keys ? a.out_k : a.out_v) + off);
  }
}
