// ExpertLookup Ascend C kernel: placement lookup + capacity positions for MoE dispatch.
//
// A thin translation of expert_lookup_tiling_logic.h. Core c owns slots
// CoreSlots(c) of the flat stream of G k-major groups and walks them in tiles of
// `tile` slots; counters are keyed by group * E + expert (el::NextKey, the group from a
// cursor along the walk, no division per slot):
//   1. count:  histogram of its keys (scalar loop over the UB tile) ->
//              workspace row c (GM);
//   2. SyncAll: every core's histogram is in GM;
//   3. assign: counters = sum of workspace rows 0..c-1 (vector adds), then the
//              same walk gives each slot counter[e]++ as its position and looks
//              up (rank, local slot) in the UB copy of the placement table.
// The per-slot work is scalar (an id-dependent read-modify-write of a counter),
// which is cheap at T * k of a few thousand slots per step. Ids are range-checked
// here on the device: an id outside [0, E) touches no counter and no placement
// entry and gets InvalidSlot's (-1, -1, -1, 0.0), as in the CPU kernel and the
// reference. The kernel is declared mixed (KERNEL_TYPE_MIX_AIV_1_0, vector cores
// only) so that CANN sets up the FFTS sync that the hardware SyncAll() needs.
#include "kernel_operator.h"
#include "expert_lookup_tiling_logic.h"
#include "msds_ascendc_sync.h"

using namespace AscendC;
namespace el = msds::expert_lookup;

class ExpertLookupKernel {
 public:
  __aicore__ inline void Init(GM_ADDR ids, GM_ADDR placement, GM_ADDR dest, GM_ADDR row, GM_ADDR pos, GM_ADDR keep,
                              GM_ADDR workspace, const el::ExpertLookupTiling& t) {
    t_ = t;
    core_ = GetBlockIdx();
    el::CoreSlots(t_, core_, &start_, &count_);
    idsGm_.SetGlobalBuffer((__gm__ int32_t*)ids);
    placeGm_.SetGlobalBuffer((__gm__ int32_t*)placement);
    destGm_.SetGlobalBuffer((__gm__ int32_t*)dest);
    rowGm_.SetGlobalBuffer((__gm__ int32_t*)row);
    posGm_.SetGlobalBuffer((__gm__ int32_t*)pos);
    keepGm_.SetGlobalBuffer((__gm__ float*)keep);
    histGm_.SetGlobalBuffer((__gm__ int32_t*)workspace);
    // UB layout follows el::BytesPerSlot() and el::FixedUbBytes(): one buffer of `tile` slots each.
    pipe_.InitBuffer(idsBuf_, t_.tile * 4);
    pipe_.InitBuffer(destBuf_, t_.tile * 4);
    pipe_.InitBuffer(rowBuf_, t_.tile * 4);
    pipe_.InitBuffer(posBuf_, t_.tile * 4);
    pipe_.InitBuffer(keepBuf_, t_.tile * 4);
    pipe_.InitBuffer(placeBuf_, 2 * msds::AlignUp(t_.num_experts, el::kAlign) * 4);
    pipe_.InitBuffer(counterBuf_, t_.hist_stride * 4);
    pipe_.InitBuffer(histRowBuf_, t_.hist_stride * 4);
  }

  __aicore__ inline void Process() {
    if (t_.used_cores == 0) return;
    LocalTensor<int32_t> counter = counterBuf_.Get<int32_t>();

    // Phase 1: histogram of this core's slots -> workspace row core_.
    Duplicate(counter, 0, static_cast<int32_t>(t_.hist_stride));
    msds::Sync<HardEvent::V_S>();
    int64_t tiles = el::Tiles(t_, count_);
    el::GroupCursor cursor = el::StartGroups(t_, start_);
    for (int64_t i = 0; i < tiles; ++i) {
      int64_t n = el::TileSlots(t_, count_, i);
      LocalTensor<int32_t> ids = LoadIds(start_ + i * t_.tile, n);
      int64_t s0 = start_ + i * t_.tile;
      for (int64_t j = 0; j < n; ++j) {
        int64_t key = el::NextKey(t_, &cursor, s0 + j, ids.GetValue(j));
        if (key >= 0) counter.SetValue(key, counter.GetValue(key) + 1);
      }
      msds::Sync<HardEvent::S_MTE2>();  // the next tile overwrites the ids buffer
    }
    msds::Sync<HardEvent::S_MTE3>();
    DataCopy(histGm_[core_ * t_.hist_stride], counter, static_cast<uint32_t>(t_.hist_stride));

    // Phase 2: every core's histogram is in GM.
    SyncAll();

    // Phase 3a: counters start at the sum of the earlier cores' histograms.
    msds::Sync<HardEvent::MTE3_V>();
    Duplicate(counter, 0, static_cast<int32_t>(t_.hist_stride));
    LocalTensor<int32_t> hist = histRowBuf_.Get<int32_t>();
    for (int64_t c = 0; c < core_; ++c) {
      DataCopy(hist, histGm_[c * t_.hist_stride], static_cast<uint32_t>(t_.hist_stride));
      msds::Sync<HardEvent::MTE2_V>();
      Add(counter, counter, hist, static_cast<int32_t>(t_.hist_stride));
      msds::Sync<HardEvent::V_MTE2>();  // the next row overwrites `hist`
    }
    LocalTensor<int32_t> place = placeBuf_.Get<int32_t>();
    DataCopyExtParams pp{1, static_cast<uint32_t>(t_.num_experts * 2 * 4), 0, 0, 0};
    DataCopyPadExtParams<int32_t> nopad{false, 0, 0, 0};
    DataCopyPad(place, placeGm_, pp, nopad);
    msds::Sync<HardEvent::V_S>();
    msds::Sync<HardEvent::MTE2_S>();

    // Phase 3b: positions in k-major order, outputs tile by tile.
    LocalTensor<int32_t> dest = destBuf_.Get<int32_t>();
    LocalTensor<int32_t> row = rowBuf_.Get<int32_t>();
    LocalTensor<int32_t> pos = posBuf_.Get<int32_t>();
    LocalTensor<float> keep = keepBuf_.Get<float>();
    cursor = el::StartGroups(t_, start_);
    for (int64_t i = 0; i < tiles; ++i) {
      int64_t s0 = start_ + i * t_.tile;
      int64_t n = el::TileSlots(t_, count_, i);
      LocalTensor<int32_t> ids = LoadIds(s0, n);
      msds::Sync<HardEvent::MTE3_S>();  // the previous tile's outputs have left UB
      for (int64_t j = 0; j < n; ++j) {
        int32_t e = ids.GetValue(j);
        int64_t key = el::NextKey(t_, &cursor, s0 + j, e);
        int32_t d, r, q;
        float k;
        if (key < 0) {
          el::InvalidSlot(&d, &r, &q, &k);
        } else {
          int32_t p = counter.GetValue(key);
          counter.SetValue(key, p + 1);
          el::AssignSlot(place.GetValue(2 * e), place.GetValue(2 * e + 1), p, t_, &d, &r, &q, &k);
        }
        dest.SetValue(j, d);
        row.SetValue(j, r);
        pos.SetValue(j, q);
        keep.SetValue(j, k);
      }
      msds::Sync<HardEvent::S_MTE3>();
      msds::Sync<HardEvent::S_MTE2>();
      DataCopyExtParams out{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
      DataCopyPad(destGm_[s0], dest, out);
      DataCopyPad(rowGm_[s0], row, out);
      DataCopyPad(posGm_[s0], pos, out);
      DataCopyPad(keepGm_[s0], keep, out);
    }
  }

 private:
  __aicore__ inline LocalTensor<int32_t> LoadIds(int64_t offset, int64_t n) {
    LocalTensor<int32_t> ids = idsBuf_.Get<int32_t>();
    DataCopyExtParams params{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
    DataCopyPadExtParams<int32_t> pad{false, 0, 0, 0};
    DataCopyPad(ids, idsGm_[offset], params, pad);
    msds::Sync<HardEvent::MTE2_S>();
    return ids;
  }

  el::ExpertLookupTiling t_;
  int64_t core_ = 0;
  int64_t start_ = 0;
  int64_t count_ = 0;
  TPipe pipe_;
  // DMA'd buffers sit where the DMA may reach them on Atlas A2: DataCopyPad moves GM->VECIN/VECOUT
  // and VECIN/VECOUT->GM only (asc-devkit v9.0.0 docs/api/context/DataCopyPad(ISASI).md, table 1),
  // DataCopy GM->VECIN and VECOUT->GM (docs/api/context/基础数据搬运.md, tables 4 and 6).
  TBuf<TPosition::VECIN> idsBuf_, placeBuf_, histRowBuf_;                    // GM -> UB
  TBuf<TPosition::VECOUT> destBuf_, rowBuf_, posBuf_, keepBuf_, counterBuf_;  // UB -> GM
  GlobalTensor<int32_t> idsGm_, placeGm_, destGm_, rowGm_, posGm_, histGm_;
  GlobalTensor<float> keepGm_;
};

extern "C" __global__ __aicore__ void expert_lookup(GM_ADDR ids, GM_ADDR placement, GM_ADDR dest_rank,
                                                    GM_ADDR buffer_row, GM_ADDR position, GM_ADDR keep,
                                                    GM_ADDR workspace, GM_ADDR tiling) {
  // SyncAll() between the count and assign phases is the hardware barrier: CANN sets up
  // its FFTS sync only for a kernel declared mixed (vector cores only, 1:0).
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);
  GET_TILING_DATA(td, tiling);
  el::ExpertLookupTiling t;
  t.slots = td.slots;
  t.groups = td.groups;
  t.group_slots = td.group_slots;
  t.num_experts = td.num_experts;
  t.experts_per_rank = td.experts_per_rank;
  t.capacity = td.capacity;
  t.used_cores = td.used_cores;
  t.chunk = td.chunk;
  t.last_chunk = td.last_chunk;
  t.tile = td.tile;
  t.hist_stride = td.hist_stride;
  t.workspace_bytes = td.workspace_bytes;
  GM_ADDR user_workspace = GetUserWorkspace(workspace);
  ExpertLookupKernel op;
  op.Init(ids, placement, dest_rank, buffer_row, position, keep, user_workspace, t);
  if (TILING_KEY_IS(1)) {
    op.Process();
  }
}
