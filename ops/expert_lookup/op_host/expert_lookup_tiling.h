// Tiling data of ExpertLookup as the CANN runtime carries it from host to kernel.
// Field for field the msds::expert_lookup::ExpertLookupTiling of expert_lookup_tiling_logic.h.
#ifndef EXPERT_LOOKUP_TILING_H
#define EXPERT_LOOKUP_TILING_H

#include "register/tilingdata_base.h"

namespace optiling {
BEGIN_TILING_DATA_DEF(ExpertLookupTilingData)
TILING_DATA_FIELD_DEF(int64_t, slots);
TILING_DATA_FIELD_DEF(int64_t, groups);
TILING_DATA_FIELD_DEF(int64_t, group_slots);
TILING_DATA_FIELD_DEF(int64_t, num_experts);
TILING_DATA_FIELD_DEF(int64_t, experts_per_rank);
TILING_DATA_FIELD_DEF(int64_t, capacity);
TILING_DATA_FIELD_DEF(int64_t, used_cores);
TILING_DATA_FIELD_DEF(int64_t, chunk);
TILING_DATA_FIELD_DEF(int64_t, last_chunk);
TILING_DATA_FIELD_DEF(int64_t, tile);
TILING_DATA_FIELD_DEF(int64_t, hist_stride);
TILING_DATA_FIELD_DEF(int64_t, workspace_bytes);
END_TILING_DATA_DEF;

REGISTER_TILING_DATA_CLASS(ExpertLookup, ExpertLookupTilingData)
}  // namespace optiling

#endif  // EXPERT_LOOKUP_TILING_H
