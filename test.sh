#!/usr/bin/env bash
# Builds sparsekv and runs the test suite through ctest.
#   ./test.sh                     RelWithDebInfo build in build/test
#   SANITIZE=address ./test.sh    ASan+UBSan build in build/asan
#   SANITIZE=thread ./test.sh     TSan build in build/tsan
# Extra arguments go to ctest (for example -R PagePool).
set -euo pipefail
cd "$(dirname "$0")"
./scripts/setup.sh
san=${SANITIZE:-}
case "$san" in
  "") dir=build/test; type=RelWithDebInfo ;;
  address) dir=build/asan; type=Debug ;;
  thread) dir=build/tsan; type=RelWithDebInfo ;;
  *) echo "test.sh: SANITIZE must be address or thread, not '$san'" >&2; exit 2 ;;
esac
# Warnings are errors in the build CI runs (this one, unsanitized), so that a local run refuses
# what CI would; the sanitizer builds only warn (their instrumentation brings warnings of its own).
werror=OFF
[ -z "$san" ] && werror=ON
[ -n "${CI:-}" ] && werror=ON
./scripts/configure.sh "$dir" "$type" -DSPARSEKV_SANITIZE="$san" -DSPARSEKV_WERROR="$werror"
cmake --build "$dir" -j2
# Races inside uninstrumented system libraries only (see the file).
[ "$san" = thread ] && export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp ${TSAN_OPTIONS:-}"
cd "$dir"
ctest --output-on-failure -j2 --timeout 600 "$@"
