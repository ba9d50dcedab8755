// ExpertLookup CPU kernel: ops.Custom(func_type="aot") entry point.
//
// ExpertLookupCpu inputs:  ids_km int32 [G, S] (per token group, router choices in
//                          k-major order; a 1-D [S] input is one group),
//                          placement int32 [E, 2] (EP rank, local slot),
//                          cfg int64 [capacity, experts_per_rank, core_num, ub_bytes]
//                 outputs: dest_rank int32 [G, S], buffer_row int32 [G, S],
//                          position int32 [G, S], keep float32 [G, S]
// Positions count per group. Ids outside [0, E) are not counted and get the
// InvalidSlot outputs (-1, -1, -1, 0.0), as on the NPU and in the reference.
// Walks the three phases of expert_lookup_tiling_logic.h: per-core histograms
// into a workspace, a phase boundary (SyncAll on the NPU), then per-core
// assignment starting from the earlier cores' counts.
#include "expert_lookup_tiling_logic.h"
#include "msds_aot_cpu.h"

using msds::cpu::DType;
using msds::expert_lookup::ExpertLookupTiling;

MSDS_DEFINE_LAST_ERROR()

namespace {

// Phase 1 for one core: histogram of its slots' keys (group * E + expert), tile by tile, into hist[G * E].
void CountCore(const ExpertLookupTiling& t, int64_t core, const int32_t* ids, int32_t* hist) {
  int64_t start, count;
  msds::expert_lookup::CoreSlots(t, core, &start, &count);
  int64_t tiles = msds::expert_lookup::Tiles(t, count);
  msds::expert_lookup::GroupCursor cursor = msds::expert_lookup::StartGroups(t, start);
  for (int64_t i = 0; i < tiles; ++i) {
    int64_t s0 = start + i * t.tile, n = msds::expert_lookup::TileSlots(t, count, i);
    for (int64_t s = s0; s < s0 + n; ++s) {
      int64_t key = msds::expert_lookup::NextKey(t, &cursor, s, ids[s]);
      if (key >= 0) ++hist[key];
    }
  }
}

// Phase 3 for one core: counters start at the sum of earlier cores' histograms.
void AssignCore(const ExpertLookupTiling& t, int64_t core, const int32_t* ids, const int32_t* placement,
                const int32_t* workspace, int32_t* dest, int32_t* row, int32_t* pos, float* keep) {
  int64_t keys = t.groups * t.num_experts;
  std::vector<int64_t> counter(static_cast<size_t>(keys), 0);
  for (int64_t c = 0; c < core; ++c) {
    for (int64_t e = 0; e < keys; ++e) counter[e] += workspace[c * t.hist_stride + e];
  }
  int64_t start, count;
  msds::expert_lookup::CoreSlots(t, core, &start, &count);
  int64_t tiles = msds::expert_lookup::Tiles(t, count);
  msds::expert_lookup::GroupCursor cursor = msds::expert_lookup::StartGroups(t, start);
  for (int64_t i = 0; i < tiles; ++i) {
    int64_t s0 = start + i * t.tile, n = msds::expert_lookup::TileSlots(t, count, i);
    for (int64_t s = s0; s < s0 + n; ++s) {
      int32_t e = ids[s];
      int64_t key = msds::expert_lookup::NextKey(t, &cursor, s, e);
      if (key < 0) {
        msds::expert_lookup::InvalidSlot(dest + s, row + s, pos + s, keep + s);
        continue;
      }
      msds::expert_lookup::AssignSlot(placement[2 * e], placement[2 * e + 1], counter[key]++, t, dest + s, row + s,
                                      pos + s, keep + s);
    }
  }
}

}  // namespace

extern "C" int ExpertLookupCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                               void* stream, void* extra) {
  if (nparam != 7) return MsdsFail("ExpertLookup: expected 3 inputs and 4 outputs");
  if (msds::cpu::ParseDType(dtypes[0]) != DType::kInt32 || msds::cpu::ParseDType(dtypes[1]) != DType::kInt32) {
    return MsdsFail("ExpertLookup: topk_ids and placement must be int32");
  }
  if (ndims[1] != 2 || shapes[1][1] != 2) return MsdsFail("ExpertLookup: placement must have shape [E, 2]");
  if (msds::cpu::ParseDType(dtypes[2]) != DType::kInt64 || msds::cpu::NumElements(ndims[2], shapes[2]) != 4) {
    return MsdsFail("ExpertLookup: config must be int64 [capacity, experts_per_rank, core_num, ub_bytes]");
  }
  const int64_t* cfg = static_cast<const int64_t*>(params[2]);
  if (ndims[0] != 1 && ndims[0] != 2) return MsdsFail("ExpertLookup: ids must be [G, S] (or [S])");
  int64_t slots = msds::cpu::NumElements(ndims[0], shapes[0]);
  int64_t groups = ndims[0] == 2 ? shapes[0][0] : 1;
  ExpertLookupTiling t;
  int status = msds::expert_lookup::ComputeTiling(slots, groups > 0 ? groups : 1, shapes[1][0], cfg[1], cfg[0],
                                                  cfg[2], cfg[3], &t);
  if (status != msds::kOk) return MsdsFail("ExpertLookup: tiling failed with status " + std::to_string(status));

  const int32_t* ids = static_cast<const int32_t*>(params[0]);
  const int32_t* placement = static_cast<const int32_t*>(params[1]);
  int32_t* dest = static_cast<int32_t*>(params[3]);
  int32_t* row = static_cast<int32_t*>(params[4]);
  int32_t* pos = static_cast<int32_t*>(params[5]);
  float* keep = static_cast<float*>(params[6]);

  // The GM workspace of the NPU kernel: one histogram row per used core.
  std::vector<int32_t> workspace(static_cast<size_t>(t.used_cores * t.hist_stride), 0);
  msds::cpu::ForEachCore(t.used_cores, slots, [&](int64_t core) {
    CountCore(t, core, ids, workspace.data() + core * t.hist_stride);
  });
  // --- phase boundary (SyncAll) ---
  msds::cpu::ForEachCore(t.used_cores, slots, [&](int64_t core) {
    AssignCore(t, core, ids, placement, workspace.data(), dest, row, pos, keep);
  });
  return 0;
}

// Test hooks. in = [slots, groups, num_experts, experts_per_rank, capacity, core_num, ub_bytes].
extern "C" int ExpertLookupTilingQuery(const int64_t* in, int64_t* out) {
  ExpertLookupTiling t;
  int status = msds::expert_lookup::ComputeTiling(in[0], in[1], in[2], in[3], in[4], in[5], in[6], &t);
  if (status != msds::kOk) return status;
  int64_t fields[] = {t.slots, t.groups, t.group_slots, t.num_experts, t.experts_per_rank, t.capacity,
                      t.used_cores, t.chunk, t.last_chunk, t.tile, t.hist_stride, t.workspace_bytes};
  std::copy(std::begin(fields), std::end(fields), out);
  return 0;
}

// Writes (core, slot_start, slots) for every tile, in order; returns the count or -1.
extern "C" int64_t ExpertLookupScheduleQuery(const int64_t* in, int64_t* out, int64_t cap) {
  ExpertLookupTiling t;
  if (msds::expert_lookup::ComputeTiling(in[0], in[1], in[2], in[3], in[4], in[5], in[6], &t) != msds::kOk) {
    return -1;
  }
  int64_t n = 0;
  for (int64_t core = 0; core < t.used_cores; ++core) {
    int64_t start, count;
    msds::expert_lookup::CoreSlots(t, core, &start, &count);
    for (int64_t i = 0; i < msds::expert_lookup::Tiles(t, count); ++i) {
      if (n >= cap) return -1;
      int64_t rec[] = {core, start + i * t.tile, msds::expert_lookup::TileSlots(t, count, i)};
      std::copy(std::begin(rec), std::end(rec), out + 3 * n);
      ++n;
    }
  }
  return n;
}
