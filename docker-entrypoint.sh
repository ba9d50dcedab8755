#!/usr/bin/env bash
# Entrypoint of the Atlas 800T A2 image: set up the Ascend environment, then run ms-deepseek.
#
# CANN's set_env.sh exports ASCEND_HOME_PATH, LD_LIBRARY_PATH, PYTHONPATH (te, hccl) and
# PATH; it is sourced here so every command in the container (ms-deepseek, msrun,
# python) sees the same toolkit. The driver's libraries are mounted from the host
# (-v /usr/local/Ascend/driver:/usr/local/Ascend/driver) and added when present.
set -eo pipefail

# CANN's env scripts read "$1" (a sourced script sees the caller's arguments: here, the
# container's command), read unset variables, and end on probes such as `[ -d ... ] && ...`
# that return non-zero on a tree without that component: source them with no arguments of
# ours, errexit and nounset off, and ignore their status (ops/build_ascend.sh does the same).
source_env() {  # $1 = script, then the arguments it should see (none by default)
  local script="$1"
  shift
  set +eu
  # shellcheck disable=SC1090
  source "$script" "$@"
  set -e
  return 0
}

# The CANN 9.0.0 base image's own ENTRYPOINT sources, in this order:
# ascend-toolkit/set_env.sh, $ASCEND_HOME_PATH/share/info/ascendnpu-ir/bin/set_env.sh (the
# BiSheng compiler) and nnal/atb/set_env.sh; ours replaces it, so it sources the same.
toolkit=""
for setenv in "${CANN_SET_ENV:-}" \
              /usr/local/Ascend/ascend-toolkit/set_env.sh \
              /usr/local/Ascend/cann/set_env.sh \
              /usr/local/Ascend/cann-*/set_env.sh; do
  if [ -n "$setenv" ] && [ -f "$setenv" ]; then toolkit="$setenv"; break; fi
done
if [ -n "$toolkit" ]; then
  source_env "$toolkit"
else
  echo "ms-deepseek entrypoint: warning: no CANN set_env.sh found; Ascend devices will not work" >&2
fi
bisheng="${ASCEND_HOME_PATH:-/nonexistent}/share/info/ascendnpu-ir/bin/set_env.sh"
if [ -f "$bisheng" ]; then
  source_env "$bisheng"
fi
# NNAL (ATB): the image sources nnal/atb/set_env.sh with no option, which picks cxx_abi_1 when
# python3 has no torch (cann/ascend-transformer-boost scripts/set_env.sh, get_cxx_abi_option), and
# its ENV sets ATB_HOME_PATH=.../atb/cxx_abi_1 with that folder's lib on LD_LIBRARY_PATH. Ours asks
# for cxx_abi_0: MindSpore 2.9.0's ATB kernels (lib/plugin/ascend/libmindspore_atb_kernels.so and
# libmindspore_pyboost_atb_kernels.so, both linking libatb.so) use the pre-C++11 library ABI only
# (std::string as `Ss`, no std::__cxx11 symbol: nm -D), the ABI of cxx_abi_0's libatb.so. The
# image's cxx_abi_1 folders are then dropped from LD_LIBRARY_PATH and PATH, so the loader cannot
# pick that libatb.so first.
without_cxx_abi_1() {  # $1 = a colon-separated path list
  printf '%s' "$1" | tr ':' '\n' | { grep -v '/cxx_abi_1\(/\|$\)' || true; } | paste -sd: -
}
nnal="${CANN_NNAL_SET_ENV:-/usr/local/Ascend/nnal/atb/set_env.sh}"
if [ -f "$nnal" ]; then
  source_env "$nnal" --cxx_abi=0
  LD_LIBRARY_PATH="$(without_cxx_abi_1 "${LD_LIBRARY_PATH:-}")"
  PATH="$(without_cxx_abi_1 "$PATH")"
  export LD_LIBRARY_PATH PATH
fi
for lib in /usr/local/Ascend/driver/lib64/driver /usr/local/Ascend/driver/lib64/common /usr/local/Ascend/driver/lib64; do
  if [ -d "$lib" ] && [[ ":${LD_LIBRARY_PATH:-}:" != *":$lib:"* ]]; then
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done

# The run line mounts the host's npu-smi (Dockerfile header); a bind mount of a path the host does
# not have (/usr/local/sbin/npu-smi on some hosts, /usr/local/bin/npu-smi on others) leaves an empty
# folder in the container, and doctor would only say that npu-smi failed.
IFS=: read -r -a path_dirs <<< "$PATH"
for dir in "${path_dirs[@]}"; do
  if [ -n "$dir" ] && [ -d "$dir/npu-smi" ]; then
    echo "ms-deepseek entrypoint: warning: $dir/npu-smi is a folder, not npu-smi: the host has no npu-smi at that path (mount \"\$(command -v npu-smi)\" from the host, as the Dockerfile's run line does)" >&2
  fi
done

# ms-deepseek commands (read from the package, so new ones need no change here) go to
# ms-deepseek; anything else (bash, msrun, python ...) runs as given.
commands=" $(python3 -c 'from ms_deepseek.cli import COMMANDS; print(" ".join(COMMANDS))') "
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ] || [[ "$commands" == *" $1 "* ]]; then
  exec ms-deepseek "$@"
fi
exec "$@"
