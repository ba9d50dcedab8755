// RepetitionPenalty host side: op definition, shape/dtype inference and tiling.
// The tiling arithmetic is repetition_penalty_tiling_logic.h (shared with the
// CPU kernel and tested on CPU). Inputs: logits [B, V] float32, ids [B, L] int32;
// attribute: penalty (float > 0, checked by the Python caller).
#include "repetition_penalty_tiling.h"
#include "repetition_penalty_tiling_logic.h"
#include "register/op_def_registry.h"
#include "tiling/platform/platform_ascendc.h"

namespace optiling {

static ge::graphStatus RepetitionPenaltyTiling(gert::TilingContext* context) {
  auto platform = platform_ascendc::PlatformAscendC(context->GetPlatformInfo());
  uint64_t ub_bytes = 0;
  platform.GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub_bytes);
  int64_t core_num = platform.GetCoreNumAiv();

  const gert::Shape& logits = context->GetInputShape(0)->GetStorageShape();
  const gert::Shape& ids = context->GetInputShape(1)->GetStorageShape();
  if (logits.GetDimNum() != 2 || ids.GetDimNum() != 2) return ge::GRAPH_FAILED;
  float penalty = *context->GetAttrs()->GetAttrPointer<float>(0);

  msds::repetition_penalty::PenaltyTiling t;
  if (msds::repetition_penalty::ComputeTiling(logits.GetDim(0), logits.GetDim(1), ids.GetDim(1), core_num,
                                              static_cast<int64_t>(ub_bytes), &t) != msds::kOk) {
    return ge::GRAPH_FAILED;
  }
  RepetitionPenaltyTilingData data;
  data.set_batch(t.batch);
  data.set_vocab(t.vocab);
  data.set_length(t.length);
  data.set_total(t.total);
  data.set_used_cores(t.used_cores);
  data.set_chunk(t.chunk);
  data.set_last_chunk(t.last_chunk);
  data.set_tile(t.tile);
  data.set_id_tile(t.id_tile);
  data.set_penalty(penalty);

  context->SetBlockDim(t.used_cores > 0 ? t.used_cores : 1);
  context->SetTilingKey(1);
  data.SaveToBuffer(context->GetRawTilingData()->GetData(), context->GetRawTilingData()->GetCapacity());
  context->GetRawTilingData()->SetDataSize(data.GetDataSize());
  size_t* workspace = context->GetWorkspaceSizes(1);
  workspace[0] = platform.GetLibApiWorkSpaceSize();
  return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ge {

static graphStatus RepetitionPenaltyInferShape(gert::InferShapeContext* context) {
  *context->GetOutputShape(0) = *context->GetInputShape(0);
  return GRAPH_SUCCESS;
}

static graphStatus RepetitionPenaltyInferDataType(gert::InferDataTypeContext* context) {
  context->SetOutputDataType(0, DT_FLOAT);
  return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class RepetitionPenalty : public OpDef {
 public:
  explicit RepetitionPenalty(const char* name) : OpDef(name) {
    this->Input("logits").ParamType(REQUIRED).DataType({ge::DT_FLOAT}).Format({ge::FORMAT_ND}).UnknownShapeFormat({ge::FORMAT_ND});
    this->Input("ids").ParamType(REQUIRED).DataType({ge::DT_INT32}).Format({ge::FORMAT_ND}).UnknownShapeFormat({ge::FORMAT_ND});
    this->Output("y").ParamType(REQUIRED).DataType({ge::DT_FLOAT}).Format({ge::FORMAT_ND}).UnknownShapeFormat({ge::FORMAT_ND});
    this->Attr("penalty").Float();
    this->SetInferShape(ge::RepetitionPenaltyInferShape).SetInferDataType(ge::RepetitionPenaltyInferDataType);
    this->AICore().SetTiling(optiling::RepetitionPenaltyTiling);
    // Both names are set here rather than left to CANN's closed opbuild, which derives them from the
    // op type (how does Fp32Softmax split at the digit?). CANN's own ops do the same where the type
    // has a digit boundary: Conv3DV2 sets opFile.value "conv3d_v2" and opInterface.value "conv3dv2"
    // (hicann/ops-nn conv/conv3d_v2/op_host/conv3d_v2_def.cpp).
    //  * opFile.value: the template compiles op_kernel/<opFile.value>.cpp (asc-tools v9.0.0,
    //    op_project_templates/ascendc/common/util/ascendc_impl_build.py; its write_adapt only prints
    //    "[ERROR] ... does not found" for a missing file and the build goes on without the kernel).
    //  * opInterface.value: the kernel's entry name. The same script's _write_impl writes it as the
    //    origin_func_name the compiler renames per tiling key (asc-devkit v9.0.0,
    //    asc_op_compiler/compile_op.py: -D<origin_func_name>=<origin_func_name>_<key>_tilingkey), so
    //    the extern "C" function in op_kernel/<opFile>.cpp must carry exactly this name.
    // The flags are the ones AddConfig(soc) alone sets (metadef register/opdef/op_def_aicore.cc).
    OpAICoreConfig config;
    config.DynamicCompileStaticFlag(true)
        .DynamicFormatFlag(true)
        .DynamicRankSupportFlag(true)
        .DynamicShapeSupportFlag(true)
        .NeedCheckSupportFlag(false)
        .PrecisionReduceFlag(true)
        .ExtendCfgInfo("opFile.value", "repetition_penalty")
        .ExtendCfgInfo("opInterface.value", "repetition_penalty");
    this->AICore().AddConfig("ascend910b", config);
    this->AICore().AddConfig("ascend910_93", config);
  }
};

OP_ADD(RepetitionPenalty);

}  // namespace ops
