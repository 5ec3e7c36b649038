#!/usr/bin/env bash
# configure.sh BUILD_DIR BUILD_TYPE [extra cmake args...]: one place that knows our CMake flags.
set -euo pipefail
dir=$1; type=$2; shift 2
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$type" "${launcher[@]}" "$@" >/dev/null
else
  cmake -S . -B "$dir" "$@" >/dev/null
fi
