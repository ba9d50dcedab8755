// FP32Softmax tiling: how [rows, cols] (softmax over cols) is cut into cores and tiles.
//
// Shared, unchanged, by op_host (Ascend tiling function), op_kernel (Ascend C
// kernel) and cpu/ (the CPU kernel walks the same schedule), and tested on CPU.
//
// Cores: rows are dealt out as evenly as possible: the first `big_cores` cores
//   take `base_rows + 1` rows, the others `base_rows`.
// Mode kWholeRows: a padded row (cols rounded up to one 32-byte block of the
//   input dtype) fits in UB, so a tile is `rows_per_tile` whole rows; the last
//   tile of a core holds the remaining rows. On the NPU one call of Ascend C's
//   SoftMax high-level API normalises all rows of a tile at once (row max, exp,
//   row sum, division as vector instructions over many rows, no scalar sync per
//   row); its temporary buffer is sized here (SoftmaxTmpBytes) so the API never
//   has to split the tile.
// Mode kColumnTiles: one row does not fit in UB; each row is read twice over
//   column tiles of `col_tile` elements (a multiple of the block), the last one
//   `col_tail` elements long: pass 1 keeps each tile's max m_c and sum of
//   exp(x - m_c), combined as S = sum_c s_c * exp(m_c - M) with M = max_c m_c;
//   pass 2 writes exp(x - M) / S. The per-tile (m_c, s_c) arrays live in UB
//   (ColumnStatsBytes).
// Cores: whole rows only. A row is never split over cores (that would need a
//   cross-core reduction: GM workspace, SyncAll and batch scheduling); the model's
//   softmaxes have at least B * heads rows (attention) or tokens (router), so fewer
//   rows than cores happens only for single-sequence decode of small models.
#ifndef MSDS_FP32_SOFTMAX_TILING_LOGIC_H
#define MSDS_FP32_SOFTMAX_TILING_LOGIC_H

#include "msds_kernel_common.h"

namespace msds {
namespace softmax {

constexpr int64_t kWholeRows = 0;
constexpr int64_t kColumnTiles = 1;
constexpr int64_t kBufferNum = 2;  // double buffering of every queue

struct SoftmaxTiling {
  int64_t rows;          // product of all dims but the last
  int64_t cols;          // softmax axis length
  int64_t in_bytes;      // element size of the input streams (2: f16/bf16, 4: f32)
  int64_t num_inputs;    // 1 for the forward (x), 2 for the backward (y, dy)
  int64_t align;         // elements of the input dtype per 32-byte block
  int64_t cols_aligned;  // cols rounded up to `align`: the UB row pitch
  int64_t used_cores;
  int64_t base_rows;     // rows per core ...
  int64_t big_cores;     // ... plus one for the first big_cores cores
  int64_t mode;          // kWholeRows or kColumnTiles
  int64_t rows_per_tile; // kWholeRows: rows per UB tile
  int64_t col_tile;      // kColumnTiles: columns per UB tile (multiple of align)
  int64_t col_tiles;     // kColumnTiles: number of column tiles per row
  int64_t col_tail;      // kColumnTiles: columns in the last tile (1..col_tile)
};

// Whether the kernel needs its float32 work buffer: for the cast of 16-bit input, and in
// kColumnTiles mode (each column tile is loaded into it, and the per-tile statistics are
// combined there). Whole rows of float32 input go from the input queue straight into the
// SoftMax API, so that path allocates none.
MSDS_INLINE bool UsesWorkBuffer(int64_t in_bytes, int64_t mode) { return mode == kColumnTiles || in_bytes != 4; }

// UB bytes needed per (row, column) element of a tile in `mode`: the double-buffered
// input queue(s), the double-buffered float32 output queue, one float32 scratch buffer
// for the reductions (the SoftMax API's temporary space in kWholeRows) and, when
// UsesWorkBuffer, the float32 work buffer.
MSDS_INLINE int64_t BytesPerElement(int64_t in_bytes, int64_t num_inputs, int64_t mode) {
  return kBufferNum * in_bytes * num_inputs + kBufferNum * 4 + 4 + (UsesWorkBuffer(in_bytes, mode) ? 4 : 0);
}

// kWholeRows, UB bytes per row besides its elements: the row's max and sum (one
// 32-byte block each, as the SoftMax API writes them) and the extra temporary space
// the API asks per row. asc-devkit v9.0.0 impl/adv_api/tiling/activation/softmax_tiling.cpp,
// GetSoftMaxMaxTmpSize: srcM * (8 + srcK + 64) float32 for float input on Atlas A2/A3,
// i.e. 72 floats per row beyond the scratch element per column.
constexpr int64_t kSoftmaxRowTmpFloats = 8 + 64;
MSDS_INLINE int64_t BytesPerRowExtra() { return 2 * kBlockBytes + kSoftmaxRowTmpFloats * 4; }

// kWholeRows: the SoftMax API's temporary buffer for a tile of `rows` rows (>= its
// GetSoftMaxMaxTmpSize for [rows, cols_aligned] float32, so it runs on all rows at once).
MSDS_INLINE int64_t SoftmaxTmpBytes(int64_t rows, int64_t cols_aligned) {
  return rows * (cols_aligned + kSoftmaxRowTmpFloats) * 4;
}

// kColumnTiles: UB bytes of the per-tile statistics of one row (max and sum arrays of
// col_tiles float32 each, block aligned) plus one block for a reduction's result.
MSDS_INLINE int64_t ColumnStatsBytes(int64_t col_tiles) { return 2 * AlignUp(col_tiles, 8) * 4 + kBlockBytes; }

MSDS_INLINE int ComputeTiling(int64_t rows, int64_t cols, int64_t in_bytes, int64_t num_inputs,
                              int64_t core_num, int64_t ub_bytes, SoftmaxTiling* t) {
  if (rows < 0 || cols < 0) return kErrBadShape;
  if ((in_bytes != 2 && in_bytes != 4) || num_inputs < 1 || core_num < 1) return kErrBadConfig;
  t->rows = rows;
  t->cols = cols;
  t->in_bytes = in_bytes;
  t->num_inputs = num_inputs;
  t->align = kBlockBytes / in_bytes;
  t->cols_aligned = AlignUp(cols, t->align);
  t->mode = kWholeRows;
  t->rows_per_tile = 0;
  t->col_tile = 0;
  t->col_tiles = 0;
  t->col_tail = 0;
  if (rows == 0 || cols == 0) {
    t->used_cores = 0;
    t->base_rows = 0;
    t->big_cores = 0;
    return kOk;
  }
  t->used_cores = Min64(core_num, rows);
  t->base_rows = rows / t->used_cores;
  t->big_cores = rows % t->used_cores;
  int64_t max_core_rows = t->base_rows + (t->big_cores > 0 ? 1 : 0);

  int64_t budget = ub_bytes - kUbReserveBytes;
  int64_t per_row = t->cols_aligned * BytesPerElement(in_bytes, num_inputs, kWholeRows) + BytesPerRowExtra();
  int64_t fit_rows = budget > 0 ? budget / per_row : 0;
  if (fit_rows >= 1) {
    t->rows_per_tile = Min64(fit_rows, max_core_rows);
    return kOk;
  }
  t->mode = kColumnTiles;
  int64_t per_elem = BytesPerElement(in_bytes, num_inputs, kColumnTiles);
  // The statistics grow with the number of tiles, which shrinks as tiles grow: settle both.
  int64_t stats = ColumnStatsBytes(1);
  for (int i = 0; i < 8; ++i) {
    t->col_tile = AlignDown(budget > stats ? (budget - stats) / per_elem : 0, t->align);
    if (t->col_tile < t->align) return kErrUbTooSmall;
    t->col_tiles = CeilDiv(cols, t->col_tile);
    if (ColumnStatsBytes(t->col_tiles) <= stats) break;
    stats = ColumnStatsBytes(t->col_tiles);
  }
  // The combine step reduces the col_tiles statistics in the work buffer (col_tile floats).
  if (ColumnStatsBytes(t->col_tiles) > stats || t->col_tiles > t->col_tile) return kErrUbTooSmall;
  t->col_tail = cols - (t->col_tiles - 1) * t->col_tile;
  return kOk;
}

// Rows [*start, *start + *count) belong to core `core`.
MSDS_INLINE void CoreRows(const SoftmaxTiling& t, int64_t core, int64_t* start, int64_t* count) {
  if (core >= t.used_cores) {
    *start = t.rows;
    *count = 0;
    return;
  }
  *count = t.base_rows + (core < t.big_cores ? 1 : 0);
  *start = core * t.base_rows + Min64(core, t.big_cores);
}

// kWholeRows: number of row tiles for a core holding `core_rows` rows, and the
// rows in tile `tile` (the last tile takes the remainder).
MSDS_INLINE int64_t RowTiles(const SoftmaxTiling& t, int64_t core_rows) {
  return t.rows_per_tile > 0 ? CeilDiv(core_rows, t.rows_per_tile) : 0;
}
MSDS_INLINE int64_t RowTileRows(const SoftmaxTiling& t, int64_t core_rows, int64_t tile) {
  return Min64(t.rows_per_tile, core_rows - tile * t.rows_per_tile);
}

// kColumnTiles: columns in column tile `tile`.
MSDS_INLINE int64_t ColTileCols(const SoftmaxTiling& t, int64_t tile) {
  return tile + 1 == t.col_tiles ? t.col_tail : t.col_tile;
}

}  // namespace softmax
}  // namespace msds

#endif  // MSDS_FP32_SOFTMAX_TILING_LOGIC_H
