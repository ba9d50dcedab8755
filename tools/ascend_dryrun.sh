#!/usr/bin/env bash
# The device ladder's second rung, on a host with CANN (the project's Docker image on any x86
# machine; no NPU needed): MindSpore's dry run at level 1 (compile + one simulated step with its
# memory accounting) or, with NPUs, 2-3. The first rung, level 0 (compile only), is
# `ms-deepseek plan --recipe R --compile`, which runs on any machine (stub CANN libraries) and
# checks the compiled layouts and strategies against the plan; this script refuses --level 0.
#
#   tools/ascend_dryrun.sh RECIPE [--layers N] [--level 0|1|2|3] [--out DIR]
#                          [--set SECTION.KEY=VALUE ...] [--cann PATH] [--print-only]
#
# For every pipeline stage of the recipe's layout it runs one worker of `ms-deepseek train`
# with MindSpore's simulator (MS_SIMULATION_LEVEL, default 1: compile + per-op memory
# statistics, CPU only), RANK_SIZE = the recipe's world size and RANK_ID = the stage's first
# rank, MS_DEEPSEEK_DEVICE=Ascend (a host without NPUs has no npu-smi, so ms-deepseek would
# pick CPU, where MindSpore refuses a distributed dry run), on the model at full width and
# reduced depth (--layers, default 2 per stage: every
# stage holds a dense and/or MoE layer at the real width and the real parallel degrees).
# Each rank's log, strategy file (the trainer's strategy/rank_NNNNN.ckpt) and peak memory
# ("Used peak memory usage" / "Actual peak memory usage" in the INFO log, GLOG_v=1) land in
# DIR/rank_<id>/, and a table prints them beside the planner's estimate for that stage of
# the same reduced model (`ms-deepseek plan --recipe ... --json`), plus DIR/summary.json.
#
# --print-only: print the layout, the planner's figures and the exact commands and
# environment each rank would run, then exit (works without CANN; tested on CPU).
# Levels (MindSpore 2.9 tutorial debug/dryrun, "DryRun"): 0 compiles only and 1 adds each
# operator's input/output memory: both use CPU only, so they run on any CANN host. 2 adds
# operator workspaces and 3 runs the compute kernels: both also need the compute resources
# of the simulated cards (NPUs), so this script refuses them on a host without npu-smi.
# Other --set overrides pass through to both the planner and the workers, e.g.
# --set model.source=deepseek-v2 when the recipe's checkpoint is not on this host, and
# --set data.path=null --set data.format=pretrain (the embedded corpus) when its data is not.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
die() { echo "ascend_dryrun.sh: $*" >&2; exit 2; }

RECIPE=""
LAYERS=""
LEVEL=1
OUT=""
PRINT_ONLY=0
CANN="${ASCEND_HOME_PATH:-/usr/local/Ascend/ascend-toolkit/latest}"
SETS=()
if [[ -x "$REPO/.venv/bin/ms-deepseek" ]]; then MSD="$REPO/.venv/bin/ms-deepseek"; else MSD="ms-deepseek"; fi
MSD="${MS_DEEPSEEK_CLI:-$MSD}"
PYTHON="${PYTHON:-python3}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --layers) [[ $# -ge 2 ]] || die "--layers needs a value"; LAYERS="$2"; shift 2 ;;
    --level) [[ $# -ge 2 ]] || die "--level needs a value"; LEVEL="$2"; shift 2 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a value"; OUT="$2"; shift 2 ;;
    --set) [[ $# -ge 2 ]] || die "--set needs SECTION.KEY=VALUE"; SETS+=("$2"); shift 2 ;;
    --cann) [[ $# -ge 2 ]] || die "--cann needs a value"; CANN="$2"; shift 2 ;;
    --print-only) PRINT_ONLY=1; shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [[ -z "$RECIPE" ]] || die "one recipe only (got $RECIPE and $1)"; RECIPE="$1"; shift ;;
  esac
done

[[ -n "$RECIPE" ]] || die "RECIPE: required (a recipes/*.yaml file; see --help)"
[[ -f "$RECIPE" ]] || die "RECIPE: no such file: $RECIPE"
[[ "$LEVEL" =~ ^[0-3]$ ]] || die "--level: must be 0, 1, 2 or 3, got '$LEVEL'"
# level 0 (compile only) runs on any machine, CANN or not: one documented way
[[ "$LEVEL" != 0 ]] || die "--level 0 (compile only) is \`ms-deepseek plan --recipe $RECIPE --compile\` (any machine, no CANN needed); this script runs levels 1-3 on a CANN host"
if [[ -n "$LAYERS" && ! "$LAYERS" =~ ^[1-9][0-9]*$ ]]; then die "--layers: must be a positive integer, got '$LAYERS'"; fi
for s in ${SETS[@]+"${SETS[@]}"}; do
  [[ "$s" == *.*=* ]] || die "--set: expected SECTION.KEY=VALUE, got '$s'"
done
NAME="$(basename "$RECIPE" .yaml)"
OUT="${OUT:-dryrun/$NAME}"

plan_json() {  # $1 = layers (empty: the recipe's depth)
  local args=(plan --recipe "$RECIPE" --json)
  for s in ${SETS[@]+"${SETS[@]}"}; do args+=(--set "$s"); done
  if [[ -n "$1" ]]; then args+=(--set "model.overrides.num_hidden_layers=$1" --set "parallel.stage_layers=null"); fi
  local out status=0
  out="$("$MSD" "${args[@]}" 2>"$PLAN_ERR")" || status=$?
  # plan exits 1 for "does not fit" (still a JSON answer), 2 for bad input
  if [[ $status -gt 1 || -z "$out" ]]; then
    cat "$PLAN_ERR" >&2
    die "the planner refused the recipe (ms-deepseek ${args[*]})"
  fi
  printf '%s' "$out"
}
TMPD="$(mktemp -d)"
PLAN_ERR="$TMPD/plan.err"
trap 'rm -rf "$TMPD"' EXIT

plan_json "" >"$TMPD/full.json"
if ! "$PYTHON" - "$TMPD/full.json" <<'EOF'
import json, sys
problems = json.load(open(sys.argv[1]))["problems"]
for p in problems:
    print(f"ascend_dryrun.sh: {p}", file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
then
  die "the planner refused the recipe's layout (problems above)"
fi
read -r DP TP PP WORLD DEPTH < <("$PYTHON" - "$TMPD/full.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
lay = d["layout"]
print(lay["dp"], lay["tp"], lay["pp"], lay["dp"] * lay["tp"] * lay["pp"], d["model"]["layers"])
EOF
)
LAYERS="${LAYERS:-$((2 * PP))}"
(( LAYERS >= PP )) || die "--layers: $LAYERS is fewer than the $PP pipeline stages"
(( LAYERS <= DEPTH )) || die "--layers: $LAYERS is more than the model's $DEPTH layers"
plan_json "$LAYERS" >"$TMPD/reduced.json"

echo "recipe $RECIPE: dp$DP tp$TP pp$PP, world $WORLD; dry run at $LAYERS of $DEPTH layers, MS_SIMULATION_LEVEL=$LEVEL"
"$PYTHON" - "$TMPD/full.json" "$TMPD/reduced.json" <<'EOF'
import json, sys
full, reduced = (json.load(open(p)) for p in sys.argv[1:3])
lo, hi = full["tokens_per_s_per_npu_range"]
mem = full["memory_gb"]
print(f"planner, full depth: {mem['total']:.1f} GB per NPU (stage {mem['stage']}), {lo:.0f}-{hi:.0f} tokens/s/NPU")
per_stage = ", ".join(f"{s['total']:.1f}" for s in reduced["stage_memory_gb"])
print(f"planner, {reduced['model']['layers']} layers: GB per NPU by stage: {per_stage}")
EOF

RANKS=()
for ((s = 0; s < PP; s++)); do RANKS+=($((s * DP * TP))); done   # first rank of each stage

rank_command() {  # $1 = rank id -> the worker's argv, one word per line
  local rank="$1"
  printf '%s\n' "$MSD" train "$RECIPE" --output "$OUT/rank_$rank" --max-steps 1 --force --quiet \
    --set "model.overrides.num_hidden_layers=$LAYERS" --set "parallel.stage_layers=null"
  for s in ${SETS[@]+"${SETS[@]}"}; do printf '%s\n' --set "$s"; done
}

if [[ $PRINT_ONLY -eq 1 ]]; then
  for rank in "${RANKS[@]}"; do
    mapfile -t cmd < <(rank_command "$rank")
    echo "stage $((rank / (DP * TP))): env MS_DEEPSEEK_DEVICE=Ascend MS_SIMULATION_LEVEL=$LEVEL RANK_SIZE=$WORLD RANK_ID=$rank GLOG_v=1" \
      "MS_ALLOC_CONF=memory_tracker:True $(printf '%q ' "${cmd[@]}")> $OUT/rank_$rank/dryrun.log 2>&1"
  done
  exit 0
fi

# --- a real dry run: needs CANN (MindSpore's simulator loads libge_runner.so) -------------
[[ -d "$CANN" ]] || die "CANN not found at $CANN (pass --cann or set ASCEND_HOME_PATH; --print-only needs none)"
if (( LEVEL >= 2 )) && ! command -v npu-smi >/dev/null; then
  die "--level $LEVEL: levels 2 and 3 need the simulated cards' compute resources (NPUs) and this host has no npu-smi; use --level 0 or 1"
fi
ENV_SCRIPT=""
for candidate in "$CANN/bin/setenv.bash" "$CANN/set_env.sh" "$CANN/../set_env.sh"; do
  if [[ -f "$candidate" ]]; then ENV_SCRIPT="$candidate"; break; fi
done
[[ -n "$ENV_SCRIPT" ]] || die "no bin/setenv.bash or set_env.sh under $CANN"
# As ops/build_ascend.sh: CANN's env scripts read $1 and $LD_LIBRARY_PATH unguarded and may end
# on a probe that returns non-zero; judge by ASCEND_OPP_PATH, not by the status.
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
saved_args=("$@")
set --
set +eu
# shellcheck disable=SC1090
source "$ENV_SCRIPT"
env_status=$?
set -eu
set -- ${saved_args[@]+"${saved_args[@]}"}
[[ -d "${ASCEND_OPP_PATH:-}" ]] \
  || die "sourcing $ENV_SCRIPT (status $env_status) set no ASCEND_OPP_PATH folder: not a usable CANN environment"

mkdir -p "$OUT"
failed=0
for rank in "${RANKS[@]}"; do
  mkdir -p "$OUT/rank_$rank"
  mapfile -t cmd < <(rank_command "$rank")
  echo "stage $((rank / (DP * TP))): RANK_ID=$rank ..."
  if ! env MS_DEEPSEEK_DEVICE=Ascend MS_SIMULATION_LEVEL="$LEVEL" RANK_SIZE="$WORLD" RANK_ID="$rank" GLOG_v=1 \
      MS_ALLOC_CONF=memory_tracker:True "${cmd[@]}" >"$OUT/rank_$rank/dryrun.log" 2>&1 </dev/null; then
    echo "  rank $rank failed: last lines of $OUT/rank_$rank/dryrun.log:" >&2
    tail -n 15 "$OUT/rank_$rank/dryrun.log" >&2
    failed=1
  fi
done

"$PYTHON" - "$TMPD/reduced.json" "$OUT" "$DP" "$TP" <<'EOF'
import json, re, sys
from pathlib import Path
plan = json.load(open(sys.argv[1]))
out, dp, tp = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def fmt(v):
    return f"{v:.1f}" if v is not None else "n/a"


rows = []
print(f"{'stage':>5} {'rank':>6} {'dry-run peak GB':>16} {'with fragments':>15} {'planner GB':>11}  strategy file")
for stage, est in enumerate(plan["stage_memory_gb"]):
    rank = stage * dp * tp
    folder = out / f"rank_{rank}"
    log = (folder / "dryrun.log").read_text(errors="replace") if (folder / "dryrun.log").is_file() else ""
    used = re.findall(r"Used peak memory usage \(without fragments\): (\d+)M", log)
    actual = re.findall(r"Actual peak memory usage \(with fragments\): (\d+)M", log)
    strategy = sorted(folder.glob("strategy/*.ckpt"))
    row = {"stage": stage, "rank": rank, "planner_gb": est["total"],
           "dryrun_peak_gb": int(used[-1]) / 1024 if used else None,
           "dryrun_peak_with_fragments_gb": int(actual[-1]) / 1024 if actual else None,
           "strategy_file": str(strategy[0]) if strategy else None}
    rows.append(row)
    print(f"{stage:>5} {rank:>6} {fmt(row['dryrun_peak_gb']):>16} {fmt(row['dryrun_peak_with_fragments_gb']):>15} "
          f"{est['total']:>11.1f}  {row['strategy_file'] or 'none'}")
(out / "summary.json").write_text(json.dumps({"layers": plan["model"]["layers"], "ranks": rows}, indent=2))
print(f"summary: {out / 'summary.json'}")
EOF
exit $failed
