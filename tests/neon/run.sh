#!/usr/bin/env bash
# Builds the codecs and their tests for AArch64 (tests/neon/CMakeLists.txt) into BUILD_DIR and
# runs them under qemu-aarch64, so that the NEON path is held to the scalar reference bit for bit
# on this x86-64 machine. Extra arguments go to the test binary (for example --gtest_filter=...).
#   tests/neon/run.sh BUILD_DIR [ARGS...]
# Needs g++-aarch64-linux-gnu and qemu-user (scripts/setup.sh installs them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: tests/neon/run.sh BUILD_DIR [ARGS...]}
shift
for tool in aarch64-linux-gnu-g++ qemu-aarch64 cmake ninja; do
  command -v "$tool" >/dev/null || {
    echo "tests/neon/run.sh: $tool is missing (scripts/setup.sh installs it)" >&2
    exit 1
  }
done
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
  -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ "${launcher[@]}" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log" >&2; exit 1; }
ninja -C "$build" -j2 >"$build.build.log" 2>&1 || { tail -n 60 "$build.build.log" >&2; exit 1; }
exec qemu-aarch64 "$build/sparsekv_compress_tests_neon" "$@"
