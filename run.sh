#!/usr/bin/env bash
# Builds sparsekv (Release) and starts the daemon in the foreground with the embedded default
# configuration, its data under ./var. Extra arguments go to sparsekvd.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/setup.sh
./scripts/configure.sh build/release Release
cmake --build build/release -j2 --target sparsekvd sparsekv_cli sparsekv_python
mkdir -p var
exec build/release/api/sparsekvd --data-dir ./var "$@"
