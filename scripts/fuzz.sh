#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, ASan + UBSan) and runs each for a bounded
# time on a copy of its seed corpus: the checked-in seeds of tests/fuzz/corpus/<target> plus the
# test fixtures of its format. Exits non-zero on any finding (crash, sanitizer report, leak,
# timeout, an allocation over the limit), whose input is left under the work directory.
#
#   bash scripts/fuzz.sh                          # every target, FUZZ_TIME seconds each (CI)
#   FUZZ_RUNS=10000000 bash scripts/fuzz.sh       # the long run: that many executions each
#   bash scripts/fuzz.sh tokenizer serve_request  # some targets only
#   FUZZ_RESUME=1 FUZZ_RUNS=1000000 bash scripts/fuzz.sh serve_request  # go on from the last corpus
#
# Environment: BUILD_DIR (build-fuzz), FUZZ_TIME (10 s), FUZZ_RUNS (unset: time-bounded),
# FUZZ_RESUME (1: keep the work directory's corpus from an earlier run instead of reseeding),
# FUZZ_WORK_DIR ($BUILD_DIR/fuzz-work: corpora, logs and findings), FUZZ_ARGS (more libFuzzer
# flags), MOE_MAX_LOAD_BYTES (512M: the engine's cap on one load, below libFuzzer's limits),
# FUZZ_MALLOC_LIMIT_MB (1024), FUZZ_RSS_LIMIT_MB (2048).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-fuzz}
FUZZ_TIME=${FUZZ_TIME:-10}
FUZZ_RUNS=${FUZZ_RUNS:-}
WORK=${FUZZ_WORK_DIR:-$BUILD_DIR/fuzz-work}
# A parser that checks its sizes refuses anything above the cap before allocating it; libFuzzer
# reports any single allocation above -malloc_limit_mb (twice the cap) and a process above
# -rss_limit_mb, so a size that slips past the checks is a finding, not a slow run.
export MOE_MAX_LOAD_BYTES=${MOE_MAX_LOAD_BYTES:-512M}
MALLOC_LIMIT_MB=${FUZZ_MALLOC_LIMIT_MB:-1024}
RSS_LIMIT_MB=${FUZZ_RSS_LIMIT_MB:-2048}
# The targets that need a directory write their files there: memory is faster than the disk.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
ALL_TARGETS="safetensors_header safetensors_index model_config train_config token_file tokenizer
             tokenizer_encode tiktoken adapter_config serve_request"
TARGETS=${*:-$ALL_TARGETS}

bash scripts/setup.sh --fuzz
command -v clang++ > /dev/null || { echo "fuzz.sh: clang++ is missing (apt-get install clang libclang-rt-dev)" >&2; exit 1; }
cmake -S . -B "$BUILD_DIR" -DMOE_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
build_targets=()
for t in $TARGETS; do build_targets+=(--target "fuzz_$t"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" "${build_targets[@]}"

# The fixtures each format is seeded with (small ones: the corpus stays quick to replay), each
# named after its path.
copy_flat() { while read -r f; do cp "$f" "$1/$(echo "$f" | tr / _)"; done; }
fixture_seeds() {
  local t=$1 out=$2
  case $t in
    safetensors_header) find tests/fixtures -name '*.safetensors' -size -64k | copy_flat "$out" ;;
    safetensors_index)  find tests/fixtures -name 'model.safetensors.index.json' | copy_flat "$out" ;;
    model_config)       { find tests/fixtures -name config.json; ls configs/models/*.json; } | copy_flat "$out" ;;
    train_config)       ls configs/*.toml | copy_flat "$out" ;;
    adapter_config)     find tests/fixtures -name adapter_config.json | copy_flat "$out" ;;
    tiktoken)
      # tiktoken.model NUL tokenizer_config.json NUL text
      d=tests/fixtures/tokenizers/tiktoken_kimi_small
      { cat "$d/tiktoken.model"; printf '\0'; cat "$d/tokenizer_config.json"; printf '\0[BOS]in the beginning 2024 '; } \
        > "$out/tiktoken_kimi_small"
      { cat "$d/tiktoken.model"; printf '\0\0caf\xc3\xa9 \xff\xfe'; } > "$out/tiktoken_kimi_small_no_config"
      # A few hundred ranks (the byte tokens and some merges): mutations of a 50 KB table run
      # about 40 times slower.
      { head -n 300 "$d/tiktoken.model"; tail -n 40 "$d/tiktoken.model"; printf '\0'
        cat "$d/tokenizer_config.json"; printf '\0[BOS]in the beginning 2024 '; } > "$out/tiktoken_kimi_300_ranks" ;;
    tokenizer|tokenizer_encode)
      # tokenizer: tokenizer.json NUL tokenizer_config.json NUL text; tokenizer_encode: texts.
      python3 - "$t" "$out" <<'PY'
import json, pathlib, sys
target, out = sys.argv[1], pathlib.Path(sys.argv[2])
for d in sorted(pathlib.Path('tests/fixtures/tokenizers').iterdir()):
    if not (d / 'tokenizer.json').exists():
        continue
    lines = (d / 'expected.jsonl').read_text(encoding='utf-8').split('\n')
    texts = [json.loads(l).get('text', '') for l in lines if l.strip()]
    if target == 'tokenizer':
        config = (d / 'tokenizer_config.json').read_bytes() if (d / 'tokenizer_config.json').exists() else b''
        (out / d.name).write_bytes((d / 'tokenizer.json').read_bytes() + b'\0' + config + b'\0' +
                                   texts[0].encode())
    else:
        for i, text in enumerate(texts[:24]):
            (out / f'{d.name}_{i}').write_bytes(text.encode('utf-8', 'surrogatepass'))
PY
      ;;
  esac
}

failed=()
for t in $TARGETS; do
  dir=$WORK/$t
  if [ "${FUZZ_RESUME:-0}" = 1 ] && [ -n "$(ls -A "$dir/corpus" 2>/dev/null)" ]; then
    rm -rf "$dir/findings"
    mkdir -p "$dir/findings"
  else
    rm -rf "$dir"
    mkdir -p "$dir/corpus" "$dir/findings"
    if [ -d "tests/fuzz/corpus/$t" ]; then cp tests/fuzz/corpus/"$t"/* "$dir/corpus/"; fi
    fixture_seeds "$t" "$dir/corpus"
  fi
  bound=(-max_total_time="$FUZZ_TIME") what="$FUZZ_TIME s"
  [ -n "$FUZZ_RUNS" ] && bound=(-runs="$FUZZ_RUNS") what="$FUZZ_RUNS runs"
  echo "== fuzz_$t: $(ls "$dir/corpus" | wc -l) seeds, $what"
  start=$(date +%s)
  # shellcheck disable=SC2086
  if "$BUILD_DIR/tests/fuzz/fuzz_$t" "${bound[@]}" -timeout=10 -rss_limit_mb="$RSS_LIMIT_MB" \
       -malloc_limit_mb="$MALLOC_LIMIT_MB" -print_final_stats=1 -artifact_prefix="$dir/findings/" \
       ${FUZZ_ARGS:-} "$dir/corpus" > "$dir/log" 2>&1; then
    grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$dir/log" |
      tr '\n' ' ' | sed 's/stat:://g'
    echo "corpus $(ls "$dir/corpus" | wc -l) files, $(($(date +%s) - start)) s"
  else
    failed+=("$t")
    echo "fuzz_$t: FINDING (log: $dir/log, input: $(ls "$dir"/findings/* 2>/dev/null | head -1))"
    grep -E 'ERROR|SUMMARY|fuzz finding|runtime error|Test unit written' "$dir/log" | head -20 || true
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: findings in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: no findings in $(echo $TARGETS | wc -w) targets"
