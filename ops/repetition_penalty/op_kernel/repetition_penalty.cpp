// RepetitionPenalty Ascend C kernel: y = logits with every seen id penalised once.
//
// A thin translation of repetition_penalty_tiling_logic.h. Core c owns the flat
// range CoreRange(c) of [B * V] and walks it in tiles: copy the tile into UB,
// scan the ids of the rows it overlaps (loaded `id_tile` at a time), overwrite
// the tile elements they name with Penalise(original logit) read from the
// input in GM, copy the tile out. No element is written by two cores and the
// original logits are never modified, so duplicates and ordering are harmless.
// Ids outside [0, V) are skipped on the device (rp::IdInVocab).
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
    pipe_.InitBuffer(tileBuf_, rp::kBufferNum * t_.tile * 4);
    pipe_.InitBuffer(idBuf_, rp::kBufferNum * t_.id_tile * 4);
  }

  __aicore__ inline void Process() {
    LocalTensor<float> tile = tileBuf_.Get<float>();
    LocalTensor<int32_t> ids = idBuf_.Get<int32_t>();
    DataCopyPadExtParams<float> fpad{false, 0, 0, 0};
    DataCopyPadExtParams<int32_t> ipad{false, 0, 0, 0};
    for (int64_t i = 0; i < rp::Tiles(t_, count_); ++i) {
      int64_t t0 = start_ + i * t_.tile;
      int64_t n = rp::TileLen(t_, count_, i);
      msds::Sync<HardEvent::MTE3_MTE2>();  // the previous tile has left UB
      DataCopyExtParams tp{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
      DataCopyPad(tile, logitsGm_[t0], tp, fpad);
      msds::Sync<HardEvent::MTE2_S>();
      int64_t first, last;
      rp::TileRows(t_, t0, n, &first, &last);
      for (int64_t b = first; b <= last; ++b) {
        for (int64_t k = 0; k < rp::IdTiles(t_); ++k) {
          int64_t m = rp::IdTileLen(t_, k);
          msds::Sync<HardEvent::S_MTE2>();  // scalar reads of the last id load are done
          DataCopyExtParams ip{1, static_cast<uint32_t>(m * 4), 0, 0, 0};
          DataCopyPad(ids, idsGm_[b * t_.length + k * t_.id_tile], ip, ipad);
          msds::Sync<HardEvent::MTE2_S>();
          for (int64_t j = 0; j < m; ++j) {
            int32_t id = ids.GetValue(j);
            if (!rp::IdInVocab(t_, id)) continue;  // ignored: never another row's logit
            int64_t flat = b * t_.vocab + id;
            if (flat >= t0 && flat < t0 + n) {
              tile.SetValue(flat - t0, rp::Penalise(logitsGm_.GetValue(flat), penalty_));
            }
          }
        }
      }
      msds::Sync<HardEvent::S_MTE3>();
      DataCopyExtParams op{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
      DataCopyPad(yGm_[t0], tile, op);
    }
  }

 private:
  rp::PenaltyTiling t_;
  float penalty_ = 1.0f;
  int64_t start_ = 0;
  int64_t count_ = 0;
  TPipe pipe_;
  TBuf<TPosition::VECCALC> tileBuf_, idBuf_;
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
