// RepetitionPenalty Ascend C kernel: y = logits with every seen id penalised once.
//
// A thin translation of repetition_penalty_tiling_logic.h. Core c owns the flat range
// CoreRange(c) of [B * V], cut into one-row segments and those into tiles: copy the tile
// into UB, penalise the elements its row's ids name, reading each original value from that
// UB copy before its only change (the "done" mask), copy the tile out. The scalar unit
// never reads GM: GlobalTensor::GetValue goes through the core's data cache, and its
// constraint asks for DataCacheCleanAndInvalid whenever GM may have been written by others
// (CANN 9.0.0 Ascend C API, GlobalTensor GetValue, atlasascendc_api_07_00026) - the logits
// are rewritten every decode step, often at the same address. Ids outside [0, V) are
// skipped on the device. Buffers the DMA fills or drains are VECIN / VECOUT: for Atlas A2
// DataCopyPad moves GM->VECIN/VECOUT and VECIN/VECOUT->GM only (asc-devkit v9.0.0,
// docs/api/context/DataCopyPad(ISASI).md, table 1); the mask is scalar / vector only (VECCALC).
#include "kernel_operator.h"
#include "repetition_penalty_tiling_logic.h"
#include "msds_ascendc_sync.h"

using namespace AscendC;
namespace rp = msds::repetition_penalty;

class RepetitionPenaltyKernel {
 public:
  __aicore__ inline void Init(GM_ADDR logits, GM_ADDR ids, GM_ADDR y, const rp::PenaltyTiling& t, float penalty) {
    t_ = t;
    penalty_ = penalty;
    rp::CoreRange(t_, GetBlockIdx(), &start_, &count_);
    logitsGm_.SetGlobalBuffer((__gm__ float*)logits);
    idsGm_.SetGlobalBuffer((__gm__ int32_t*)ids);
    yGm_.SetGlobalBuffer((__gm__ float*)y);
    // UB layout follows rp::UbBytes(): one tile, its mask, one id load.
    pipe_.InitBuffer(tileBuf_, t_.tile * 4);
    pipe_.InitBuffer(maskBuf_, rp::MaskWords(t_.tile) * 4);
    pipe_.InitBuffer(idBuf_, t_.id_tile * 4);
  }

  __aicore__ inline void Process() {
    LocalTensor<float> tile = tileBuf_.Get<float>();
    LocalTensor<int32_t> mask = maskBuf_.Get<int32_t>();
    LocalTensor<int32_t> ids = idBuf_.Get<int32_t>();
    int64_t end = start_ + count_;
    for (int64_t pos = start_; pos < end;) {
      int64_t row, seg_end;
      rp::Segment(t_, pos, end, &row, &seg_end);
      int64_t hits = 0;
      if (rp::IdsFitOnce(t_) && t_.length > 0) {  // the row's ids, once per segment
        LoadIds(ids, row * t_.length, t_.length);
        hits = rp::CompactHits(t_, ids, t_.length, row, pos, seg_end);
      }
      for (int64_t i = 0; i < rp::SegmentTiles(t_, seg_end - pos); ++i) {
        int64_t t0 = pos + i * t_.tile;
        int64_t n = rp::TileLen(t_, seg_end - pos, i);
        LoadTile(tile, mask, t0, n);
        if (rp::IdsFitOnce(t_)) {
          hits = rp::ApplyHits(ids, hits, i * t_.tile, n, tile, mask, penalty_);
        } else {
          for (int64_t k = 0; k < rp::IdTiles(t_); ++k) {
            int64_t m = rp::IdTileLen(t_, k);
            LoadIds(ids, row * t_.length + k * t_.id_tile, m);
            rp::ApplyIds(t_, ids, m, row, t0, n, tile, mask, penalty_);
          }
        }
        msds::Sync<HardEvent::S_MTE3>();
        DataCopyExtParams op{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
        DataCopyPad(yGm_[t0], tile, op);
      }
      pos = seg_end;
    }
  }

 private:
  // Logits [t0, t0 + n) -> UB, the mask cleared.
  __aicore__ inline void LoadTile(const LocalTensor<float>& tile, const LocalTensor<int32_t>& mask, int64_t t0,
                                  int64_t n) {
    msds::Sync<HardEvent::MTE3_MTE2>();  // the previous tile has left UB
    msds::Sync<HardEvent::S_MTE2>();     // and the scalar unit is done with it
    DataCopyExtParams tp{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
    DataCopyPadExtParams<float> pad{false, 0, 0, 0.0f};
    DataCopyPad(tile, logitsGm_[t0], tp, pad);
    msds::Sync<HardEvent::S_V>();  // scalar reads of the previous mask are done
    Duplicate(mask, static_cast<int32_t>(0), static_cast<int32_t>(rp::MaskWords(n)));
    msds::Sync<HardEvent::V_S>();
    msds::Sync<HardEvent::MTE2_S>();
  }

  __aicore__ inline void LoadIds(const LocalTensor<int32_t>& ids, int64_t offset, int64_t m) {
    msds::Sync<HardEvent::S_MTE2>();  // scalar reads of the last id load are done
    DataCopyExtParams ip{1, static_cast<uint32_t>(m * 4), 0, 0, 0};
    DataCopyPadExtParams<int32_t> pad{false, 0, 0, 0};
    DataCopyPad(ids, idsGm_[offset], ip, pad);
    msds::Sync<HardEvent::MTE2_S>();
  }

  rp::PenaltyTiling t_;
  float penalty_ = 1.0f;
  int64_t start_ = 0;
  int64_t count_ = 0;
  TPipe pipe_;
  TBuf<TPosition::VECOUT> tileBuf_;  // GM -> UB -> GM
  TBuf<TPosition::VECIN> idBuf_;     // GM -> UB
  TBuf<TPosition::VECCALC> maskBuf_;
  GlobalTensor<float> logitsGm_, yGm_;
  GlobalTensor<int32_t> idsGm_;
};

extern "C" __global__ __aicore__ void repetition_penalty(GM_ADDR logits, GM_ADDR ids, GM_ADDR y, GM_ADDR workspace,
                                                         GM_ADDR tiling) {
  GET_TILING_DATA(td, tiling);
  rp::PenaltyTiling t;
  t.batch = td.batch;
  t.vocab = td.vocab;
  t.length = td.length;
  t.total = td.total;
  t.used_cores = td.used_cores;
  t.chunk = td.chunk;
  t.last_chunk = td.last_chunk;
  t.tile = td.tile;
  t.id_tile = td.id_tile;
  RepetitionPenaltyKernel op;
  op.Init(logits, ids, y, t, td.penalty);
  if (TILING_KEY_IS(1)) {
    op.Process();
  }
}
