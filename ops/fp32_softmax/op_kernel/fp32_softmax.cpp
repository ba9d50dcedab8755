// Fp32Softmax Ascend C kernel: y = softmax(float32(x)) over the last axis.
//
// A thin translation of fp32_softmax_tiling_logic.h: core `GetBlockIdx()` takes
// its rows from CoreRows(); tiling key 1 (kWholeRows) moves `rows_per_tile`
// whole rows per UB tile, key 2 (kColumnTiles) walks each row three times over
// column tiles (max, sum of exp, write). Input rows land in UB at a pitch of
// `cols_aligned` elements (one 32-byte block multiple); DataCopyPad moves the
// unaligned row ends. Everything after the cast runs in float32.
#include "kernel_operator.h"
#include "fp32_softmax_tiling_logic.h"
#include "msds_ascendc_sync.h"

using namespace AscendC;
namespace sm = msds::softmax;

template <typename T>
class Fp32SoftmaxKernel {
 public:
  __aicore__ inline void Init(GM_ADDR x, GM_ADDR y, const sm::SoftmaxTiling& t) {
    t_ = t;
    sm::CoreRows(t_, GetBlockIdx(), &row0_, &rows_);
    xGm_.SetGlobalBuffer((__gm__ T*)x);
    yGm_.SetGlobalBuffer((__gm__ float*)y);
    // Elements per UB tile; the budget is sm::BytesPerElement() per element.
    int64_t elems = t_.mode == sm::kWholeRows ? t_.rows_per_tile * t_.cols_aligned : t_.col_tile;
    pipe_.InitBuffer(inQ_, sm::kBufferNum, elems * sizeof(T));
    pipe_.InitBuffer(outQ_, sm::kBufferNum, elems * sizeof(float));
    pipe_.InitBuffer(work_, elems * sizeof(float));
    pipe_.InitBuffer(scratch_, elems * sizeof(float));
    pipe_.InitBuffer(stat_, 2 * msds::kBlockBytes);
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
    for (int64_t r = row0_; r < row0_ + rows_; ++r) {
      int64_t base = r * t_.cols;
      // Pass 1: row max.
      float m = -3.4028235e38f;
      for (int64_t c = 0; c < t_.col_tiles; ++c) {
        int64_t n = sm::ColTileCols(t_, c);
        LocalTensor<float> w = LoadAsFloat(base + c * t_.col_tile, n);
        LocalTensor<float> s = stat_.Get<float>();
        ReduceMax(s, w, scratch_.Get<float>(), static_cast<int32_t>(n));
        msds::Sync<HardEvent::V_S>();
        float v = s.GetValue(0);
        m = v > m ? v : m;
      }
      // Pass 2: sum of exp(x - max).
      float sum = 0.0f;
      for (int64_t c = 0; c < t_.col_tiles; ++c) {
        int64_t n = sm::ColTileCols(t_, c);
        LocalTensor<float> w = LoadAsFloat(base + c * t_.col_tile, n);
        Adds(w, w, -m, static_cast<int32_t>(n));
        PipeBarrier<PIPE_V>();
        Exp(w, w, static_cast<int32_t>(n));
        PipeBarrier<PIPE_V>();
        LocalTensor<float> s = stat_.Get<float>();
        ReduceSum(s, w, scratch_.Get<float>(), static_cast<int32_t>(n));
        msds::Sync<HardEvent::V_S>();
        sum += s.GetValue(0);
      }
      // Pass 3: write exp(x - max) / sum.
      float inv = 1.0f / sum;
      for (int64_t c = 0; c < t_.col_tiles; ++c) {
        int64_t n = sm::ColTileCols(t_, c);
        LocalTensor<float> w = LoadAsFloat(base + c * t_.col_tile, n);
        LocalTensor<float> out = outQ_.AllocTensor<float>();
        Adds(w, w, -m, static_cast<int32_t>(n));
        PipeBarrier<PIPE_V>();
        Exp(w, w, static_cast<int32_t>(n));
        PipeBarrier<PIPE_V>();
        Muls(out, w, inv, static_cast<int32_t>(n));
        outQ_.EnQue(out);
        CopyOut(base + c * t_.col_tile, 1, n, 0);
      }
    }
  }

 private:
  // GM rows [offset, offset + rows * len) -> UB at a pitch of cols_aligned (kWholeRows)
  // or one column tile (kColumnTiles, rows == 1).
  __aicore__ inline void CopyIn(int64_t offset, int64_t rows, int64_t len) {
    LocalTensor<T> in = inQ_.AllocTensor<T>();
    DataCopyExtParams params{static_cast<uint16_t>(rows), static_cast<uint32_t>(len * sizeof(T)), 0, 0, 0};
    DataCopyPadExtParams<T> pad{false, 0, 0, 0};
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

  __aicore__ inline void ComputeRows(int64_t n) {
    LocalTensor<T> in = inQ_.DeQue<T>();
    LocalTensor<float> w = work_.Get<float>();
    LocalTensor<float> out = outQ_.AllocTensor<float>();
    LocalTensor<float> s = stat_.Get<float>();
    LocalTensor<float> scratch = scratch_.Get<float>();
    ToFloat(w, in, n * t_.cols_aligned);
    int32_t cols = static_cast<int32_t>(t_.cols);
    for (int64_t r = 0; r < n; ++r) {
      LocalTensor<float> row = w[r * t_.cols_aligned];
      LocalTensor<float> dst = out[r * t_.cols_aligned];
      ReduceMax(s, row, scratch, cols);
      msds::Sync<HardEvent::V_S>();
      float m = s.GetValue(0);
      Adds(dst, row, -m, cols);
      PipeBarrier<PIPE_V>();
      Exp(dst, dst, cols);
      PipeBarrier<PIPE_V>();
      ReduceSum(s, dst, scratch, cols);
      msds::Sync<HardEvent::V_S>();
      float inv = 1.0f / s.GetValue(0);
      Muls(dst, dst, inv, cols);
      PipeBarrier<PIPE_V>();
    }
    outQ_.EnQue(out);
    inQ_.FreeTensor(in);
  }

  sm::SoftmaxTiling t_;
  int64_t row0_ = 0;
  int64_t rows_ = 0;
  uint32_t out_gap_blocks_ = 0;
  TPipe pipe_;
  TQue<QuePosition::VECIN, sm::kBufferNum> inQ_;
  TQue<QuePosition::VECOUT, sm::kBufferNum> outQ_;
  TBuf<TPosition::VECCALC> work_;
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
  Fp32SoftmaxKernel<DTYPE_X> op;
  op.Init(x, y, t);
  if (TILING_KEY_IS(1)) {
    op.ProcessWholeRows();
  } else if (TILING_KEY_IS(2)) {
    op.ProcessColumnTiles();
  }
}
