#!/usr/bin/env bash
# Build and install the ms_deepseek Ascend C operators (ExpertLookup, Fp32Softmax,
# RepetitionPenalty) on a CANN host.
#
#   ops/build_ascend.sh [--soc ascend910b] [--install-path DIR] [--cann PATH] [--keep]
#
# Stages every operator's op_host/*, op_kernel/* and the shared CANN-free headers
# (ops/common/*.h, ops/<op>/common/*.h) into one custom-operator project made from
# CANN's Ascend C project template (the steps of MindSpore's
# lib/plugin/ascend/custom_compiler/setup.py, done here: see below), builds the OPP
# package under vendor "ms_deepseek" with the project's build.sh and installs it
# non-interactively into --install-path (default: $HOME/.cache/ms_deepseek/ascend_opp).
# Then:
#
#   export ASCEND_CUSTOM_OPP_PATH=<install-path>/vendors/ms_deepseek:$ASCEND_CUSTOM_OPP_PATH
#
# and ms_deepseek.ops picks the kernels up on device_target Ascend.
# --keep leaves the staged project (and its build.log) in place for inspection.
#
# Why not MindSpore's setup.py as is: it writes its project into the MindSpore
# wheel's own folder (read-only installs fail, two builds race), copies the template's
# cmake helpers to "/cmake/util/" (an absolute os.path.join), and installs the .run
# without --quiet with its output in install.log, so re-installing into an existing
# vendor folder waits forever on an invisible prompt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OPS=(expert_lookup fp32_softmax repetition_penalty)
SOC="ascend910b"
INSTALL="${HOME}/.cache/ms_deepseek/ascend_opp"
CANN="${ASCEND_HOME_PATH:-/usr/local/Ascend/ascend-toolkit/latest}"
PYTHON="${PYTHON:-python3}"
KEEP=0

die() { echo "build_ascend.sh: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --soc) [[ $# -ge 2 ]] || die "--soc needs a value"; SOC="$2"; shift 2 ;;
    --install-path) [[ $# -ge 2 ]] || die "--install-path needs a value"; INSTALL="$2"; shift 2 ;;
    --cann) [[ $# -ge 2 ]] || die "--cann needs a value"; CANN="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "build_ascend.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

# Every OpDef (ops/*/op_host/*.cpp) registers AICore configs for these two SoCs only: a
# package built for another SoC would hold no kernel (tests/repo/test_build_ascend.py checks
# that this list and the OpDefs' AddConfig calls agree).
case "$SOC" in
  ascend910b|ascend910_93) ;;
  *) die "--soc: unsupported SoC '$SOC': the operators are registered for ascend910b (Atlas 800T A2) and ascend910_93 (Atlas A3) only" ;;
esac
[[ -d "$CANN" ]] || die "CANN not found at $CANN (pass --cann or set ASCEND_HOME_PATH)"
CANN_REAL="$(cd "$CANN" && pwd -P)"

# --- CANN environment -------------------------------------------------------------------
# CANN's env scripts (8.x bin/setenv.bash, 9.0 set_env.sh) read "$1" and "$LD_LIBRARY_PATH"
# unguarded: sourced under `set -u` they kill this shell (silently, when the output is
# discarded), and their last line can be a probe (`[ -d ... ] && ...`) that returns non-zero
# on a tree without that component. Source with errexit/nounset off and no positional
# arguments, keep the output, and judge by the result: ASCEND_OPP_PATH must name a folder.
# Where the script is: 8.x bin/setenv.bash and 9.0 set_env.sh inside the toolkit, looked up
# before and after resolving links (ascend-toolkit/latest -> ../cann-9.0.0), and the
# ascend-toolkit/set_env.sh beside it. The CANN 9.0.0 base image (cann-container-image,
# cann/9.0.0-910b-ubuntu22.04-py3.11/Dockerfile) sets ASCEND_HOME_PATH=/usr/local/Ascend/cann-9.0.0
# and ASCEND_TOOLKIT_LATEST_HOME=/usr/local/Ascend/ascend-toolkit/latest and sources
# /usr/local/Ascend/ascend-toolkit/set_env.sh, the script beside ${ASCEND_TOOLKIT_LATEST_HOME}.
# A script outside the CANN tree counts only when its `latest` (or ASCEND_TOOLKIT_LATEST_HOME)
# resolves to the CANN being built with, so another release's script is never sourced.
# "<link>/../set_env.sh" is not that file when `latest` is a symlink (the kernel resolves ".."
# from the link's target: ascend-toolkit/latest/.. is /usr/local/Ascend): take the dirname.
real_dir() { (cd "$1" 2>/dev/null && pwd -P); }
CANDIDATES=("$CANN/bin/setenv.bash" "$CANN/set_env.sh" "$(dirname "$CANN")/set_env.sh"
            "$CANN_REAL/bin/setenv.bash" "$CANN_REAL/set_env.sh")
for latest in "${ASCEND_TOOLKIT_LATEST_HOME:-}" "$(dirname "$CANN_REAL")/ascend-toolkit/latest"; do
  if [[ -n "$latest" && "$(real_dir "$latest")" == "$CANN_REAL" ]]; then
    CANDIDATES+=("$(dirname "${latest%/}")/set_env.sh")
  fi
done
ENV_SCRIPT=""
for candidate in "${CANDIDATES[@]}"; do
  if [[ -f "$candidate" ]]; then ENV_SCRIPT="$candidate"; break; fi
done
if [[ -n "$ENV_SCRIPT" ]]; then
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
  set --
  set +eu
  # shellcheck disable=SC1090
  source "$ENV_SCRIPT"
  env_status=$?
  set -eu
  if [[ ! -d "${ASCEND_OPP_PATH:-}" ]]; then
    die "sourcing $ENV_SCRIPT (status $env_status) set no ASCEND_OPP_PATH folder: not a usable CANN environment"
  fi
  [[ $env_status -eq 0 ]] || echo "build_ascend.sh: note: $ENV_SCRIPT returned $env_status (one of its own probes); the CANN environment is set, continuing" >&2
elif [[ -d "${ASCEND_OPP_PATH:-}" && -n "${ASCEND_HOME_PATH:-}" && "$(real_dir "$ASCEND_HOME_PATH")" == "$CANN_REAL" ]]; then
  # No script found, but the environment already names this CANN (a base image's ENV does).
  echo "build_ascend.sh: note: no CANN env script found; using the environment already set for $CANN_REAL (ASCEND_OPP_PATH=$ASCEND_OPP_PATH)" >&2
else
  die "no CANN env script (${CANDIDATES[*]}) and no CANN environment set for $CANN_REAL (ASCEND_HOME_PATH, ASCEND_OPP_PATH): is this a CANN toolkit?"
fi
CANN="$CANN_REAL"
export ASCEND_HOME_PATH="${ASCEND_HOME_PATH:-$CANN}"

# --- project from CANN's template -------------------------------------------------------
TEMPLATES="$CANN/tools/op_project_templates/ascendc"
SAMPLE="$CANN/tools/msopgen/template/operator_demo_projects/ascendc_operator_sample"
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/ms_deepseek_ascend_build.XXXXXX")"
if [[ $KEEP -eq 1 ]]; then
  trap 'echo "build_ascend.sh: staged project kept in $STAGE/project" >&2' EXIT
else
  trap 'rm -rf "$STAGE"' EXIT
fi
PROJECT="$STAGE/project"
# Links resolved (cp -L), as MindSpore's setup.py gets them (shutil.copytree follows links):
# in CANN 9.0.0 customize/cmake/util/{preset_parse.py, ascendc_bin_param_build.py, ...} are
# relative links to ../../../common/util/..., which would dangle in the staging folder, and
# common/ holds only util/; in 8.x common/ holds the helper files themselves. Both end up
# as regular files in the project's cmake/util/.
if [[ -d "$TEMPLATES/customize" && -d "$TEMPLATES/common" ]]; then
  cp -rL "$TEMPLATES/customize" "$PROJECT" 2>"$STAGE/stage.err" \
    || die "cannot copy the template $TEMPLATES/customize: $(head -n 1 "$STAGE/stage.err")"
  mkdir -p "$PROJECT/cmake/util"
  for item in "$TEMPLATES/common"/*; do
    if [[ -d "$item" && "${item##*/}" == util ]]; then src="$item/."; else src="$item"; fi
    cp -rL "$src" "$PROJECT/cmake/util/" 2>"$STAGE/stage.err" \
      || die "cannot copy $item from the template: $(head -n 1 "$STAGE/stage.err")"
  done
elif [[ -d "$SAMPLE" ]]; then
  cp -rL "$SAMPLE" "$PROJECT" 2>"$STAGE/stage.err" \
    || die "cannot copy the sample project $SAMPLE: $(head -n 1 "$STAGE/stage.err")"
else
  die "no Ascend C project template in $CANN ($TEMPLATES/customize or $SAMPLE)"
fi
chmod -R u+rwX "$PROJECT"
[[ -f "$PROJECT/CMakePresets.json" && -f "$PROJECT/build.sh" ]] \
  || die "the project template in $CANN has no CMakePresets.json / build.sh"
# build.sh runs cmake/util/preset_parse.py first and func.cmake the other helpers there.
[[ -f "$PROJECT/cmake/util/preset_parse.py" ]] \
  || die "the staged project has no cmake/util/preset_parse.py (the template's build.sh needs it; template: $TEMPLATES)"
mkdir -p "$PROJECT/op_host" "$PROJECT/op_kernel"
# The template's demo operator must not be built with ours.
find "$PROJECT/op_host" "$PROJECT/op_kernel" -maxdepth 1 -type f \( -name '*.cpp' -o -name '*.h' \) -delete

for op in "${OPS[@]}"; do
  cp "$HERE/$op/op_host/"*.cpp "$HERE/$op/op_host/"*.h "$PROJECT/op_host/"
  cp "$HERE/$op/op_kernel/"*.cpp "$PROJECT/op_kernel/"
  cp "$HERE/$op/common/"*.h "$PROJECT/op_host/"
  cp "$HERE/$op/common/"*.h "$PROJECT/op_kernel/"
done
cp "$HERE/common/msds_kernel_common.h" "$PROJECT/op_host/"
cp "$HERE/common/msds_kernel_common.h" "$HERE/common/msds_ascendc_sync.h" "$PROJECT/op_kernel/"

"$PYTHON" - "$PROJECT/CMakePresets.json" "$CANN" "$SOC" <<'EOF' || die "cannot set the CANN path, SoC and vendor in $PROJECT/CMakePresets.json"
import json, sys
path, cann, soc = sys.argv[1:]
with open(path, encoding="utf-8") as f:
    data = json.load(f)
variables = data["configurePresets"][0]["cacheVariables"]
for key, value in (("ASCEND_CANN_PACKAGE_PATH", cann), ("ASCEND_COMPUTE_UNIT", soc),
                   ("vendor_name", "ms_deepseek")):
    entry = variables.get(key)
    if isinstance(entry, dict):
        entry["value"] = value
    else:
        variables[key] = {"type": "STRING", "value": value}
with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=4)
EOF

# --- build ------------------------------------------------------------------------------
LOG="$STAGE/build.log"
echo "build_ascend.sh: building ${OPS[*]} for $SOC with $CANN ..."
# The template's build.sh must not see another vendor's operators.
if ! (cd "$PROJECT" && unset ASCEND_CUSTOM_OPP_PATH && bash build.sh) >"$LOG" 2>&1 </dev/null; then
  tail -n 40 "$LOG" >&2
  [[ $KEEP -eq 1 ]] && die "build failed (full log: $LOG)"
  die "build failed (last lines above; rerun with --keep for the full log)"
fi
shopt -s nullglob
RUNS=("$PROJECT"/build_out/*.run)
shopt -u nullglob
[[ ${#RUNS[@]} -eq 1 ]] || die "expected one .run package in $PROJECT/build_out, found ${#RUNS[@]}"

# --- install ----------------------------------------------------------------------------
# --quiet: the installer asks before replacing an existing vendor folder; stdin closed so a
# prompt we did not foresee fails instead of hanging.
mkdir -p "$INSTALL"
INSTALL="$(cd "$INSTALL" && pwd -P)"
if ! bash "${RUNS[0]}" --quiet --install-path="$INSTALL" </dev/null >"$STAGE/install.log" 2>&1; then
  tail -n 40 "$STAGE/install.log" >&2
  die "installing ${RUNS[0]##*/} into $INSTALL failed"
fi
[[ -d "$INSTALL/vendors/ms_deepseek" ]] || die "the installer left no $INSTALL/vendors/ms_deepseek"

echo "Installed into $INSTALL/vendors/ms_deepseek. Now run:"
echo "  export ASCEND_CUSTOM_OPP_PATH=$INSTALL/vendors/ms_deepseek:\${ASCEND_CUSTOM_OPP_PATH:-}"
