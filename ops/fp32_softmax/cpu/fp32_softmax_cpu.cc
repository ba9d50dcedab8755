// FP32Softmax CPU kernel: ops.Custom(func_type="aot") entry points.
//
// Walks the schedule of fp32_softmax_tiling_logic.h (cores -> row tiles, or
// column tiles for rows too long for UB), exactly as the Ascend kernel does.
// Accuracy: exp, the row sum and the division run in double and are rounded
// once to float32, so each output is within about 0.5 ulp of the exact softmax
// of the float32 inputs (MindSpore's CPU Softmax: up to ~8e-6 relative).
//
// Fp32SoftmaxCpu:      x [..., N] float32/float16/bfloat16, cfg int64 [core_num, ub_bytes]
//                      -> y [..., N] float32
// Fp32SoftmaxGradCpu:  y float32, dy float32, cfg -> dx float32 = y * (dy - sum(dy * y))
#include <limits>

#include "fp32_softmax_tiling_logic.h"
#include "msds_aot_cpu.h"

using msds::cpu::DType;
using msds::softmax::SoftmaxTiling;

MSDS_DEFINE_LAST_ERROR()

namespace {

// Softmax of one row [cols] laid out contiguously; `tmp` holds >= one UB tile of exps.
void SoftmaxRowWhole(const void* x, DType dt, int64_t base, int64_t cols, float* y, double* tmp) {
  double m = -std::numeric_limits<double>::infinity();
  bool has_nan = false;
  for (int64_t j = 0; j < cols; ++j) {
    double v = msds::cpu::LoadAsFloat(x, dt, base + j);
    if (std::isnan(v)) has_nan = true;
    if (v > m) m = v;
  }
  if (has_nan) {
    for (int64_t j = 0; j < cols; ++j) y[base + j] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  double s = 0.0;
  for (int64_t j = 0; j < cols; ++j) {
    tmp[j] = std::exp(static_cast<double>(msds::cpu::LoadAsFloat(x, dt, base + j)) - m);
    s += tmp[j];
  }
  for (int64_t j = 0; j < cols; ++j) y[base + j] = static_cast<float>(tmp[j] / s);
}

// The same row in two passes over column tiles, as on the NPU when a row does not fit in
// UB: pass 1 keeps each tile's max m_c and s_c = sum exp(x - m_c); S = sum_c s_c exp(m_c - M)
// with M = max_c m_c; pass 2 writes exp(x - M) / S.
void SoftmaxRowColumnTiles(const SoftmaxTiling& t, const void* x, DType dt, int64_t base, float* y) {
  std::vector<double> tile_max(static_cast<size_t>(t.col_tiles)), tile_sum(static_cast<size_t>(t.col_tiles));
  double m = -std::numeric_limits<double>::infinity();
  bool has_nan = false;
  for (int64_t c = 0; c < t.col_tiles; ++c) {
    int64_t c0 = c * t.col_tile, n = msds::softmax::ColTileCols(t, c);
    double mc = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      double v = msds::cpu::LoadAsFloat(x, dt, base + c0 + j);
      if (std::isnan(v)) has_nan = true;
      if (v > mc) mc = v;
    }
    double sc = 0.0;
    if (mc > -std::numeric_limits<double>::infinity()) {  // a tile of -inf only adds nothing
      for (int64_t j = 0; j < n; ++j) sc += std::exp(static_cast<double>(msds::cpu::LoadAsFloat(x, dt, base + c0 + j)) - mc);
    }
    tile_max[c] = mc;
    tile_sum[c] = sc;
    if (mc > m) m = mc;
  }
  if (has_nan) {
    for (int64_t j = 0; j < t.cols; ++j) y[base + j] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  double s = 0.0;
  for (int64_t c = 0; c < t.col_tiles; ++c) {
    s += tile_sum[c] * std::exp(tile_max[c] - m);  // a masked tile: 0 * exp(-inf - m) = 0
  }
  for (int64_t c = 0; c < t.col_tiles; ++c) {
    int64_t c0 = c * t.col_tile, n = msds::softmax::ColTileCols(t, c);
    for (int64_t j = 0; j < n; ++j) {
      double e = std::exp(static_cast<double>(msds::cpu::LoadAsFloat(x, dt, base + c0 + j)) - m);
      y[base + c0 + j] = static_cast<float>(e / s);
    }
  }
}

void GradRow(const SoftmaxTiling& t, const float* y, const float* dy, int64_t base, float* dx) {
  // Both modes accumulate the dot product over the row in column order; column
  // mode reads it back tile by tile, which on CPU is the same loop.
  double dot = 0.0;
  for (int64_t j = 0; j < t.cols; ++j) dot += static_cast<double>(dy[base + j]) * y[base + j];
  for (int64_t j = 0; j < t.cols; ++j) {
    dx[base + j] = static_cast<float>(static_cast<double>(y[base + j]) * (static_cast<double>(dy[base + j]) - dot));
  }
}

// Walks core `core`'s rows tile by tile; fn(row_start, rows) per tile.
template <typename F>
void WalkCore(const SoftmaxTiling& t, int64_t core, F fn) {
  int64_t start, count;
  msds::softmax::CoreRows(t, core, &start, &count);
  if (t.mode == msds::softmax::kWholeRows) {
    int64_t tiles = msds::softmax::RowTiles(t, count);
    for (int64_t i = 0; i < tiles; ++i) fn(start + i * t.rows_per_tile, msds::softmax::RowTileRows(t, count, i));
  } else {
    for (int64_t r = 0; r < count; ++r) fn(start + r, 1);
  }
}

int RowsCols(int ndim, const int64_t* shape, int64_t* rows, int64_t* cols) {
  *cols = ndim > 0 ? shape[ndim - 1] : 1;
  *rows = 1;
  for (int i = 0; i + 1 < ndim; ++i) *rows *= shape[i];
  return 0;
}

int ReadConfig(void* cfg_ptr, int ndim, const int64_t* shape, const char* dtype, int64_t* core_num,
               int64_t* ub_bytes) {
  if (msds::cpu::ParseDType(dtype) != DType::kInt64 || msds::cpu::NumElements(ndim, shape) != 2) {
    return MsdsFail("FP32Softmax: config must be int64 [core_num, ub_bytes]");
  }
  const int64_t* cfg = static_cast<const int64_t*>(cfg_ptr);
  *core_num = cfg[0];
  *ub_bytes = cfg[1];
  return 0;
}

}  // namespace

extern "C" int Fp32SoftmaxCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                              void* stream, void* extra) {
  if (nparam != 3) return MsdsFail("FP32Softmax: expected 2 inputs and 1 output");
  DType dt = msds::cpu::ParseDType(dtypes[0]);
  if (dt != DType::kFloat32 && dt != DType::kFloat16 && dt != DType::kBFloat16) {
    return MsdsFail(std::string("FP32Softmax: input dtype must be float32, float16 or bfloat16, got ") + dtypes[0]);
  }
  if (msds::cpu::ParseDType(dtypes[2]) != DType::kFloat32) return MsdsFail("FP32Softmax: output must be float32");
  int64_t core_num, ub_bytes;
  if (ReadConfig(params[1], ndims[1], shapes[1], dtypes[1], &core_num, &ub_bytes) != 0) return 1;
  int64_t rows, cols;
  RowsCols(ndims[0], shapes[0], &rows, &cols);
  SoftmaxTiling t;
  int status = msds::softmax::ComputeTiling(rows, cols, dt == DType::kFloat32 ? 4 : 2, 1, core_num, ub_bytes, &t);
  if (status != msds::kOk) return MsdsFail("FP32Softmax: tiling failed with status " + std::to_string(status));
  const void* x = params[0];
  float* y = static_cast<float*>(params[2]);
  msds::cpu::ForEachCore(t.used_cores, rows * cols, [&](int64_t core) {
    std::vector<double> tmp(t.mode == msds::softmax::kWholeRows ? static_cast<size_t>(t.cols) : 0);
    WalkCore(t, core, [&](int64_t row0, int64_t n) {
      for (int64_t r = row0; r < row0 + n; ++r) {
        if (t.mode == msds::softmax::kWholeRows) {
          SoftmaxRowWhole(x, dt, r * cols, cols, y, tmp.data());
        } else {
          SoftmaxRowColumnTiles(t, x, dt, r * cols, y);
        }
      }
    });
  });
  return 0;
}

extern "C" int Fp32SoftmaxGradCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                  void* stream, void* extra) {
  if (nparam != 4) return MsdsFail("FP32SoftmaxGrad: expected 3 inputs and 1 output");
  for (int i : {0, 1, 3}) {
    if (msds::cpu::ParseDType(dtypes[i]) != DType::kFloat32) return MsdsFail("FP32SoftmaxGrad: y, dy, dx must be float32");
  }
  int64_t core_num, ub_bytes;
  if (ReadConfig(params[2], ndims[2], shapes[2], dtypes[2], &core_num, &ub_bytes) != 0) return 1;
  int64_t rows, cols;
  RowsCols(ndims[0], shapes[0], &rows, &cols);
  SoftmaxTiling t;
  int status = msds::softmax::ComputeTiling(rows, cols, 4, 2, core_num, ub_bytes, &t);
  if (status != msds::kOk) return MsdsFail("FP32SoftmaxGrad: tiling failed with status " + std::to_string(status));
  const float* y = static_cast<const float*>(params[0]);
  const float* dy = static_cast<const float*>(params[1]);
  float* dx = static_cast<float*>(params[3]);
  msds::cpu::ForEachCore(t.used_cores, rows * cols, [&](int64_t core) {
    WalkCore(t, core, [&](int64_t row0, int64_t n) {
      for (int64_t r = row0; r < row0 + n; ++r) GradRow(t, y, dy, r * cols, dx);
    });
  });
  return 0;
}

// Test hooks: the tiling struct and the tile schedule, for the Python tests.
// in = [rows, cols, in_bytes, num_inputs, core_num, ub_bytes]; out = 14 fields.
extern "C" int Fp32SoftmaxTilingQuery(const int64_t* in, int64_t* out) {
  SoftmaxTiling t;
  int status = msds::softmax::ComputeTiling(in[0], in[1], in[2], in[3], in[4], in[5], &t);
  if (status != msds::kOk) return status;
  int64_t fields[] = {t.rows, t.cols, t.in_bytes, t.num_inputs, t.align, t.cols_aligned, t.used_cores,
                      t.base_rows, t.big_cores, t.mode, t.rows_per_tile, t.col_tile, t.col_tiles, t.col_tail};
  std::copy(std::begin(fields), std::end(fields), out);
  return 0;
}

// Writes (core, row_start, rows, col_start, cols) for every tile the kernel
// visits, in order; returns the number of tiles, or -1 if `cap` is too small.
extern "C" int64_t Fp32SoftmaxScheduleQuery(const int64_t* in, int64_t* out, int64_t cap) {
  SoftmaxTiling t;
  if (msds::softmax::ComputeTiling(in[0], in[1], in[2], in[3], in[4], in[5], &t) != msds::kOk) return -1;
  int64_t n = 0;
  bool overflow = false;
  for (int64_t core = 0; core < t.used_cores; ++core) {
    WalkCore(t, core, [&](int64_t row0, int64_t rows) {
      int64_t col_tiles = t.mode == msds::softmax::kWholeRows ? 1 : t.col_tiles;
      for (int64_t c = 0; c < col_tiles; ++c) {
        if (n >= cap) {
          overflow = true;
          return;
        }
        int64_t c0 = t.mode == msds::softmax::kWholeRows ? 0 : c * t.col_tile;
        int64_t cn = t.mode == msds::softmax::kWholeRows ? t.cols : msds::softmax::ColTileCols(t, c);
        int64_t rec[] = {core, row0, rows, c0, cn};
        std::copy(std::begin(rec), std::end(rec), out + 5 * n);
        ++n;
      }
    });
  }
  return overflow ? -1 : n;
}
