# Shared by the command-line tests that run servers (source it after cd-ing into the work dir):
# fail, start_server, stop_server, and a trap that leaves no server behind.
fail() {
  echo "FAIL: $*"
  for f in *.out *.err; do [ -f "$f" ] && { echo "--- $f (tail)"; tail -15 "$f"; }; done
  exit 1
}
launched_pids=()
# Whatever happens, no server outlives the test.
trap 'for p in "${launched_pids[@]}"; do kill -9 "$p" 2>/dev/null; done' EXIT

# start_server NAME COMMAND...: runs COMMAND in the background (stdout NAME.out, stderr
# NAME.err) until it prints its URL; sets $launched (the background job), $port and
# $server_pid (the serving process: under mpirun, rank 0).
start_server() {
  local name=$1
  shift
  "$@" > "$name.out" 2> "$name.err" &
  launched=$!
  launched_pids+=("$launched")
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://[^ ]*' "$name.out" | sed 's/.*://')
    if [ -n "$port" ]; then
      server_pid=$(grep -o '(pid [0-9]*' "$name.out" | grep -o '[0-9]*$')
      return 0
    fi
    kill -0 "$launched" 2> /dev/null || fail "$name exited before listening"
    sleep 0.1
  done
  fail "$name: no URL after 60 s"
}

# stop_server NAME: SIGTERM to the serving process; the job must end with status 0.
stop_server() {
  kill -TERM "$server_pid"
  wait "$launched"
  local rc=$?
  [ $rc -eq 0 ] || fail "$1 exited $rc after SIGTERM"
  grep -q "moe serve: stopped" "$1.err" || fail "$1: no 'stopped' line"
}

