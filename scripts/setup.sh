#!/usr/bin/env bash
# Installs the Debian packages moe builds and tests with, only those missing.
set -euo pipefail
PKGS=(build-essential cmake pkg-config libopenblas-openmp-dev libhwy-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libfmt-dev libgtest-dev libgmock-dev
      libbenchmark-dev python3-torch python3-numpy)
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
