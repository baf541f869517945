#!/usr/bin/env bash
# Installs the Debian packages moe builds and tests with, only those missing, and the npm packages
# of the Hugging Face tokenizer reference (tests/tokenizer_ref) when they are not installed yet.
#   bash scripts/setup.sh          # what the build and the test suite need
#   bash scripts/setup.sh --fuzz   # and clang with libFuzzer's runtime (scripts/fuzz.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PKGS=(build-essential cmake pkg-config libopenblas-openmp-dev libhwy-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libfmt-dev libgtest-dev libgmock-dev
      libbenchmark-dev python3-torch python3-numpy libpcre2-dev libcpp-httplib-dev curl)
for arg in "$@"; do
  case $arg in
    --fuzz) PKGS+=(clang libclang-rt-dev) ;;
    *) echo "setup.sh: unknown option '$arg' (expected --fuzz)" >&2; exit 2 ;;
  esac
done
# node and npm run the tokenizer reference; Debian's, unless a node with npm is there already
# (asking apt for Debian's npm next to another node package would try to replace it).
if ! command -v node > /dev/null 2>&1 || ! command -v npm > /dev/null 2>&1; then
  PKGS+=(nodejs npm)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Hugging Face's tokenizers (Rust, as a Node binding, and tokenizers.js) and the released
# DeepSeek-V3 tokenizer files, pinned by tests/tokenizer_ref/package-lock.json. Skipped when
# node_modules matches the lock file; without the npm registry the reference tests skip.
REF="$ROOT/tests/tokenizer_ref"
STAMP="$REF/node_modules/.moe-lock.sha256"
if [ -f "$REF/package-lock.json" ] && command -v npm > /dev/null 2>&1; then
  want="$(sha256sum "$REF/package-lock.json" | cut -d' ' -f1)"
  if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    echo "setup: npm ci in tests/tokenizer_ref (the Hugging Face tokenizer reference)"
    if (cd "$REF" && timeout 900 npm ci --no-audit --no-fund --loglevel=error); then
      echo "$want" > "$STAMP"
    else
      echo "setup: warning: npm ci failed (no npm registry?); the tokenizer reference tests will skip" >&2
    fi
  fi
fi
