// Native CPU decode attention. One task per (sequence, KV head, split of SPLIT_TILES of its tiles)
// streams its tiles record by record: key scores straight from the packed codes for all G query
// heads of the KV head at once (score = kf * ((q_r * ks) . codes + q_r . ko)), an online softmax
// per tile, then value sums straight from the packed value codes, each code widened once for all G
// heads (acc_r += vf * ((p * vs) @ codes + p . vo)); one more task per (sequence, KV head) attends the
// exact rows (sink, tail) with the unrotated query. A second parallel loop merges the partial
// softmax states in a fixed order, un-rotates the tile part and writes the output in the query's dtype.
#include "kernels.h"
#include "attend.h"
#ifdef _OPENMP
#include <omp.h>
#endif

using Args = kvarn::DecodeArgs;

namespace {

int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

struct Scratch {
  std::vector<float> rows, qs, qp, c, s, tmp, ks, ko, kf, vs, vo, vf, kperm, vperm, accp;
  std::vector<v8f> red;
  std::vector<int32_t> kidx, vidx;
  void fit(int64_t G, int64_t T, int64_t D) {
    const int64_t L = 2 * D;  // at most two planes
    rows.resize(std::max<int64_t>(ROWS * L, D)); qs.resize(G * L); qp.resize(G * L); c.resize(G); s.resize(G * T);
    tmp.resize(G * L); ks.resize(D); ko.resize(D); kf.resize(T); vs.resize(T); vo.resize(T);
    vf.resize(D); kperm.resize(L); vperm.resize(L); accp.resize(G * L);
    red.resize(4 * 8); kidx.resize(L); vidx.resize(L);
  }
};

// Tiles t0..t1-1 of sequence b, KV head h, for the rotated query qr [G, D]. The query, the channel
// parameters and the accumulator live in the codes' plane order (vec.h), so that nothing is permuted
// per query head and tile; the accumulator returns to channel order (planes summed) once at the end.
void tiles_task(const Args& a, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t sink_n, const float* qr,
                float* m, float* l, float* acc, Scratch& w) {
  const int64_t G = a.G, D = a.D, T = a.T;
  const int64_t KB = a.KB, VB = a.VB, LK = num_planes(KB) * D, LV = num_planes(VB) * D;
  const bool log8 = a.LOG8 != 0;
  float* qs = w.qs.data(); float* qp = w.qp.data(); float* c = w.c.data(); float* s = w.s.data();
  float* vsum = w.tmp.data(); float* accp = w.accp.data(); float* kperm = w.kperm.data(); float* vperm = w.vperm.data();
  const int32_t* kidx = w.kidx.data(); const int32_t* vidx = w.vidx.data();
  plane_channels_any(KB, D, w.kidx.data());
  plane_channels_any(VB, D, w.vidx.data());
  for (int64_t g = 0; g < G; ++g)
    for (int64_t x = 0; x < LK; ++x) qp[g * LK + x] = qr[g * D + kidx[x]];
  std::fill(accp, accp + G * LV, 0.f);
  auto record = [&](int64_t i) { return a.cache + a.block_table[b * a.bt_sb + i] * a.cache_sb + h * a.cache_sh; };
  // records are scattered: the first line of each section is fetched ahead, the hardware prefetcher
  // follows the rest of the section
  auto prefetch = [&](const uint8_t* r) {
    for (int64_t off : {a.KC, a.KS, a.KO, a.KF, a.VC, a.VS, a.VO, a.VF}) __builtin_prefetch(r + off);
  };
  if (t0 < t1) prefetch(record(t0));
  for (int64_t i = t0; i < t1; ++i) {
    const uint8_t* rec = record(i);
    if (i + 1 < t1) prefetch(record(i + 1));  // while this one is computed
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
  }
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
  std::vector<Scratch> scratch((size_t)std::max<int64_t>(1, a.NTHREADS));
  for (Scratch& w : scratch) w.fit(G, a.T, D);
  #pragma omp parallel for schedule(dynamic, 1) num_threads((int)a.NTHREADS)
  for (int64_t task = 0; task < B * H * P; ++task) {
    Scratch& w = scratch[(size_t)thread_index()];
    const int64_t b = task / (H * P), h = (task / P) % H, split = task % P;
    float* base = part.data() + task * G * W;
    std::vector<float> m(G, -INFINITY), l(G, 0.f), acc(G * D, 0.f), q(G * D), qr(G * D);
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
        tiles_task(a, b, h, t0, t1, sink_n, qr.data(), m.data(), l.data(), acc.data(), w);
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
