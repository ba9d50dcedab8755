// Fp32Softmax Ascend C kernel: y = softmax(float32(x)) over the last axis.
//
// A thin translation of fp32_softmax_tiling_logic.h: core `GetBlockIdx()` takes
// its rows from CoreRows(); tiling key 1 (kWholeRows) moves `rows_per_tile`
// whole rows per UB tile and normalises them with one call of Ascend C's SoftMax
// high-level API (row max, exp, row sum and division as vector instructions over
// all rows of the tile: no scalar round trip per row); key 2 (kColumnTiles) reads
// each row twice over column tiles (per-tile max and sum, combined; then the
// write). Input rows land in UB at a pitch of `cols_aligned` elements (one
// 32-byte block multiple); DataCopyPad moves the unaligned row ends and fills the
// pitch's tail with zeros. Everything after the cast runs in float32.
#include "kernel_operator.h"
#include "fp32_softmax_tiling_logic.h"
#include "msds_ascendc_sync.h"

using namespace AscendC;
namespace sm = msds::softmax;

template <typename T>
class Fp32SoftmaxKernel {
 public:
  __aicore__ inline void Init(GM_ADDR x, GM_ADDR y, const sm::SoftmaxTiling& t, const SoftMaxTiling& api) {
    t_ = t;
    api_ = api;
    sm::CoreRows(t_, GetBlockIdx(), &row0_, &rows_);
    xGm_.SetGlobalBuffer((__gm__ T*)x);
    yGm_.SetGlobalBuffer((__gm__ float*)y);
    // Elements per UB tile; the budget is sm::BytesPerElement() per element plus, per row,
    // sm::BytesPerRowExtra() (whole rows) or sm::ColumnStatsBytes() once (column tiles).
    int64_t elems = t_.mode == sm::kWholeRows ? t_.rows_per_tile * t_.cols_aligned : t_.col_tile;
    pipe_.InitBuffer(inQ_, sm::kBufferNum, elems * sizeof(T));
    pipe_.InitBuffer(outQ_, sm::kBufferNum, elems * sizeof(float));
    if (sm::UsesWorkBuffer(t_.in_bytes, t_.mode)) {  // float32 whole rows: input queue -> SoftMax directly
      pipe_.InitBuffer(work_, elems * sizeof(float));
    }
    if (t_.mode == sm::kWholeRows) {
      pipe_.InitBuffer(scratch_, sm::SoftmaxTmpBytes(t_.rows_per_tile, t_.cols_aligned));
      pipe_.InitBuffer(stat_, 2 * t_.rows_per_tile * msds::kBlockBytes);  // row max, row sum
    } else {
      pipe_.InitBuffer(scratch_, elems * sizeof(float));
      pipe_.InitBuffer(stat_, sm::ColumnStatsBytes(t_.col_tiles));
    }
    // Output rows are float32: their UB pitch (cols_aligned floats) can exceed the
    // 32-byte-rounded row length when the input is 16-bit; skip the difference.
    out_gap_blocks_ = static_cast<uint32_t>((t_.cols_aligned - msds::AlignUp(t_.cols, 8)) * 4 / msds::kBlockBytes);
  }

  __aicore__ inline void ProcessWholeRows() {
    int64_t tiles = sm::RowTiles(t_, rows_);
    for (int64_t i = 0; i < tiles; ++i) {
      int64_t r0 = row0_ + i * t_.rows_per_tile;
      int64_t n = sm::RowTileRows(t_, rows_, i);
      CopyIn(r0 * t_.cols, n, t_.cols);
      ComputeRows(n);
      CopyOut(r0 * t_.cols, n, t_.cols, out_gap_blocks_);
    }
  }

  __aicore__ inline void ProcessColumnTiles() {
    LocalTensor<float> stats = stat_.Get<float>();
    int64_t stride = msds::AlignUp(t_.col_tiles, 8);
    LocalTensor<float> tileMax = stats;
    LocalTensor<float> tileSum = stats[stride];
    LocalTensor<float> result = stats[2 * stride];
    LocalTensor<float> scratch = scratch_.Get<float>();
    int32_t tiles = static_cast<int32_t>(t_.col_tiles);
    for (int64_t r = row0_; r < row0_ + rows_; ++r) {
      int64_t base = r * t_.cols;
      // Pass 1: each tile's max m_c and s_c = sum exp(x - m_c).
      float m = -3.4028235e38f;
      for (int64_t c = 0; c < t_.col_tiles; ++c) {
        int32_t n = static_cast<int32_t>(sm::ColTileCols(t_, c));
        LocalTensor<float> w = LoadAsFloat(base + c * t_.col_tile, n);
        ReduceMax(result, w, scratch, n);
        msds::Sync<HardEvent::V_S>();
        float mc = result.GetValue(0);
        float sc = 0.0f;
        if (mc >= -3.4028235e38f) {  // a tile of -inf only (a masked stretch) adds 0, not exp(-inf + inf) = NaN
          Adds(w, w, -mc, n);
          PipeBarrier<PIPE_V>();
          Exp(w, w, n);
          PipeBarrier<PIPE_V>();
          ReduceSum(result, w, scratch, n);
          msds::Sync<HardEvent::V_S>();
          sc = result.GetValue(0);
        }
        tileMax.SetValue(c, mc);
        tileSum.SetValue(c, sc);
        m = mc > m ? mc : m;
      }
      // S = sum_c s_c * exp(m_c - M), on the vector unit (the scalar unit has no exp).
      msds::Sync<HardEvent::S_V>();
      LocalTensor<float> w = work_.Get<float>();
      Adds(w, tileMax, -m, tiles);
      PipeBarrier<PIPE_V>();
      Exp(w, w, tiles);
      PipeBarrier<PIPE_V>();
      Mul(w, w, tileSum, tiles);
      PipeBarrier<PIPE_V>();
      ReduceSum(result, w, scratch, tiles);
      msds::Sync<HardEvent::V_S>();  // also: the statistics are read before the next row writes them
      float inv = 1.0f / result.GetValue(0);
      // Pass 2: write exp(x - M) / S.
      for (int64_t c = 0; c < t_.col_tiles; ++c) {
        int32_t n = static_cast<int32_t>(sm::ColTileCols(t_, c));
        LocalTensor<float> x = LoadAsFloat(base + c * t_.col_tile, n);
        LocalTensor<float> out = outQ_.AllocTensor<float>();
        Adds(x, x, -m, n);
        PipeBarrier<PIPE_V>();
        Exp(x, x, n);
        PipeBarrier<PIPE_V>();
        Muls(out, x, inv, n);
        outQ_.EnQue(out);
        CopyOut(base + c * t_.col_tile, 1, n, 0);
      }
    }
  }

 private:
  // GM rows [offset, offset + rows * len) -> UB at a pitch of cols_aligned (kWholeRows)
  // or one column tile (kColumnTiles, rows == 1); the pitch's tail is zero.
  __aicore__ inline void CopyIn(int64_t offset, int64_t rows, int64_t len) {
    LocalTensor<T> in = inQ_.AllocTensor<T>();
    uint8_t tail = static_cast<uint8_t>(msds::AlignUp(len, t_.align) - len);
    DataCopyExtParams params{static_cast<uint16_t>(rows), static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
    DataCopyPadExtParams<T> pad{tail != 0, 0, tail, 0};
    DataCopyPad(in, xGm_[offset], params, pad);
    inQ_.EnQue(in);
  }

  __aicore__ inline void CopyOut(int64_t offset, int64_t rows, int64_t len, uint32_t src_gap_blocks) {
    LocalTensor<float> out = outQ_.DeQue<float>();
    DataCopyExtParams params{static_cast<uint16_t>(rows), static_cast<uint32_t>(len * sizeof(float)),
                             src_gap_blocks, 0, 0};
    DataCopyPad(yGm_[offset], out, params);
    outQ_.FreeTensor(out);
  }

  // Input (dequeued) -> float32 work buffer.
  __aicore__ inline void ToFloat(const LocalTensor<float>& w, const LocalTensor<T>& in, int64_t count) {
    if constexpr (IsSameType<T, float>::value) {
      DataCopy(w, in, static_cast<uint32_t>(msds::AlignUp(count, 8)));
    } else {
      Cast(w, in, RoundMode::CAST_NONE, static_cast<uint32_t>(count));
    }
    PipeBarrier<PIPE_V>();
  }

  __aicore__ inline LocalTensor<float> LoadAsFloat(int64_t offset, int64_t n) {
    CopyIn(offset, 1, n);
    LocalTensor<T> in = inQ_.DeQue<T>();
    LocalTensor<float> w = work_.Get<float>();
    ToFloat(w, in, n);
    inQ_.FreeTensor(in);
    return w;
  }

  // n whole rows: SoftMax high-level API on [n, cols_aligned] float32 (asc-devkit v9.0.0,
  // docs/api/context/SoftMax.md). srcK is the 32-byte aligned pitch, oriSrcK the row length:
  // the API's row reductions run over oriSrcK (impl/adv_api/detail/activation/softmax,
  // ReduceLastND's originalSrcK); the pitch's tail (zeros) is computed on but never copied out.
  __aicore__ inline void ComputeRows(int64_t n) {
    LocalTensor<T> in = inQ_.DeQue<T>();
    LocalTensor<float> out = outQ_.AllocTensor<float>();
    LocalTensor<float> stats = stat_.Get<float>();
    LocalTensor<float> rowMax = stats;
    LocalTensor<float> rowSum = stats[t_.rows_per_tile * 8];
    LocalTensor<uint8_t> tmp = scratch_.Get<uint8_t>();
    SoftMaxShapeInfo shape{static_cast<uint32_t>(n), static_cast<uint32_t>(t_.cols_aligned), static_cast<uint32_t>(n),
                           static_cast<uint32_t>(t_.cols)};
    if constexpr (IsSameType<T, float>::value) {
      SoftMax<float>(out, rowSum, rowMax, in, tmp, api_, shape);
    } else {
      LocalTensor<float> w = work_.Get<float>();
      ToFloat(w, in, n * t_.cols_aligned);
      SoftMax<float>(out, rowSum, rowMax, w, tmp, api_, shape);
    }
    outQ_.EnQue(out);
    inQ_.FreeTensor(in);
  }

  sm::SoftmaxTiling t_;
  SoftMaxTiling api_;
  int64_t row0_ = 0;
  int64_t rows_ = 0;
  uint32_t out_gap_blocks_ = 0;
  TPipe pipe_;
  TQue<QuePosition::VECIN, sm::kBufferNum> inQ_;    // GM -> UB
  TQue<QuePosition::VECOUT, sm::kBufferNum> outQ_;  // UB -> GM
  TBuf<TPosition::VECCALC> work_;                   // only when sm::UsesWorkBuffer; never DMA'd
  TBuf<TPosition::VECCALC> scratch_;
  TBuf<TPosition::VECCALC> stat_;
  GlobalTensor<T> xGm_;
  GlobalTensor<float> yGm_;
};

extern "C" __global__ __aicore__ void fp32_softmax(GM_ADDR x, GM_ADDR y, GM_ADDR workspace, GM_ADDR tiling) {
  GET_TILING_DATA(td, tiling);
  sm::SoftmaxTiling t;
  t.rows = td.rows;
  t.cols = td.cols;
  t.in_bytes = td.in_bytes;
  t.num_inputs = td.num_inputs;
  t.align = td.align;
  t.cols_aligned = td.cols_aligned;
  t.used_cores = td.used_cores;
  t.base_rows = td.base_rows;
  t.big_cores = td.big_cores;
  t.mode = td.mode;
  t.rows_per_tile = td.rows_per_tile;
  t.col_tile = td.col_tile;
  t.col_tiles = td.col_tiles;
  t.col_tail = td.col_tail;
  // An empty input has no tile: Init would ask InitBuffer for 0 bytes, which TPipe::InitBuffer
  // asserts against in debug builds (asc-devkit v9.0.0 impl/basic_api/kernel_tpipe_impl.h,
  // "len > 0"). The host tiling launches one core for it (SetBlockDim(1)), which returns here.
  if (t.rows == 0 || t.cols == 0) {
    return;
  }
  Fp32SoftmaxKernel<DTYPE_X> op;
  op.Init(x, y, t, td.softmax_tiling);
  if (TILING_KEY_IS(1)) {
    op.ProcessWholeRows();
  } else if (TILING_KEY_IS(2)) {
    op.ProcessColumnTiles();
  }
}
