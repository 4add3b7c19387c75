// Python bindings of the CPU kernels: tensors in, kernel arguments filled from their pointers,
// shapes and strides. The caller (kvarn/kernels/cpu/native.py) has checked shapes, dtypes and
// devices; the checks here guard the memory the kernels read and raise RuntimeError.
#include <torch/extension.h>

#include <optional>

#include "kernels.h"

namespace {

using Opt = std::optional<at::Tensor>;

int64_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "kvarn: unsupported dtype ", t.scalar_type());
  }
}

const int32_t* index_ptr(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.numel() == n, "kvarn: ", name,
              " must be a contiguous int32 tensor of ", n, " entries");
  return t.data_ptr<int32_t>();
}

// Decode attention of query [B, Hq, D] into out [B, Hq, D] (query's dtype, unit last stride).
// record: T, KB, VB, LOG8, SINK_TOKENS, then the byte offsets KC, VC, KS, KO, KF, VS, VO, VF.
// Returns kvarn::decode_attention's code (0, or which index is out of range).
int64_t decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
               const at::Tensor& num_tiles, const at::Tensor& tail_k, const at::Tensor& tail_v,
               const at::Tensor& tail_lens, const Opt& tail_slot, const Opt& sink_k, const Opt& sink_v,
               const Opt& sink_lens, const Opt& sink_slot, const Opt& rot, const Opt& rot_t, const at::Tensor& lut,
               const std::vector<int64_t>& record, double scale, int64_t split_tiles, int64_t threads,
               at::Tensor& out) {
  TORCH_CHECK(record.size() == 13, "kvarn: record holds 13 fields");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "kvarn: out must match query");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && cache.stride(2) == 1, "kvarn: unit last strides");
  TORCH_CHECK(tail_k.strides() == tail_v.strides() && tail_k.scalar_type() == q.scalar_type() &&
                  tail_v.scalar_type() == q.scalar_type() && tail_k.stride(3) == 1,
              "kvarn: tail_k and tail_v must share strides and the query's dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "kvarn: block_table");
  kvarn::DecodeArgs a{};
  const int64_t B = q.size(0), H = cache.size(1);
  a.B = B; a.H = H; a.G = q.size(1) / H; a.D = q.size(2);
  a.T = record[0]; a.KB = record[1]; a.VB = record[2]; a.LOG8 = record[3]; a.SINK_TOKENS = record[4];
  a.KC = record[5]; a.VC = record[6]; a.KS = record[7]; a.KO = record[8]; a.KF = record[9];
  a.VS = record[10]; a.VO = record[11]; a.VF = record[12];
  a.SPLIT_TILES = split_tiles; a.NTHREADS = threads; a.DTYPE = dtype_code(q);
  a.NUM_BLOCKS = cache.size(0); a.BT_WIDTH = block_table.size(1); a.TAIL_SLOTS = tail_k.size(0);
  a.cache = cache.data_ptr<uint8_t>(); a.cache_sb = cache.stride(0); a.cache_sh = cache.stride(1);
  a.block_table = block_table.data_ptr<int32_t>(); a.bt_sb = block_table.stride(0);
  a.num_tiles = index_ptr(num_tiles, B, "num_tiles");
  a.q = q.data_ptr(); a.q_sb = q.stride(0); a.q_sh = q.stride(1);
  a.tail_k = tail_k.data_ptr(); a.tail_v = tail_v.data_ptr();
  a.tail_ss = tail_k.stride(0); a.tail_sh = tail_k.stride(1); a.tail_st = tail_k.stride(2);
  a.tail_lens = index_ptr(tail_lens, B, "tail_lens");
  a.tail_slot = tail_slot ? index_ptr(*tail_slot, B, "tail_slot") : nullptr;
  if (sink_k && sink_v && sink_lens) {
    TORCH_CHECK(sink_k->strides() == sink_v->strides() && sink_k->scalar_type() == q.scalar_type() &&
                    sink_v->scalar_type() == q.scalar_type() && sink_k->stride(3) == 1,
                "kvarn: sink_k and sink_v must share strides and the query's dtype");
    a.SINK_CAP = sink_k->size(2); a.SINK_SLOTS = sink_k->size(0);
    a.sink_k = sink_k->data_ptr(); a.sink_v = sink_v->data_ptr();
    a.sink_ss = sink_k->stride(0); a.sink_sh = sink_k->stride(1); a.sink_st = sink_k->stride(2);
    a.sink_lens = index_ptr(*sink_lens, B, "sink_lens");
    a.sink_slot = sink_slot ? index_ptr(*sink_slot, B, "sink_slot") : nullptr;
  }
  if (rot && rot_t) {
    a.rot = rot->data_ptr<float>();
    a.rot_t = rot_t->data_ptr<float>();
  }
  a.lut = lut.data_ptr<float>();
  a.scale = scale;
  a.out = out.data_ptr(); a.out_sb = out.stride(0); a.out_sh = out.stride(1);
  return kvarn::decode_attention(a);
}

// Store: keys and values are the unrotated tiles [N, H, T, D] (f32, f16 or bf16, one dtype, D
// contiguous, any other strides), block_ids [N] int64, signs [D] float32 or empty; record: KB, VB,
// LOG8, ITERS, then the byte offsets KC, VC, KS, KO, KF, VS, VO, VF; rotate: 0 none, 1 Hadamard.
void store(const at::Tensor& keys, const at::Tensor& values, at::Tensor& cache, const at::Tensor& block_ids,
           const at::Tensor& lut, const std::vector<int64_t>& record, int64_t rotate, const at::Tensor& signs,
           int64_t threads) {
  TORCH_CHECK(record.size() == 12, "kvarn: record holds 12 fields");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && values.scalar_type() == keys.scalar_type() &&
                  keys.stride(3) == 1 && values.stride(3) == 1,
              "kvarn: keys and values must be [N, H, T, D] of one dtype with D contiguous");
  TORCH_CHECK(keys.size(2) <= 256 && keys.size(3) <= 256, "kvarn: tiles of at most 256 x 256");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(), "kvarn: block_ids");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.stride(2) == 1, "kvarn: cache");
  TORCH_CHECK(keys.size(0) == block_ids.numel() && keys.size(1) == cache.size(1), "kvarn: keys hold N x H tiles");
  TORCH_CHECK(signs.numel() == 0 || (signs.scalar_type() == at::kFloat && signs.is_contiguous() &&
                                     signs.numel() == keys.size(3)), "kvarn: signs");
  kvarn::StoreArgs a{};
  a.N = keys.size(0); a.H = keys.size(1); a.T = keys.size(2); a.D = keys.size(3);
  a.KB = record[0]; a.VB = record[1]; a.LOG8 = record[2]; a.ITERS = record[3];
  a.KC = record[4]; a.VC = record[5]; a.KS = record[6]; a.KO = record[7]; a.KF = record[8];
  a.VS = record[9]; a.VO = record[10]; a.VF = record[11];
  a.NTHREADS = threads; a.DTYPE = dtype_code(keys);
  a.keys = keys.data_ptr(); a.values = values.data_ptr();
  a.k_sn = keys.stride(0); a.k_sh = keys.stride(1); a.k_st = keys.stride(2);
  a.v_sn = values.stride(0); a.v_sh = values.stride(1); a.v_st = values.stride(2);
  a.ROTATE = rotate; a.signs = signs.numel() ? signs.data_ptr<float>() : nullptr;
  a.cache = cache.data_ptr<uint8_t>(); a.cache_sb = cache.stride(0); a.cache_sh = cache.stride(1);
  a.block_ids = block_ids.data_ptr<int64_t>();
  a.lut = lut.data_ptr<float>();
  kvarn::store_tiles(a);
}

// Dequantize: the records cache[block_ids[u], h] into out_k, out_v [H, U, T, D] (one dtype, channels
// contiguous); record as for store (its ITERS unused); rotate and signs as for store.
void dequant(const at::Tensor& cache, const at::Tensor& block_ids, const at::Tensor& lut,
             const std::vector<int64_t>& record, int64_t rotate, const at::Tensor& signs, at::Tensor& out_k,
             at::Tensor& out_v, int64_t threads) {
  TORCH_CHECK(record.size() == 12, "kvarn: record holds 12 fields");
  TORCH_CHECK(out_k.dim() == 4 && out_v.sizes() == out_k.sizes() && out_v.strides() == out_k.strides() &&
                  out_v.scalar_type() == out_k.scalar_type() && out_k.stride(3) == 1,
              "kvarn: out_k and out_v must be [H, U, T, D] of one dtype and layout, channels contiguous");
  TORCH_CHECK(out_k.size(2) <= 256 && out_k.size(3) <= 256 && out_k.size(2) % 8 == 0, "kvarn: tile shape");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous() && block_ids.numel() == out_k.size(1),
              "kvarn: block_ids");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.stride(2) == 1 && cache.size(1) == out_k.size(0), "kvarn: cache");
  TORCH_CHECK(signs.numel() == 0 || (signs.scalar_type() == at::kFloat && signs.is_contiguous() &&
                                     signs.numel() == out_k.size(3)), "kvarn: signs");
  kvarn::DequantArgs a{};
  a.H = out_k.size(0); a.U = out_k.size(1); a.T = out_k.size(2); a.D = out_k.size(3);
  a.KB = record[0]; a.VB = record[1]; a.LOG8 = record[2];
  a.KC = record[4]; a.VC = record[5]; a.KS = record[6]; a.KO = record[7]; a.KF = record[8];
  a.VS = record[9]; a.VO = record[10]; a.VF = record[11];
  a.NTHREADS = threads; a.DTYPE = dtype_code(out_k);
  a.cache = cache.data_ptr<uint8_t>(); a.cache_sb = cache.stride(0); a.cache_sh = cache.stride(1);
  a.block_ids = block_ids.data_ptr<int64_t>();
  a.ROTATE = rotate; a.signs = signs.numel() ? signs.data_ptr<float>() : nullptr;
  a.lut = lut.data_ptr<float>();
  a.out_k = out_k.data_ptr(); a.out_v = out_v.data_ptr();
  a.out_sh = out_k.stride(0); a.out_su = out_k.stride(1); a.out_st = out_k.stride(2);
  kvarn::dequantize_blocks(a);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "kvarn CPU decode attention");
  m.def("store", &store, "kvarn CPU tile store");
  m.def("dequant", &dequant, "kvarn CPU dequantize of paged blocks");
}
