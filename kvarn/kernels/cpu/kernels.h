// The two CPU kernels and their arguments, filled from tensors by bind.cpp.
#pragma once

#include <cstdint>

namespace kvarn {

// Decode attention of one query token per sequence over its paged context (layout: kvarn/kernels/api.py).
struct DecodeArgs {
  int64_t B, H, G, D, T, KB, VB, LOG8, SPLIT_TILES, NTHREADS;  // SPLIT_TILES: tiles per task
  int64_t KC, VC, KS, KO, KF, VS, VO, VF;   // byte offsets of the record's sections
  int64_t DTYPE;                            // of query, rows and output: 0 f32, 1 f16, 2 bf16
  int64_t SINK_TOKENS;                      // > 0: sink rows replace tile 0's first positions
  int64_t SINK_CAP;                         // rows per sink slot (0: no sink)
  int64_t NUM_BLOCKS, BT_WIDTH, TAIL_SLOTS, SINK_SLOTS;  // bounds of the indices, checked before any read
  const uint8_t* cache; int64_t cache_sb, cache_sh;             // byte strides
  const int32_t* block_table; int64_t bt_sb;
  const int32_t* num_tiles;
  const void* q; int64_t q_sb, q_sh;                            // element strides
  const void* tail_k; const void* tail_v; int64_t tail_ss, tail_sh, tail_st;
  const int32_t* tail_slot; const int32_t* tail_lens;           // tail_slot may be null (slot b)
  const void* sink_k; const void* sink_v; int64_t sink_ss, sink_sh, sink_st;
  const int32_t* sink_slot; const int32_t* sink_lens;
  const float* rot; const float* rot_t;                         // R and R^T [D, D] contiguous, or null
  const float* lut;                                             // [256] log8 values
  double scale;
  void* out; int64_t out_sb, out_sh;
};

// Rotate and quantize full tiles into their records, as kvarn.codec.quantize_tiles.
struct StoreArgs {
  int64_t N, H, T, D, KB, VB, LOG8, ITERS, NTHREADS;
  int64_t KC, VC, KS, KO, KF, VS, VO, VF;   // byte offsets of the record's sections
  int64_t DTYPE;                            // of keys and values: 0 f32, 1 f16, 2 bf16
  const void* keys; const void* values;     // unrotated tiles [N, H, T, D], D contiguous
  int64_t k_sn, k_sh, k_st, v_sn, v_sh, v_st;  // element strides
  int64_t ROTATE;                           // 0: none; 1: Hadamard (times signs, when not null)
  const float* signs;                       // [D] or null
  uint8_t* cache; int64_t cache_sb, cache_sh;  // byte strides of [num_blocks, H, >= tile_bytes]
  const int64_t* block_ids;                 // [N]
  const float* lut;                         // [256] log8 values
};

// Dequantize the records of U blocks into unrotated keys and values, as kvarn.codec.dequantize_tiles.
struct DequantArgs {
  int64_t U, H, T, D, KB, VB, LOG8, NTHREADS;
  int64_t KC, VC, KS, KO, KF, VS, VO, VF;   // byte offsets of the record's sections
  const uint8_t* cache; int64_t cache_sb, cache_sh;  // byte strides of [num_blocks, H, >= tile_bytes]
  const int64_t* block_ids;                 // [U], checked by the caller
  int64_t ROTATE; const float* signs;       // as in StoreArgs
  const float* lut;                         // [256] log8 values
  int64_t DTYPE;                            // of the outputs: 0 f32, 1 f16, 2 bf16
  void* out_k; void* out_v;                 // [H, U, T, D] ...
  int64_t out_sh, out_su, out_st;           // ... element strides (channels contiguous)
};

// decode_attention returns 0, or which index is out of range (checked before any read): 1 num_tiles, 2 a block id,
// 3 tail_lens, 4 tail_slot, 5 sink_slot.
int decode_attention(const DecodeArgs& a);
void store_tiles(const StoreArgs& a);
void dequantize_blocks(const DequantArgs& a);

}  // namespace kvarn
