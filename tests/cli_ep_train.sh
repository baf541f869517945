#!/usr/bin/env bash
# `mpirun -np 2 moe train --ep 2` end to end: the CLI starts MPI, the ranks train together,
# rank 0 alone prints and writes the run's files, the checkpoint is sharded by expert and
# resumes; a bad --ep ends every rank with the cause printed and a non-zero exit.
# Usage: cli_ep_train.sh MOE MPIRUN WORK_DIR
set -u
tests_dir=$(cd "$(dirname "$0")" && pwd)
moe=$1 mpirun=$2 work=$3
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
. "$tests_dir/tiny_run.sh"
write_tiny_run 4
run() { timeout 120 $mpirun --allow-run-as-root --oversubscribe -np 2 "$moe" --threads 1 "$@"; }
fail() { echo "FAIL: $*"; exit 1; }

run train --config tiny.toml --ep 2 > train.log 2>&1 || { cat train.log; fail "moe train --ep 2 exited $?"; }
cat train.log
grep -q "parallel: 2 ranks, expert-parallel size 2" train.log || fail "no parallel line"
[ "$(grep -c 'step 4/4' train.log)" = 1 ] || fail "rank 0 alone should print progress"
ckpt=run/checkpoints/step_4
for f in model-00001-of-00003.safetensors model-00002-of-00003.safetensors \
         model-00003-of-00003.safetensors model.safetensors.index.json \
         optimizer.safetensors optimizer-experts-00001-of-00002.safetensors \
         optimizer-experts-00002-of-00002.safetensors trainer.json config.json; do
  [ -f "$ckpt/$f" ] || fail "missing $ckpt/$f"
done
[ -f run/report/summary.md ] || fail "no report"

run train --resume --config tiny.toml --ep 2 --schedule.steps 6 > resume.log 2>&1 || { cat resume.log; fail "resume exited $?"; }
grep -q "resumed from run/checkpoints/step_4 at step 4" resume.log || { cat resume.log; fail "no resume"; }
[ -f run/checkpoints/step_6/trainer.json ] || fail "no step_6 after resume"

# One process continues the 2-rank run: the saved EP size 2 does not divide 1 rank, so it
# continues at EP 1 and says so.
"$moe" --threads 1 train --resume run --schedule.steps 7 > alone.log 2>&1 || { cat alone.log; fail "one-process resume exited $?"; }
grep -q "continues at 1" alone.log || { cat alone.log; fail "no EP note"; }
[ -f run/checkpoints/step_7/trainer.json ] || fail "no step_7 after the one-process resume"

# One process samples from the ranks' checkpoint: it is an ordinary sharded model.
"$moe" --threads 1 sample --model run/checkpoints/step_6 --prompt "in the" --max-tokens 8 > sample.log 2>&1 || { cat sample.log; fail "sample"; }

start=$(date +%s)
run train --config tiny.toml --ep 3 --run.out_dir bad > bad.log 2>&1
rc=$? end=$(date +%s)
cat bad.log
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "--ep 3 on 2 ranks must fail (exit $rc)"
[ $((end - start)) -le 30 ] || fail "--ep 3 took $((end - start)) s to fail"
grep -q "parallel.ep = 3: the expert-parallel size must divide the number of ranks (2)" bad.log || fail "no cause printed"
echo "ok"
