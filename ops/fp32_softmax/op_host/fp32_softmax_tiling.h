// Tiling data of Fp32Softmax as the CANN runtime carries it from host to kernel.
// Field for field the msds::softmax::SoftmaxTiling of fp32_softmax_tiling_logic.h, plus
// the SoftMax high-level API's own tiling for a whole-rows tile (asc-devkit v9.0.0,
// docs/api/context/SoftMax-Tiling使用说明.md: a TILING_DATA_FIELD_DEF_STRUCT(SoftMaxTiling, ...)
// field filled by AscendC::SoftMaxTilingFunc on the host).
#ifndef FP32_SOFTMAX_TILING_H
#define FP32_SOFTMAX_TILING_H

#include "register/tilingdata_base.h"
#include "tiling/tiling_api.h"

namespace optiling {
BEGIN_TILING_DATA_DEF(Fp32SoftmaxTilingData)
TILING_DATA_FIELD_DEF(int64_t, rows);
TILING_DATA_FIELD_DEF(int64_t, cols);
TILING_DATA_FIELD_DEF(int64_t, in_bytes);
TILING_DATA_FIELD_DEF(int64_t, num_inputs);
TILING_DATA_FIELD_DEF(int64_t, align);
TILING_DATA_FIELD_DEF(int64_t, cols_aligned);
TILING_DATA_FIELD_DEF(int64_t, used_cores);
TILING_DATA_FIELD_DEF(int64_t, base_rows);
TILING_DATA_FIELD_DEF(int64_t, big_cores);
TILING_DATA_FIELD_DEF(int64_t, mode);
TILING_DATA_FIELD_DEF(int64_t, rows_per_tile);
TILING_DATA_FIELD_DEF(int64_t, col_tile);
TILING_DATA_FIELD_DEF(int64_t, col_tiles);
TILING_DATA_FIELD_DEF(int64_t, col_tail);
TILING_DATA_FIELD_DEF_STRUCT(SoftMaxTiling, softmax_tiling);
END_TILING_DATA_DEF;

REGISTER_TILING_DATA_CLASS(Fp32Softmax, Fp32SoftmaxTilingData)
}  // namespace optiling

#endif  // FP32_SOFTMAX_TILING_H
