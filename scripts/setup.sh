#!/usr/bin/env bash
# Installs what sparsekv needs to build and test, from Debian 12's packages, if it is missing.
# Safe to run again: it installs nothing when everything is there.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  librocksdb-dev liburing-dev libboost-dev libboost-system-dev libxxhash-dev libssl-dev
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  g++-aarch64-linux-gnu qemu-user
  clang libclang-rt-14-dev
  fio redis-server redis-tools libhiredis-dev
  mkdocs mkdocs-material prometheus python3-matplotlib
  python3 python3-dev pybind11-dev libdlpack-dev python3-pytest python3-numpy python3-torch python3-redis
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev python3-zmq python3-msgpack
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "setup: missing packages (${missing[*]}) and not root" >&2; exit 1; }
    sudo=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
