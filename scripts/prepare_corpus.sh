#!/usr/bin/env bash
# Writes data/kjv.txt, the demo corpus: the King James Bible (public domain) from Debian's
# bible-kjv package, one verse per line without its reference, a blank line between books.
# Installs the package if missing; leaves an existing data/kjv.txt alone.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=data/kjv.txt
if [ -s "$OUT" ]; then
  echo "prepare_corpus: $OUT already exists"
  exit 0
fi
if ! command -v bible > /dev/null; then
  echo "prepare_corpus: installing bible-kjv"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends bible-kjv
fi
mkdir -p data
# Each line reads "Ge1:1 In the beginning ..."; the book abbreviation changes at a book
# boundary, which is where the blank line goes.
bible -f "gen1:1-rev22:21" | awk '
  match($0, /^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ /) {
    ref = substr($0, 1, RLENGTH - 1)
    book = ref; sub(/[0-9]+:[0-9]+$/, "", book)
    if (NR > 1 && book != last) print ""
    last = book
    print substr($0, RLENGTH + 1)
    next
  }
  { print }' > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "prepare_corpus: wrote $OUT ($(wc -c < "$OUT") bytes, $(grep -c . "$OUT") verses)"
