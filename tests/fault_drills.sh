#!/usr/bin/env bash
# Fault drills (issue 14): `moe train` under the failures a long run meets, each checked for a
# clear ending and a checkpoint that resumes bitwise.
#   kill9    20 runs killed with SIGKILL at random points, many of them inside a checkpoint write:
#            the newest complete checkpoint always loads, a hidden temporary directory is never
#            taken for one (and is gone after the next save), and the resumed run ends with the
#            same checkpoint bytes and losses as a run never killed.
#   write    a checkpoint write that fails (file size limit, read-only directory, full disk): a
#            clear error naming the file, exit 1, the previous checkpoint intact and resumable.
#   sigterm  SIGTERM to `mpirun -np 2 moe train --ep 2`: every rank checkpoints and exits 130.
#   stall    one rank of two stopped (SIGSTOP): the other's collective watchdog ends the job
#            with the cause well inside 30 s instead of hanging.
# Usage: fault_drills.sh MODE MOE MPIRUN WORK_DIR
# MOE_FAULT_SEED sets the kill9 drill's random seed (printed; the default is fixed).
set -u
tests_dir=$(cd "$(dirname "$0")" && pwd)
mode=$1 moe=$2 mpirun=$3 work=$4
# An earlier run stopped inside the write drill may have left an immutable directory or the
# full-disk tmpfs behind.
if [ -d "$work" ]; then
  mountpoint -q "$work/full" 2> /dev/null && umount -l "$work/full"
  chattr -R -i "$work" 2> /dev/null
fi
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() {
  echo "FAIL: $*"
  exit 1
}
# Whatever happens (a failed check, ctest's timeout), no rank outlives the drill.
launched=()
kill_tree() {
  local c
  for c in $(pgrep -P "$1"); do kill_tree "$c"; done
  kill -KILL "$1" 2> /dev/null
}
trap 'for p in "${launched[@]}"; do kill_tree "$p"; done' EXIT
# wait_bounded PID SECONDS: waits for the background job PID to end, at most SECONDS; sets $rc.
wait_bounded() {
  local tenths=0
  while kill -0 "$1" 2> /dev/null && [ $tenths -lt $(($2 * 10)) ]; do
    sleep 0.1
    tenths=$((tenths + 1))
  done
  kill -0 "$1" 2> /dev/null && return 1
  wait "$1"
  rc=$?
}
# Constant learning rate after warm-up: a run stopped at step k and resumed with more steps
# takes the same updates as one run of that many steps, so any stopping point compares.
. "$tests_dir/tiny_run.sh"
write_tiny_run 8 'decay = "constant"' '[checkpoint]
every = 2'
moe1() { "$moe" --threads 1 "$@"; }
mpi2() { "$mpirun" --allow-run-as-root --oversubscribe "$@"; }
now_ms() { date +%s%3N; }

# newest_complete DIR: the step of the newest step_N in DIR holding trainer.json (empty: none).
newest_complete() {
  local best="" d n
  for d in "$1"/step_*; do
    [ -f "$d/trainer.json" ] || continue
    n=${d##*/step_}
    if [ -z "$best" ] || [ "$n" -gt "$best" ]; then best=$n; fi
  done
  echo "$best"
}

# same_checkpoint A B: every file of checkpoint A is byte-identical in B.
same_checkpoint() {
  local f
  [ -d "$1" ] && [ -d "$2" ] || return 1
  for f in "$1"/*; do cmp -s "$f" "$2/${f##*/}" || { echo "differs: ${f##*/}"; return 1; }; done
}

# losses FILE: step, loss and gradient norm of every metrics record (repr: equal text is equal
# bits).
losses() {
  python3 -c "import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r['step'], repr(r['loss']), repr(r['grad_norm']))" "$1"
}

drill_kill9() {
  local steps=24 runs=20 seed=${MOE_FAULT_SEED:-14}
  echo "kill9: seed $seed (MOE_FAULT_SEED=$seed reproduces the draw)"
  RANDOM=$seed
  mkdir ref && (cd ref && moe1 train --config ../tiny.toml --schedule.steps $steps \
    --checkpoint.every 1 > train.log 2>&1) || { cat ref/train.log; fail "reference run"; }
  local t0 t1 ref_ms
  # Timed separately from the first run, which also measures the FMA peak once for the cache.
  t0=$(now_ms)
  mkdir timing && (cd timing && moe1 train --config ../tiny.toml --schedule.steps $steps \
    --checkpoint.every 1 > train.log 2>&1) || fail "timing run"
  t1=$(now_ms) ref_ms=$((t1 - t0))
  echo "kill9: one uninterrupted run of $steps steps takes $ref_ms ms"
  local ref_ckpt=ref/run/checkpoints/step_$steps
  local in_write=0 from_scratch=0 finished=0 i
  for i in $(seq 1 $runs); do
    mkdir "k$i" && cd "k$i" || fail "mkdir k$i"
    # Not through a shell function: $! must be moe itself, not a subshell around it.
    "$moe" --threads 1 train --config ../tiny.toml --schedule.steps $steps --checkpoint.every 1 \
      > first.log 2>&1 &
    local pid=$! how
    if [ $((i % 2)) = 1 ]; then
      # Anywhere in the run's life, start-up included.
      local delay=$((RANDOM % ref_ms))
      how="after $delay ms"
      sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
    else
      # Inside the write of checkpoint k: as soon as its hidden directory exists, or up to 3 ms
      # later (on a fast disk the write may be over by then).
      local k=$((1 + RANDOM % (steps - 1))) extra=$((RANDOM % 4))
      how="$extra ms into the write of checkpoint $k"
      local waited=0
      while ! compgen -G "run/checkpoints/.tmp-step_$k.*" > /dev/null; do
        kill -0 $pid 2> /dev/null || break
        waited=$((waited + 1))
        [ $waited -gt 2000000 ] && break
      done
      [ $extra -gt 0 ] && sleep "0.00$extra"
    fi
    kill -KILL $pid 2> /dev/null
    wait $pid 2> /dev/null  # no "Killed" notice from the shell
    local rc=$? newest leftover=""
    [ $rc = 137 ] || { [ $rc = 0 ] && finished=$((finished + 1)); } || { cat first.log; fail "run $i exited $rc before the kill"; }
    compgen -G "run/checkpoints/.tmp-step_*" > /dev/null && leftover=yes && in_write=$((in_write + 1))
    newest=$(newest_complete run/checkpoints)
    echo "kill9 run $i: SIGKILL $how: exit $rc, newest complete checkpoint: ${newest:-none}${leftover:+, a partial checkpoint left behind}"
    if [ -z "$newest" ]; then
      # Killed before the first checkpoint: nothing to resume, and the partial directory (if
      # any) must not count as a checkpoint either.
      moe1 train --config ../tiny.toml --resume --schedule.steps $steps --checkpoint.every 1 \
        > resume.log 2>&1 && fail "run $i: --resume found a checkpoint where none is complete"
      grep -q "holds no checkpoint to resume from" resume.log || { cat resume.log; fail "run $i: no clear 'no checkpoint' error"; }
      from_scratch=$((from_scratch + 1))
      moe1 train --config ../tiny.toml --schedule.steps $steps --checkpoint.every 1 \
        > resume.log 2>&1 || { cat resume.log; fail "run $i: restart from scratch exited $?"; }
    else
      moe1 train --config ../tiny.toml --resume --schedule.steps $steps --checkpoint.every 1 \
        > resume.log 2>&1 || { cat resume.log; fail "run $i: resume exited $?"; }
      grep -q "resumed from run/checkpoints/step_$newest at step $newest" resume.log \
        || { cat resume.log; fail "run $i: did not resume from the newest complete checkpoint step_$newest"; }
    fi
    compgen -G "run/checkpoints/.*step_*" > /dev/null && { ls -la run/checkpoints; fail "run $i: temporary checkpoint directories left after the resumed run's saves"; }
    same_checkpoint "../$ref_ckpt" "run/checkpoints/step_$steps" || fail "run $i: final checkpoint differs from the uninterrupted run"
    [ "$(losses run/metrics.jsonl)" = "$(losses ../ref/run/metrics.jsonl)" ] || fail "run $i: losses differ from the uninterrupted run"
    cd .. && rm -rf "k$i"
  done
  echo "kill9: $runs runs, $in_write killed inside a checkpoint write, $from_scratch before the first checkpoint, $finished finished before the kill; every resume bitwise equal"
  [ $in_write -ge 3 ] || fail "only $in_write of $runs kills landed inside a checkpoint write"
}

# expect_write_failure NAME RC LOG PATTERN...: the run failed with exit 1 (not a signal) and its
# log has every pattern; the step_4 checkpoint is byte for byte what it was.
expect_write_failure() {
  local name=$1 rc=$2 log=$3 p
  shift 3
  cat "$log"
  [ "$rc" = 1 ] || fail "$name: exit $rc, expected 1 with an error message"
  for p in "$@"; do grep -qF -- "$p" "$log" || fail "$name: no '$p' in the error"; done
  (cd "$ckpt_dir/step_4" && sha256sum -c --quiet "$work/step_4.sha256") || fail "$name: step_4 changed"
  compgen -G "$ckpt_dir/.tmp-step_*" > /dev/null && fail "$name: a partial checkpoint was left"
  [ "$(newest_complete "$ckpt_dir")" = 4 ] || fail "$name: step_4 is no longer the newest checkpoint"
  echo "ok: $name"
}

# resume_matches DIR: resuming the run in DIR finishes bitwise like the reference.
resume_matches() {
  (cd "$1" && moe1 train --config "$work/tiny.toml" --resume > resume.log 2>&1) \
    || { cat "$1/resume.log"; fail "$1: resume after the failure exited $?"; }
  grep -q "resumed from run/checkpoints/step_4 at step 4" "$1/resume.log" || fail "$1: did not resume from step_4"
  same_checkpoint ref/run/checkpoints/step_8 "$1/run/checkpoints/step_8" || fail "$1: resumed run differs from the reference"
}

how=""  # how drill_write makes a directory read-only
protect() { if [ "$how" = "chattr +i" ]; then chattr +i "$1"; else chmod a-w "$1"; fi; }
unprotect() { if [ "$how" = "chattr +i" ]; then chattr -i "$1"; else chmod u+w "$1"; fi; }

drill_write() {
  mkdir ref && (cd ref && moe1 train --config ../tiny.toml > train.log 2>&1) || fail "reference run"
  mkdir base && (cd base && moe1 train --config ../tiny.toml --schedule.steps 4 > train.log 2>&1) \
    || fail "4-step run"
  (cd base/run/checkpoints/step_4 && sha256sum -- *) > step_4.sha256
  local model_kb
  model_kb=$(($(stat -c %s base/run/checkpoints/step_4/model.safetensors) / 1024))
  echo "write: a checkpoint's model.safetensors is $model_kb KiB"
  local rc

  # (a) File size limit: below the weights file, above everything else the run writes. SIGXFSZ
  # would kill the process without a word; the engine ignores it and reports EFBIG.
  cp -a base fsize
  ckpt_dir=fsize/run/checkpoints
  (cd fsize && ulimit -f $((model_kb / 2)) && exec "$moe" --threads 1 train --config ../tiny.toml \
    --resume > fail.log 2>&1)
  rc=$?
  expect_write_failure "file size limit (ulimit -f $((model_kb / 2)))" $rc fsize/fail.log \
    "step 6: writing the checkpoint failed" "model.safetensors" "File too large" \
    "The last complete checkpoint is run/checkpoints/step_4"
  resume_matches fsize

  # (b) Read-only checkpoint directory, then a read-only run directory. Root ignores permission
  # bits, so as root the directory is made immutable (chattr +i) instead.
  cp -a base readonly
  ckpt_dir=readonly/run/checkpoints
  how=""
  if [ "$(id -u)" != 0 ]; then
    how="chmod a-w"
  elif chattr +i readonly/run/checkpoints 2> /dev/null; then
    chattr -i readonly/run/checkpoints
    how="chattr +i"
  else
    echo "SKIP read-only directory: running as root and this filesystem has no chattr +i (root ignores permission bits)"
  fi
  if [ -n "$how" ]; then
    trap 'unprotect "$work/readonly/run/checkpoints"; unprotect "$work/readonly/run"' EXIT
    protect readonly/run/checkpoints
    (cd readonly && moe1 train --config ../tiny.toml --resume > fail.log 2>&1)
    rc=$?
    unprotect readonly/run/checkpoints
    expect_write_failure "read-only checkpoint directory ($how)" $rc readonly/fail.log \
      "step 6: writing the checkpoint failed" "run/checkpoints/.tmp-step_6" \
      "The last complete checkpoint is run/checkpoints/step_4"
    protect readonly/run
    (cd readonly && moe1 train --config ../tiny.toml --resume > fail2.log 2>&1)
    rc=$?
    unprotect readonly/run
    expect_write_failure "read-only run directory ($how)" $rc readonly/fail2.log \
      "run/config.toml"
    trap - EXIT
    resume_matches readonly
  fi

  # (c) Full disk: the run on a tmpfs with room for its files so far and a little more, not for
  # another checkpoint. Needs mount rights; skipped where there are none.
  mkdir full
  local used_kb
  used_kb=$(du -sk base | cut -f1)
  if mount -t tmpfs -o size=$((used_kb + model_kb / 2))k tmpfs full 2> mount.err; then
    trap 'umount "$work/full"' EXIT
    cp -a base/. full/
    ckpt_dir=full/run/checkpoints
    (cd full && moe1 train --config ../tiny.toml --resume > fail.log 2>&1)
    rc=$?
    cp full/fail.log full.log
    expect_write_failure "full disk (tmpfs of $((used_kb + model_kb / 2)) KiB)" $rc full.log \
      "step 6: writing the checkpoint failed" "No space left on device" \
      "The last complete checkpoint is run/checkpoints/step_4"
    umount full && trap - EXIT
  else
    echo "SKIP full disk: cannot mount a small tmpfs here ($(cat mount.err))"
  fi
}

drill_sigterm() {
  # Open MPI 4's mpirun answers SIGTERM by sending the ranks SIGCONT, waiting
  # odls_base_sigkill_timeout seconds (default 1), sending SIGTERM, waiting as long again, then
  # SIGKILL. One second is too little to finish a step and write a checkpoint, so the launch
  # raises it. While it waits, mpirun stops reading the ranks' output: a rank that prints more
  # than the pipe holds blocks in write() and never reaches its checkpoint, and mpirun 4.1.4
  # sometimes crashes on this path (exit 139) before passing on what it read. So each rank
  # writes its output and exit status to files of its own, as a batch job would.
  local grace=6
  "$mpirun" --allow-run-as-root --oversubscribe --mca odls_base_sigkill_timeout $grace -np 2 \
    bash -c 'trap : TERM; r=$OMPI_COMM_WORLD_RANK; "$@" > rank$r.log 2>&1; rc=$?; echo $rc > rank$r.rc; exit $rc' \
    rank "$moe" --threads 1 train --config tiny.toml --ep 2 --schedule.steps 100000 \
    --checkpoint.every 0 > term.log 2>&1 &
  local mp=$! t0 t1
  launched+=("$mp")
  for _ in $(seq 1 600); do
    grep -q "step 2/" rank0.log 2> /dev/null && break
    kill -0 $mp 2> /dev/null || { cat term.log rank*.log; fail "mpirun ended before step 2"; }
    sleep 0.1
  done
  t0=$(now_ms)
  kill -TERM $mp
  local rc s
  wait_bounded $mp 120 || { cat term.log rank*.log; fail "mpirun still runs 120 s after SIGTERM"; }
  t1=$(now_ms)
  cat term.log
  grep -v "^step [0-9]*/" rank0.log
  cat rank1.log
  echo "sigterm: mpirun exited $rc, $((t1 - t0)) ms after SIGTERM"
  [ $rc != 0 ] || fail "mpirun exited 0 after SIGTERM"
  s=$(grep -o "rank 0: interrupted after step [0-9]*" rank0.log | grep -o "[0-9]*$")
  [ -n "$s" ] || fail "rank 0 did not report its interruption"
  for r in 0 1; do
    grep -q "rank $r: interrupted after step $s; checkpoint run/checkpoints/step_$s; exit 130" rank$r.log \
      || fail "rank $r: no 'interrupted after step $s ... exit 130' line"
    [ "$(cat rank$r.rc 2> /dev/null)" = 130 ] || fail "rank $r exited $(cat rank$r.rc 2> /dev/null), not 130"
  done
  [ "$(newest_complete run/checkpoints)" = "$s" ] || fail "no complete checkpoint step_$s"
  # The interrupted run resumed for two more steps equals one run of that many steps.
  local total=$((s + 2))
  mpi2 -np 2 "$moe" --threads 1 train --config tiny.toml --ep 2 --resume --schedule.steps $total \
    --checkpoint.every 0 > resume.log 2>&1 || { cat resume.log; fail "resume exited $?"; }
  grep -q "resumed from run/checkpoints/step_$s at step $s" resume.log || { cat resume.log; fail "no resume"; }
  mkdir ref && (cd ref && mpi2 -np 2 "$moe" --threads 1 train --config ../tiny.toml --ep 2 \
    --schedule.steps $total --checkpoint.every 0 > train.log 2>&1) || { cat ref/train.log; fail "reference run"; }
  same_checkpoint ref/run/checkpoints/step_$total run/checkpoints/step_$total \
    || fail "the resumed run differs from an uninterrupted one"
  [ "$(losses run/metrics.jsonl)" = "$(losses ref/run/metrics.jsonl)" ] || fail "losses differ"
  echo "ok: SIGTERM to mpirun: both ranks saved step $s and exited 130; the resume is bitwise"
}

drill_stall() {
  local limit=5
  "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$moe" --threads 1 train --config tiny.toml \
    --ep 2 --schedule.steps 100000 --checkpoint.every 0 --collective-timeout $limit \
    > stall.log 2>&1 &
  local mp=$! victim="" p t0 t1 rc
  launched+=("$mp")
  for _ in $(seq 1 600); do
    grep -q "step 2/" stall.log && break
    kill -0 $mp 2> /dev/null || { cat stall.log; fail "mpirun ended before step 2"; }
    sleep 0.1
  done
  for p in $(pgrep -P $mp); do
    tr '\0' '\n' < /proc/$p/environ | grep -qx "OMPI_COMM_WORLD_RANK=1" && victim=$p
  done
  [ -n "$victim" ] || fail "rank 1's process not found under mpirun $mp"
  t0=$(now_ms)
  kill -STOP $victim
  echo "stall: rank 1 (pid $victim) stopped"
  # A hang ends here as a failure, not as a stuck test.
  wait_bounded $mp 60 || { cat stall.log; fail "the job still runs 60 s after rank 1 stopped: a hang"; }
  t1=$(now_ms)
  cat stall.log
  echo "stall: mpirun exited $rc, $((t1 - t0)) ms after rank 1 stopped"
  for _ in $(seq 1 30); do kill -0 $victim 2> /dev/null || break; sleep 0.1; done
  kill -0 $victim 2> /dev/null && { kill -KILL $victim; fail "the stopped rank outlived the job"; }
  [ $rc != 0 ] || fail "the job exited 0"
  [ $((t1 - t0)) -le 30000 ] || fail "the job took more than 30 s to end"
  grep -q "rank 0: error: no progress from the other ranks for [0-9]* s in MPI_[A-Za-z]*.* at step [0-9]*: a rank stalled or died (parallel.collective_timeout = $limit s); ending the job" stall.log \
    || fail "no cause printed"
  echo "ok: a stopped rank ends the job with the cause"
}

case $mode in
  kill9) drill_kill9 ;;
  write) drill_write ;;
  sigterm) drill_sigterm ;;
  stall) drill_stall ;;
  *) fail "unknown mode $mode" ;;
esac
echo "ok"
