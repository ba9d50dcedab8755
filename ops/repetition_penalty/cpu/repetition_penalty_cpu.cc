// RepetitionPenalty CPU kernel: ops.Custom(func_type="aot") entry point.
//
// RepetitionPenaltyCpu inputs:  logits float32 [B, V], ids int32 [B, L],
//                               penalty float32 [1], cfg int64 [core_num, ub_bytes]
//                      output:  out float32 [B, V]
// Walks the schedule of repetition_penalty_tiling_logic.h and runs its per-id steps (the
// same functions the NPU kernel runs on UB): each core copies its one-row segments tile by
// tile and penalises the elements named by the row's ids, each at most once (the "done"
// mask), from the tile's own copy. Ids outside [0, V) are ignored (IdInVocab), as on the
// NPU kernel and the reference.
#include "msds_aot_cpu.h"
#include "repetition_penalty_tiling_logic.h"

using msds::cpu::DType;
using msds::repetition_penalty::PenaltyTiling;

MSDS_DEFINE_LAST_ERROR()

namespace {

// A UB buffer: GetValue / SetValue like an Ascend C LocalTensor.
template <typename T>
struct Ub {
  std::vector<T> data;
  explicit Ub(int64_t n) : data(static_cast<size_t>(n)) {}
  T GetValue(int64_t i) const { return data[static_cast<size_t>(i)]; }
  void SetValue(int64_t i, T v) { data[static_cast<size_t>(i)] = v; }
};

void PenaliseCore(const PenaltyTiling& t, int64_t core, const float* logits, const int32_t* ids, float penalty,
                  float* out) {
  namespace rp = msds::repetition_penalty;
  int64_t start, count;
  rp::CoreRange(t, core, &start, &count);
  Ub<float> tile(t.tile);
  Ub<int32_t> mask(rp::MaskWords(t.tile));
  Ub<int32_t> id_buf(t.id_tile);
  auto load_ids = [&](int64_t offset, int64_t m) { std::copy(ids + offset, ids + offset + m, id_buf.data.begin()); };
  int64_t end = start + count;
  for (int64_t pos = start; pos < end;) {
    int64_t row, seg_end;
    rp::Segment(t, pos, end, &row, &seg_end);
    int64_t hits = 0;
    if (rp::IdsFitOnce(t) && t.length > 0) {
      load_ids(row * t.length, t.length);
      hits = rp::CompactHits(t, id_buf, t.length, row, pos, seg_end);
    }
    for (int64_t i = 0; i < rp::SegmentTiles(t, seg_end - pos); ++i) {
      int64_t t0 = pos + i * t.tile, n = rp::TileLen(t, seg_end - pos, i);
      std::copy(logits + t0, logits + t0 + n, tile.data.begin());
      std::fill(mask.data.begin(), mask.data.begin() + rp::MaskWords(n), 0);
      if (rp::IdsFitOnce(t)) {
        hits = rp::ApplyHits(id_buf, hits, i * t.tile, n, tile, mask, penalty);
      } else {
        for (int64_t k = 0; k < rp::IdTiles(t); ++k) {
          int64_t m = rp::IdTileLen(t, k);
          load_ids(row * t.length + k * t.id_tile, m);
          rp::ApplyIds(t, id_buf, m, row, t0, n, tile, mask, penalty);
        }
      }
      std::copy(tile.data.begin(), tile.data.begin() + n, out + t0);
    }
    pos = seg_end;
  }
}

}  // namespace

extern "C" int RepetitionPenaltyCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                    void* stream, void* extra) {
  if (nparam != 5) return MsdsFail("RepetitionPenalty: expected 4 inputs and 1 output");
  if (ndims[0] != 2 || ndims[1] != 2 || shapes[1][0] != shapes[0][0]) {
    return MsdsFail("RepetitionPenalty: logits must be [B, V] and ids [B, L]");
  }
  if (msds::cpu::ParseDType(dtypes[0]) != DType::kFloat32 || msds::cpu::ParseDType(dtypes[1]) != DType::kInt32 ||
      msds::cpu::ParseDType(dtypes[2]) != DType::kFloat32 || msds::cpu::ParseDType(dtypes[3]) != DType::kInt64 ||
      msds::cpu::NumElements(ndims[3], shapes[3]) != 2) {
    return MsdsFail("RepetitionPenalty: expected float32 logits, int32 ids, float32 penalty, int64 [core_num, ub_bytes]");
  }
  const float* logits = static_cast<const float*>(params[0]);
  const int32_t* ids = static_cast<const int32_t*>(params[1]);
  float penalty = static_cast<const float*>(params[2])[0];
  const int64_t* cfg = static_cast<const int64_t*>(params[3]);
  float* out = static_cast<float*>(params[4]);
  int64_t batch = shapes[0][0], vocab = shapes[0][1], length = shapes[1][1];
  if (!(penalty > 0.0f)) return MsdsFail("RepetitionPenalty: penalty must be > 0");
  PenaltyTiling t;
  int status = msds::repetition_penalty::ComputeTiling(batch, vocab, length, cfg[0], cfg[1], &t);
  if (status != msds::kOk) return MsdsFail("RepetitionPenalty: tiling failed with status " + std::to_string(status));
  msds::cpu::ForEachCore(t.used_cores, t.total, [&](int64_t core) { PenaliseCore(t, core, logits, ids, penalty, out); });
  return 0;
}

// Test hooks. in = [batch, vocab, length, core_num, ub_bytes].
extern "C" int RepetitionPenaltyTilingQuery(const int64_t* in, int64_t* out) {
  PenaltyTiling t;
  int status = msds::repetition_penalty::ComputeTiling(in[0], in[1], in[2], in[3], in[4], &t);
  if (status != msds::kOk) return status;
  int64_t fields[] = {t.batch, t.vocab, t.length, t.total, t.used_cores, t.chunk, t.last_chunk, t.tile, t.id_tile};
  std::copy(std::begin(fields), std::end(fields), out);
  return 0;
}

// Writes (core, start, len, first_row, last_row) for every logits tile, in order.
extern "C" int64_t RepetitionPenaltyScheduleQuery(const int64_t* in, int64_t* out, int64_t cap) {
  namespace rp = msds::repetition_penalty;
  PenaltyTiling t;
  if (rp::ComputeTiling(in[0], in[1], in[2], in[3], in[4], &t) != msds::kOk) return -1;
  int64_t n = 0;
  for (int64_t core = 0; core < t.used_cores; ++core) {
    int64_t start, count;
    rp::CoreRange(t, core, &start, &count);
    for (int64_t pos = start; pos < start + count;) {
      int64_t row, seg_end;
      rp::Segment(t, pos, start + count, &row, &seg_end);
      for (int64_t i = 0; i < rp::SegmentTiles(t, seg_end - pos); ++i) {
        if (n >= cap) return -1;
        int64_t t0 = pos + i * t.tile, len = rp::TileLen(t, seg_end - pos, i);
        int64_t rec[] = {core, t0, len, (t0) / t.vocab, (t0 + len - 1) / t.vocab};
        std::copy(std::begin(rec), std::end(rec), out + 5 * n);
        ++n;
      }
      pos = seg_end;
    }
  }
  return n;
}
