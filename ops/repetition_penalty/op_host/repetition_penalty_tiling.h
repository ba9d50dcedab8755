// Tiling data of RepetitionPenalty as the CANN runtime carries it from host to kernel.
// Field for field the msds::repetition_penalty::PenaltyTiling of
// repetition_penalty_tiling_logic.h, plus the penalty attribute.
#ifndef REPETITION_PENALTY_TILING_H
#define REPETITION_PENALTY_TILING_H

#include "register/tilingdata_base.h"

namespace optiling {
BEGIN_TILING_DATA_DEF(RepetitionPenaltyTilingData)
TILING_DATA_FIELD_DEF(int64_t, batch);
TILING_DATA_FIELD_DEF(int64_t, vocab);
TILING_DATA_FIELD_DEF(int64_t, length);
TILING_DATA_FIELD_DEF(int64_t, total);
TILING_DATA_FIELD_DEF(int64_t, used_cores);
TILING_DATA_FIELD_DEF(int64_t, chunk);
TILING_DATA_FIELD_DEF(int64_t, last_chunk);
TILING_DATA_FIELD_DEF(int64_t, tile);
TILING_DATA_FIELD_DEF(int64_t, id_tile);
TILING_DATA_FIELD_DEF(float, penalty);
END_TILING_DATA_DEF;

REGISTER_TILING_DATA_CLASS(RepetitionPenalty, RepetitionPenaltyTilingData)
}  // namespace optiling

#endif  // REPETITION_PENALTY_TILING_H
