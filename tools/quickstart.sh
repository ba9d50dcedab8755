#!/usr/bin/env bash
# The README's main-job command. On a fresh machine, one command:
#   1. creates .venv if missing and installs the package from the pinned requirements,
#   2. prepares the embedded default corpus (Python standard library sources with a
#      4096-token sentencepiece tokenizer; cached under ~/.cache/ms_deepseek),
#   3. trains recipes/tiny-cpu.yaml on CPU (a ~4.2M-parameter DeepSeek-V2: MLA + MoE),
#   4. prints the final loss, where the checkpoint and the metrics are, and a short
#      sample from the trained model.
# Extra arguments go to `ms-deepseek train`, e.g.  bash tools/quickstart.sh --set train.steps=100
# RUN_DIR chooses the run folder (default: runs/tiny-cpu-<date>-<time>).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$(date +%s)

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
echo "== installing ms-deepseek and its pinned requirements into .venv"
# pip's own notices (index locations, resolver chatter) go to a log shown only if the install fails
INSTALL_LOG=.venv/ms-deepseek-install.log
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
if ! { "${PIP[@]}" install --upgrade pip && "${PIP[@]}" install -e .; } > "$INSTALL_LOG" 2>&1; then
  cat "$INSTALL_LOG" >&2
  echo "quickstart: the install failed; the full log is $INSTALL_LOG" >&2
  exit 1
fi

# MindSpore prints errors only unless GLOG_v is set or --verbose is passed (ms-deepseek does this
# itself; the corpus step below calls the same helper).
RECIPE=recipes/tiny-cpu.yaml
RUN_DIR=${RUN_DIR:-runs/tiny-cpu-$(date +%Y%m%d-%H%M%S)}
MSD=.venv/bin/ms-deepseek

echo "== preparing the embedded default corpus"
.venv/bin/python - "$RECIPE" <<'PYEOF'
import sys
from ms_deepseek.core.runtime import quiet_defaults
quiet_defaults()
from ms_deepseek.data.sources import ensure_embedded_default
from ms_deepseek.train.preflight import load_checked_recipe

folder = ensure_embedded_default(load_checked_recipe(sys.argv[1]).data)
print(f"corpus: {folder}")
PYEOF

echo "== training $RECIPE -> $RUN_DIR"
"$MSD" train "$RECIPE" --output "$RUN_DIR" "$@"

echo "== sampling from the trained model"
"$MSD" generate "$RUN_DIR" --prompt "def " --max-new-tokens 60 --temperature 0.7 --top-k 20 --seed 0

echo "== done in $(( $(date +%s) - START ))s: run folder $RUN_DIR (metrics.jsonl, checkpoints/, tb/)"
echo "   report: $MSD report $RUN_DIR -o $RUN_DIR/report.html"
