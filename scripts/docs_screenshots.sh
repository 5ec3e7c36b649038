#!/usr/bin/env bash
# Builds the manual and saves screenshots of its front page and a plot page with headless
# Chromium (Debian's chromium), so a person can look at what the manual shows without a browser:
#   scripts/docs_screenshots.sh [OUT_DIR]      (default: build/site-screenshots)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/site-screenshots}
if ! command -v chromium >/dev/null; then
  # Like ./run.sh and ./test.sh, set up what is missing on a Debian machine when run as root.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
  else
    echo "docs_screenshots: chromium is missing (apt-get install chromium)" >&2
    exit 1
  fi
fi
command -v mkdocs >/dev/null || { echo "docs_screenshots: mkdocs is missing (scripts/setup.sh installs it)" >&2; exit 1; }
mkdocs build --strict --config-file mkdocs.yml --site-dir build/site >/dev/null 2>&1
mkdir -p "$out"
out=$(cd "$out" && pwd)
shot() {  # page (a path under build/site), image name
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
    --screenshot="$out/$2" "file://$PWD/build/site/$1" >/dev/null 2>&1
  [ -s "$out/$2" ] || { echo "docs_screenshots: no screenshot of $1" >&2; exit 1; }
  echo "$out/$2"
}
shot index.html front-page.png
shot benchmarks/index.html plot-page.png
