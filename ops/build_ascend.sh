#!/usr/bin/env bash
# Build and install the ms_deepseek Ascend C operators (ExpertLookup, Fp32Softmax,
# RepetitionPenalty) on a CANN host, with MindSpore's custom operator compiler.
#
#   ops/build_ascend.sh [--soc ascend910b] [--install-path DIR] [--cann PATH]
#
# MindSpore's builder (mindspore/lib/plugin/ascend/custom_compiler/setup.py)
# expects one flat op_host folder and one flat op_kernel folder, so this script
# stages every operator's op_host/*, op_kernel/* and the shared CANN-free headers
# (ops/common/*.h, ops/<op>/common/*.h) into a temporary project, builds the
# custom OPP package under vendor "ms_deepseek" and installs it into
# --install-path (default: $HOME/.cache/ms_deepseek/ascend_opp). Then:
#
#   export ASCEND_CUSTOM_OPP_PATH=<install-path>/vendors/ms_deepseek:$ASCEND_CUSTOM_OPP_PATH
#
# and ms_deepseek.ops picks the kernels up on device_target Ascend.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OPS=(expert_lookup fp32_softmax repetition_penalty)
SOC="ascend910b"
INSTALL="${HOME}/.cache/ms_deepseek/ascend_opp"
CANN="${ASCEND_HOME_PATH:-/usr/local/Ascend/ascend-toolkit/latest}"
PYTHON="${PYTHON:-python3}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --soc) SOC="$2"; shift 2 ;;
    --install-path) INSTALL="$2"; shift 2 ;;
    --cann) CANN="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "build_ascend.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [[ ! -d "$CANN" ]]; then
  echo "build_ascend.sh: CANN not found at $CANN (pass --cann or set ASCEND_HOME_PATH)" >&2
  exit 1
fi
MS_DIR="$("$PYTHON" -c 'import mindspore, os; print(os.path.dirname(mindspore.__file__))')"
COMPILER="$MS_DIR/lib/plugin/ascend/custom_compiler"
if [[ ! -f "$COMPILER/setup.py" ]]; then
  echo "build_ascend.sh: MindSpore custom compiler not found at $COMPILER" >&2
  exit 1
fi

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/op_host" "$STAGE/op_kernel" "$INSTALL"
for op in "${OPS[@]}"; do
  cp "$HERE/$op/op_host/"*.cpp "$HERE/$op/op_host/"*.h "$STAGE/op_host/"
  cp "$HERE/$op/op_kernel/"*.cpp "$STAGE/op_kernel/"
  cp "$HERE/$op/common/"*.h "$STAGE/op_host/"
  cp "$HERE/$op/common/"*.h "$STAGE/op_kernel/"
done
cp "$HERE/common/msds_kernel_common.h" "$STAGE/op_host/"
cp "$HERE/common/msds_kernel_common.h" "$HERE/common/msds_ascendc_sync.h" "$STAGE/op_kernel/"

source "$CANN/bin/setenv.bash" >/dev/null 2>&1 || source "$CANN/set_env.sh" >/dev/null 2>&1 || true
cd "$COMPILER"
"$PYTHON" setup.py \
  --op_host_path "$STAGE/op_host" \
  --op_kernel_path "$STAGE/op_kernel" \
  --soc_version "$SOC" \
  --ascend_cann_package_path "$CANN" \
  --vendor_name ms_deepseek \
  --install_path "$INSTALL" \
  --clear

echo "Installed. Now run:"
echo "  export ASCEND_CUSTOM_OPP_PATH=$INSTALL/vendors/ms_deepseek:\${ASCEND_CUSTOM_OPP_PATH:-}"
