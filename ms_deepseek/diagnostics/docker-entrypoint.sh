#!/usr/bin/env bash
# Entrypoint of the Atlas 800T A2 image: set up the Ascend environment, then run ms-deepseek.
#
# CANN's set_env.sh exports ASCEND_HOME_PATH, LD_LIBRARY_PATH, PYTHONPATH (te, hccl) and
# PATH; it is sourced here so every command in the container (ms-deepseek, msrun,
# python) sees the same toolkit. The driver's libraries are mounted from the host
# (-v /usr/local/Ascend/driver:/usr/local/Ascend/driver) and added when present.
set -eo pipefail

for setenv in "${CANN_SET_ENV:-}" \
              /usr/local/Ascend/cann/set_env.sh \
              /usr/local/Ascend/ascend-toolkit/set_env.sh \
              /usr/local/Ascend/cann-*/set_env.sh; do
  if [ -n "$setenv" ] && [ -f "$setenv" ]; then
    # shellcheck disable=SC1090
    source "$setenv"
    break
  fi
done
if [ -z "${ASCEND_HOME_PATH:-}" ]; then
  echo "ms-deepseek entrypoint: warning: no CANN set_env.sh found; Ascend devices will not work" >&2
fi
if [ -f /usr/local/Ascend/nnal/atb/set_env.sh ]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/nnal/atb/set_env.sh --cxx_abi=0 || true
fi
for lib in /usr/local/Ascend/driver/lib64/driver /usr/local/Ascend/driver/lib64/common /usr/local/Ascend/driver/lib64; do
  if [ -d "$lib" ] && [[ ":${LD_LIBRARY_PATH:-}:" != *":$lib:"* ]]; then
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done

# ms-deepseek commands (read from the package, so new ones need no change here) go to
# ms-deepseek; anything else (bash, msrun, python ...) runs as given.
commands=" $(python3 -c 'from ms_deepseek.cli import COMMANDS; print(" ".join(COMMANDS))') "
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ] || [[ "$commands" == *" $1 "* ]]; then
  exec ms-deepseek "$@"
fi
exec "$@"
