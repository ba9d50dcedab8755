// RepetitionPenalty tiling: how the [B, V] logits copy and the id updates are cut.
//
// Shared by op_host, op_kernel and the CPU kernel (which walks the same schedule).
//
// Each core owns a contiguous range of the flattened logits [B * V] (a multiple of
// 8 floats = 32 bytes, the last core takes the tail) and walks it in UB tiles of
// `tile` floats. For every tile it copies the logits into UB, then scans the ids
// of the rows the tile overlaps (in UB loads of `id_tile` ids) and, for every id
// whose element lies in the tile, overwrites it with the penalised value of the
// ORIGINAL logit (read from the input, never from the tile), so duplicated ids
// apply the penalty once and the order of the scan does not matter. Ids outside
// [0, V) are skipped (IdInVocab). Each element
// is written by exactly one core: no cross-core synchronisation is needed.
#ifndef MSDS_REPETITION_PENALTY_TILING_LOGIC_H
#define MSDS_REPETITION_PENALTY_TILING_LOGIC_H

#include "msds_kernel_common.h"

namespace msds {
namespace repetition_penalty {

constexpr int64_t kAlign = kBlockBytes / 4;  // float32 / int32 elements per block
constexpr int64_t kBufferNum = 2;

struct PenaltyTiling {
  int64_t batch;       // B
  int64_t vocab;       // V
  int64_t length;      // L ids per row
  int64_t total;       // B * V
  int64_t used_cores;
  int64_t chunk;       // floats per core (multiple of kAlign) ...
  int64_t last_chunk;  // ... except the last used core
  int64_t tile;        // floats per UB tile (multiple of kAlign)
  int64_t id_tile;     // ids per UB load (multiple of kAlign)
};

MSDS_INLINE int ComputeTiling(int64_t batch, int64_t vocab, int64_t length, int64_t core_num, int64_t ub_bytes,
                              PenaltyTiling* t) {
  if (batch < 0 || vocab < 0 || length < 0) return kErrBadShape;
  if (core_num < 1) return kErrBadConfig;
  t->batch = batch;
  t->vocab = vocab;
  t->length = length;
  t->total = batch * vocab;
  t->chunk = AlignedChunks(t->total, core_num, kAlign, &t->used_cores);
  t->last_chunk = t->used_cores > 0 ? t->total - (t->used_cores - 1) * t->chunk : 0;
  int64_t budget = ub_bytes - kUbReserveBytes;
  // A quarter of UB for double-buffered ids, the rest for the double-buffered tile.
  int64_t id_fit = AlignDown(budget > 0 ? budget / 4 / (kBufferNum * 4) : 0, kAlign);
  t->id_tile = Min64(id_fit, AlignUp(Max64(length, 1), kAlign));
  int64_t tile_fit = AlignDown(budget > 0 ? (budget - t->id_tile * kBufferNum * 4) / (kBufferNum * 4) : 0, kAlign);
  if (t->id_tile < kAlign || tile_fit < kAlign) return kErrUbTooSmall;
  t->tile = t->used_cores > 0 ? Min64(tile_fit, t->chunk) : tile_fit;
  return kOk;
}

MSDS_INLINE void CoreRange(const PenaltyTiling& t, int64_t core, int64_t* start, int64_t* count) {
  if (core >= t.used_cores) {
    *start = t.total;
    *count = 0;
    return;
  }
  *start = core * t.chunk;
  *count = core + 1 == t.used_cores ? t.last_chunk : t.chunk;
}

MSDS_INLINE int64_t Tiles(const PenaltyTiling& t, int64_t count) { return CeilDiv(count, t.tile); }

MSDS_INLINE int64_t TileLen(const PenaltyTiling& t, int64_t count, int64_t tile) {
  return Min64(t.tile, count - tile * t.tile);
}

// Rows [*first, *last] overlapped by flat elements [start, start + len), len > 0.
MSDS_INLINE void TileRows(const PenaltyTiling& t, int64_t start, int64_t len, int64_t* first, int64_t* last) {
  *first = start / t.vocab;
  *last = (start + len - 1) / t.vocab;
}

MSDS_INLINE int64_t IdTiles(const PenaltyTiling& t) { return CeilDiv(t.length, t.id_tile); }

MSDS_INLINE int64_t IdTileLen(const PenaltyTiling& t, int64_t tile) { return Min64(t.id_tile, t.length - tile * t.id_tile); }

// Ids outside [0, V) are ignored by every kernel: b * V + id would otherwise land on a
// neighbouring row's logit (or outside the tensor). The ids are read on the device, so this
// is checked there, per id, like ExpertLookup's ids outside [0, E).
MSDS_INLINE bool IdInVocab(const PenaltyTiling& t, int64_t id) { return id >= 0 && id < t.vocab; }

// HuggingFace RepetitionPenaltyLogitsProcessor: negative logits are multiplied,
// the others divided (float32 arithmetic, as torch does on float32 logits).
MSDS_INLINE float Penalise(float logit, float penalty) { return logit < 0.0f ? logit * penalty : logit / penalty; }

}  // namespace repetition_penalty
}  // namespace msds

#endif  // MSDS_REPETITION_PENALTY_TILING_LOGIC_H
