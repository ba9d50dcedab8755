#!/usr/bin/env bash
# The README's test commands.
#   bash tools/test.sh          the default tier: lint, format, unit, CLI and repository tests, one small compile and
#                               one small execution (tests marked slow or heavy left out)
#   bash tools/test.sh --full   the full tier, what CI runs: every test but the heavy ones (each recipe's compile and
#                               execution, the planted mistakes, msrun jobs, the docs' commands); then the tests
#                               marked `lines` again on the other MindSpore line (2.10, in .venv-ms2.10), and
#                               tools/compare_lines.py fails on any difference between the two lines' results
# Both create .venv if missing, install the package with its test extra from the pinned files, install headless
# Chromium for the report test (Debian package, when root and missing), run ruff (lint and format check,
# pyproject.toml), then pytest: the default tier on two processes (pytest-xdist; MS_DEEPSEEK_TEST_PROCESSES=0 runs
# it in one), with --full then the slow tests in two processes (tests/compile in one, the rest in the other);
# other arguments go to pytest. tests/helpers/tiers.py says what each tier holds.
set -euo pipefail
cd "$(dirname "$0")/.."
default=(-m "not heavy and not slow" -n "${MS_DEEPSEEK_TEST_PROCESSES:-2}")
full=0
args=()
for a in "$@"; do
  if [ "$a" = "--full" ]; then full=1; else args+=("$a"); fi
done
OTHER_LINE=2.10
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium: tests/unit/report/test_report.py's rendering test will fail" >&2
fi
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
if [ "$full" = 0 ]; then
  exec .venv/bin/python -m pytest tests "${default[@]}" ${args[@]+"${args[@]}"}
fi
rm -rf .lines
export MS_DEEPSEEK_LINE_RESULTS="$PWD/.lines/default"
.venv/bin/python -m pytest tests "${default[@]}" ${args[@]+"${args[@]}"}
# The slow tier in two processes side by side: the MindSpore compiles and executions of tests/compile beside the
# rest (trainings and msrun jobs, which spend much of their time waiting on workers, timeouts and heartbeats, so the
# compiles take the cores they leave). The second one's report follows the first's; an interrupt stops both.
others_log=$(mktemp)
.venv/bin/python -m pytest tests -m "slow and not heavy" --ignore=tests/compile ${args[@]+"${args[@]}"} \
  >"$others_log" 2>&1 &
others=$!
trap 'kill -- "$others" 2>/dev/null' INT TERM
compile_status=0
.venv/bin/python -m pytest tests/compile -m "slow and not heavy" ${args[@]+"${args[@]}"} || compile_status=$?
others_status=0
wait "$others" || others_status=$?
echo "The slow tier's other tests (beside tests/compile):"
cat "$others_log"
rm -f "$others_log"
if [ "$compile_status" != 0 ] || [ "$others_status" != 0 ]; then
  echo "slow tier failed: tests/compile exited $compile_status, the others $others_status" >&2
  exit 1
fi
unset MS_DEEPSEEK_LINE_RESULTS
if [ "${#args[@]}" -gt 0 ]; then
  echo "pytest options given (${args[*]}): the MindSpore $OTHER_LINE line's comparison needs the whole tier; not run"
  exit 0
fi
other=".venv-ms$OTHER_LINE"
echo "MindSpore $OTHER_LINE line: installing into $other, then the tests marked lines"
[ -x "$other/bin/python" ] || "$PY" -m venv "$other"
"$other/bin/python" -m pip install -q --upgrade pip
MS_DEEPSEEK_MINDSPORE="$OTHER_LINE" "$other/bin/python" -m pip install -q -e '.[test]'
MS_DEEPSEEK_LINE_RESULTS="$PWD/.lines/$OTHER_LINE" "$other/bin/python" -m pytest tests -m lines -p no:cacheprovider
.venv/bin/python tools/compare_lines.py .lines/default ".lines/$OTHER_LINE"
