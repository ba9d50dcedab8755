#!/usr/bin/env bash
# The README's test command: create .venv if missing, install the package with its
# test extra from the pinned files, install headless Chromium for the report test
# (Debian package, when root and missing), run ruff (lint and format check, pyproject.toml),
# then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium: tests/unit/diagnostics/test_report.py's rendering test will fail" >&2
fi
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
exec .venv/bin/python -m pytest tests "$@"
