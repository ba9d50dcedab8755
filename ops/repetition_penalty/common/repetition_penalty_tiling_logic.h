// RepetitionPenalty tiling: how the [B, V] logits copy and the id updates are cut.
//
// Shared by op_host, op_kernel and the CPU kernel (which walks the same schedule and runs
// the same per-id steps, the functions at the end of this file).
//
// Each core owns a contiguous range of the flattened logits [B * V] (a multiple of 8
// floats = 32 bytes, the last core takes the tail). The range is cut at row boundaries
// into segments (one row each) and every segment into UB tiles of at most `tile` floats,
// so a tile never spans two rows. For every tile the kernel copies the logits into UB,
// overwrites the elements named by the row's ids with the penalised value read from that
// UB copy, and copies the tile out. A per-tile bit mask ("done") makes every element
// change at most once, so duplicated ids apply the penalty once and the order of the ids
// does not matter; the original value is read from UB before its only change (nothing is
// read from GM by the scalar unit). Ids outside [0, V) are skipped (IdInVocab). Each
// element is written by exactly one core: no cross-core synchronisation is needed.
//
// Ids: when the row's L ids fit in one UB load (L <= id_tile, `fast`), a segment loads them
// once and compacts them in place into its "hits" (offsets inside the segment of the ids
// that fall in it); each tile then walks the remaining hits, applies those inside it and
// keeps the later ones (tiles go in increasing order), so the full id list is scanned once
// per segment, not once per tile. Longer id lists are streamed `id_tile` ids at a time for
// every tile of the row (the general path).
#ifndef MSDS_REPETITION_PENALTY_TILING_LOGIC_H
#define MSDS_REPETITION_PENALTY_TILING_LOGIC_H

#include "msds_kernel_common.h"

namespace msds {
namespace repetition_penalty {

constexpr int64_t kAlign = kBlockBytes / 4;  // float32 / int32 elements per block
constexpr int64_t kMaskBits = 32;            // tile elements per word of the "done" mask

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

// int32 words of the "done" mask of a tile of `tile` floats (block aligned).
MSDS_INLINE int64_t MaskWords(int64_t tile) { return AlignUp(CeilDiv(tile, kMaskBits), kAlign); }

// UB bytes: one copy of the tile (float32), its mask, one id load (int32).
MSDS_INLINE int64_t UbBytes(int64_t tile, int64_t id_tile) { return tile * 4 + MaskWords(tile) * 4 + id_tile * 4; }

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
  // Up to a quarter of UB for the ids, the rest for the tile and its mask.
  int64_t id_fit = AlignDown(budget > 0 ? budget / 4 / 4 : 0, kAlign);
  t->id_tile = Min64(id_fit, AlignUp(Max64(length, 1), kAlign));
  // 4 bytes per float plus a mask bit, rounded: 33 bytes per 8 floats, one block of slack.
  int64_t rest = budget - t->id_tile * 4 - kBlockBytes;
  int64_t tile_fit = AlignDown(rest > 0 ? rest * 8 / 33 : 0, kAlign);
  while (tile_fit >= kAlign && UbBytes(tile_fit, t->id_tile) > budget) tile_fit -= kAlign;
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

// The segment of a core's range [pos, end) that starts at `pos`: row *row, elements
// [pos, *seg_end). One division per segment (not per element).
MSDS_INLINE void Segment(const PenaltyTiling& t, int64_t pos, int64_t end, int64_t* row, int64_t* seg_end) {
  *row = pos / t.vocab;
  *seg_end = Min64(end, (*row + 1) * t.vocab);
}

// Tiles of a segment of `len` floats, and the length of tile `i`.
MSDS_INLINE int64_t SegmentTiles(const PenaltyTiling& t, int64_t len) { return CeilDiv(len, t.tile); }
MSDS_INLINE int64_t TileLen(const PenaltyTiling& t, int64_t len, int64_t i) { return Min64(t.tile, len - i * t.tile); }

// Whether a row's ids fit in one UB load (the hits path).
MSDS_INLINE bool IdsFitOnce(const PenaltyTiling& t) { return t.length <= t.id_tile; }

MSDS_INLINE int64_t IdTiles(const PenaltyTiling& t) { return CeilDiv(t.length, t.id_tile); }

MSDS_INLINE int64_t IdTileLen(const PenaltyTiling& t, int64_t tile) { return Min64(t.id_tile, t.length - tile * t.id_tile); }

// Ids outside [0, V) are ignored by every kernel: b * V + id would otherwise land on a
// neighbouring row's logit (or outside the tensor). The ids are read on the device, so this
// is checked there, per id, like ExpertLookup's ids outside [0, E).
MSDS_INLINE bool IdInVocab(const PenaltyTiling& t, int64_t id) { return id >= 0 && id < t.vocab; }

// HuggingFace RepetitionPenaltyLogitsProcessor: negative logits are multiplied,
// the others divided (float32 arithmetic, as torch does on float32 logits).
MSDS_INLINE float Penalise(float logit, float penalty) { return logit < 0.0f ? logit * penalty : logit / penalty; }

// ---- the per-id steps, shared by the Ascend C kernel (LocalTensor) and the CPU kernel ----
// `Ints` / `Floats` are anything with GetValue(i) / SetValue(i, v): UB LocalTensors on the
// NPU (scalar reads and writes), plain arrays on CPU.

// Compacts the first `n` ids of row `row` (loaded in `ids`) in place into offsets inside the
// segment [seg_start, seg_end) of the ids that fall in it; returns how many.
template <typename Ints>
MSDS_INLINE int64_t CompactHits(const PenaltyTiling& t, Ints& ids, int64_t n, int64_t row, int64_t seg_start,
                                int64_t seg_end) {
  int64_t hits = 0;
  int64_t lo = seg_start - row * t.vocab;  // the segment as ids of this row
  int64_t hi = seg_end - row * t.vocab;
  for (int64_t j = 0; j < n; ++j) {
    int64_t id = ids.GetValue(j);
    if (id >= lo && id < hi) {  // implies IdInVocab: [lo, hi) lies in [0, V)
      ids.SetValue(hits, static_cast<int32_t>(id - lo));
      ++hits;
    }
  }
  return hits;
}

// Penalises element `off` of the tile unless the mask says it was done; marks it done.
template <typename Ints, typename Floats>
MSDS_INLINE void PenaliseOnce(Floats& tile, Ints& mask, int64_t off, float penalty) {
  int64_t w = off >> 5;  // off / kMaskBits, off >= 0
  int32_t bit = static_cast<int32_t>(1u << static_cast<uint32_t>(off & (kMaskBits - 1)));
  int32_t word = mask.GetValue(w);
  if ((word & bit) != 0) return;
  mask.SetValue(w, word | bit);
  tile.SetValue(off, Penalise(tile.GetValue(off), penalty));
}

// Hits path, one tile covering segment offsets [t_lo, t_lo + n): applies the hits inside it and
// keeps (compacted in place) the ones after it; returns how many are kept.
template <typename Ints, typename Floats>
MSDS_INLINE int64_t ApplyHits(Ints& hits, int64_t count, int64_t t_lo, int64_t n, Floats& tile, Ints& mask,
                              float penalty) {
  int64_t kept = 0;
  for (int64_t j = 0; j < count; ++j) {
    int64_t off = hits.GetValue(j) - t_lo;  // >= 0: earlier tiles consumed the smaller offsets
    if (off < n) {
      PenaliseOnce(tile, mask, off, penalty);
    } else {
      hits.SetValue(kept, static_cast<int32_t>(off + t_lo));
      ++kept;
    }
  }
  return kept;
}

// General path: the `m` ids of one UB load of row `row` against the tile of row elements
// [t0, t0 + n) (flat indices).
template <typename Ints, typename Floats>
MSDS_INLINE void ApplyIds(const PenaltyTiling& t, Ints& ids, int64_t m, int64_t row, int64_t t0, int64_t n,
                          Floats& tile, Ints& mask, float penalty) {
  int64_t lo = t0 - row * t.vocab;
  for (int64_t j = 0; j < m; ++j) {
    int64_t off = static_cast<int64_t>(ids.GetValue(j)) - lo;
    if (off >= 0 && off < n) PenaliseOnce(tile, mask, off, penalty);  // in the tile implies IdInVocab
  }
}

}  // namespace repetition_penalty
}  // namespace msds

#endif  // MSDS_REPETITION_PENALTY_TILING_LOGIC_H
