#!/usr/bin/env bash
# `moe generate` and `moe serve` end to end: a tiny model is pretrained; `moe generate` runs
# batched prompts from a file, stdin and JSONL (batched replies equal one-by-one ones, stop
# strings, chat, errors, EP 2 = one process); then it is served on a free port, and
# tests/serve_client.py checks the OpenAI-compatible API over HTTP (shapes, usage, seeds,
# streaming, concurrent streams, a client that disconnects, malformed requests, memory flat over
# 1,000 requests); a second server with one slot and one queue place refuses the overflow with
# 503; under mpirun at EP 2 the greedy completion equals one process's; SIGTERM during a long
# stream lets it finish, then the server exits 0. --expert-activations int8 over the experts
# packed by `moe quantize`: `moe logits` moves, replies at 1 and 2 threads and EP 2 agree (and
# some differ from the exact path's), the server's greedy text equals `moe generate`'s, fp32
# experts are refused.
# Usage: cli_serve.sh MOE MPIRUN WORK_DIR
set -u
moe=$1 mpirun=$2 work=$3
client="$(cd "$(dirname "$0")" && pwd)/serve_client.py"
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
. "$(dirname "$client")/cli_lib.sh"

for i in $(seq 1 300); do echo "in the beginning $i the word was with the model and the model was good"; done > corpus.txt
# A long context, so a greedy request runs for seconds (disconnect, full queue, SIGTERM).
"$moe" --threads 1 train --config /dev/null --model.preset debug --model.max_position_embeddings 4096 \
  --data.path corpus.txt --data.seq_len 32 --schedule.steps 3 --schedule.warmup_steps 1 \
  --data.batch_size 4 --run.out_dir base > train.log 2>&1 || { cat train.log; fail "training"; }
ck=base/checkpoints/step_3

# moe generate: three prompts batched, then each alone with its seed (prompt i uses seed + i).
printf 'in the beginning\nthe word was\nand the model\n' > prompts.txt
gen=("$moe" --threads 1 generate --model "$ck" --max-tokens 12 --top-k 20)
"${gen[@]}" --prompts prompts.txt --temperature 0.9 --seed 5 --output batched.jsonl 2> gen.err || { cat gen.err; fail "generate"; }
grep -q "generate: 3 prompts, prompt .* tokens/s, generation .* tokens/s" gen.err || fail "no tokens/s line"
[ "$(wc -l < batched.jsonl)" -eq 3 ] || fail "expected 3 JSONL replies"
i=0
while read -r p; do
  "${gen[@]}" --prompt "$p" --temperature 0.9 --seed $((5 + i)) --output one.jsonl --quiet || fail "generate one"
  want=$(python3 -c "import json,sys; print(json.loads(open('batched.jsonl').readlines()[$i])['text'])")
  got=$(python3 -c "import json; print(json.loads(open('one.jsonl').read())['text'])")
  [ "$want" = "$got" ] || fail "prompt $i batched '$want' alone '$got'"
  i=$((i + 1))
done < prompts.txt
# stdin, a stop string, chat mode, and JSONL with messages.
echo "in the beginning" | "${gen[@]}" --prompts - --temperature 0 --output stdin.jsonl --quiet || fail "stdin"
greedy_text=$(python3 -c "import json; print(json.loads(open('stdin.jsonl').read())['text'])")
stop=${greedy_text:3:2}
"${gen[@]}" --prompt "in the beginning" --temperature 0 --stop "$stop" --output stop.jsonl --quiet || fail "stop"
python3 - "$stop" <<'PY' || fail "stop string"
import json, sys
r = json.loads(open("stop.jsonl").read())
full = json.loads(open("stdin.jsonl").read())["text"]
assert r["finish_reason"] == "stop", r
assert r["text"] == full[: full.index(sys.argv[1])], (r, full)
PY
echo '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}' > chat.jsonl
"${gen[@]}" --prompts chat.jsonl --output chat_out.jsonl --quiet || fail "chat jsonl"
"${gen[@]}" --prompt "hello" --chat --system "be brief" --output chat_flag.jsonl --quiet || fail "--chat"
python3 - <<'PY' || fail "chat"
import json
a, b = json.loads(open("chat_out.jsonl").read()), json.loads(open("chat_flag.jsonl").read())
assert a["messages"] == b["messages"] and a["text"] == b["text"], (a, b)
assert a["prompt_tokens"] > len("hello"), a  # the template's markers around the message
PY
"${gen[@]}" --prompts missing.txt 2> err.txt && fail "a missing prompts file must fail"
grep -q "missing.txt: cannot open" err.txt || fail "missing file message: $(cat err.txt)"
echo '{"prompt": 3}' > bad.jsonl
"${gen[@]}" --prompts bad.jsonl 2> err.txt && fail "a bad JSONL line must fail"
grep -q 'bad.jsonl:1: "prompt" must be a string' err.txt || fail "bad JSONL message: $(cat err.txt)"
if [ -x "$(command -v "$mpirun")" ]; then
  timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "${gen[@]}" --ep 2 \
    --prompts prompts.txt --temperature 0.9 --seed 5 --output ep.jsonl --quiet > ep.log 2>&1 || { cat ep.log; fail "generate --ep 2"; }
  cmp -s ep.jsonl batched.jsonl || fail "generate at EP 2 differs from one process"
fi

# --expert-activations int8 (MXFP4 experts, inference only) on the checkpoint's experts packed by
# `moe quantize`: the logits move off the exact path's (the option switches the kernel); 20
# sampled replies are the same at 1 and 2 threads and at EP 2, and some of them differ from the
# exact path's, so an EP rank left exact would show; fp32 experts are refused with one message
# naming the option; a server runs it (its greedy text equals `moe generate`'s).
"$moe" quantize --model "$ck" --out packed > quantize.log 2>&1 || { cat quantize.log; fail "quantize"; }
echo "1 2 3 4 5 6 7 8 9 10" > ids.txt
"$moe" --threads 1 logits --model packed --tokens ids.txt --out exact.safetensors > /dev/null || fail "logits"
"$moe" --threads 1 logits --model packed --tokens ids.txt --out int8.safetensors \
  --expert-activations int8 > /dev/null || fail "logits --expert-activations int8"
cmp -s exact.safetensors int8.safetensors && fail "--expert-activations int8 left the logits unchanged"
for i in $(seq 1 20); do echo "prompt number $i: the word was"; done > many.txt
sampled=(generate --model packed --prompts many.txt --max-tokens 32 --temperature 0.9 --top-k 20 --seed 3)
"$moe" --threads 1 "${sampled[@]}" --output exact.jsonl --quiet || fail "generate over MXFP4 experts"
"$moe" --threads 1 "${sampled[@]}" --expert-activations int8 --output q8_t1.jsonl 2> q8_gen.err \
  || { cat q8_gen.err; fail "int8 generate"; }
grep -q "forwards, int8 expert activations$" q8_gen.err || fail "no int8 note on the tokens/s line: $(cat q8_gen.err)"
cmp -s exact.jsonl q8_t1.jsonl && fail "no sampled reply differs between fp32 and int8 expert activations: the EP check below could not tell an exact rank from an int8 one (use more prompts or tokens)"
"$moe" --threads 2 "${sampled[@]}" --expert-activations int8 --output q8_t2.jsonl --quiet || fail "int8 generate, 2 threads"
cmp -s q8_t1.jsonl q8_t2.jsonl || fail "int8 replies differ between 1 and 2 threads"
if [ -x "$(command -v "$mpirun")" ]; then
  timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$moe" --threads 1 "${sampled[@]}" \
    --expert-activations int8 --ep 2 --output q8_ep.jsonl --quiet > q8_ep.log 2>&1 || { cat q8_ep.log; fail "int8 generate --ep 2"; }
  cmp -s q8_ep.jsonl q8_t1.jsonl || fail "int8 generate at EP 2 differs from one process"
fi
"$moe" --threads 1 generate --model "$ck" --expert-activations int8 --prompt x 2> err.txt && fail "int8 over fp32 experts must fail"
[ "$(grep -c -- "--expert-activations int8 needs routed experts in MXFP4" err.txt)" -eq 1 ] || fail "fp32 experts message: $(cat err.txt)"
grep -q "routed experts are fp32; use --expert-activations fp32" err.txt || fail "fp32 experts message: $(cat err.txt)"
"$moe" --threads 1 generate --model packed --expert-activations int4 --prompt x 2> err.txt && fail "an unknown value must fail"
grep -q -- "--expert-activations: int4 not in {fp32,int8}" err.txt || fail "unknown value message: $(cat err.txt)"
prompt=$(python3 -c "import sys; sys.path.insert(0, '$(dirname "$client")'); import serve_client; print(serve_client.PROMPT)")
"$moe" --threads 1 generate --model packed --expert-activations int8 --prompt "$prompt" --max-tokens 12 \
  --temperature 0 --output q8_greedy.jsonl --quiet || fail "int8 greedy"
python3 -c "import json; print(json.loads(open('q8_greedy.jsonl').read())['text'], end='')" > q8_greedy.txt
start_server q8 "$moe" --threads 1 serve --model packed --port 0 --expert-activations int8
python3 "$client" greedy "$port" q8_greedy.txt || fail "int8 server greedy"
stop_server q8

start_server main "$moe" --threads 1 serve --model "$ck" --port 0 --slots 4
main_launched=$launched main_pid=$server_pid main_port=$port
echo "main server on port $main_port"
python3 "$client" basic "$main_port" greedy.txt || fail "basic"
logged=$(grep -c '^POST /v1/completions 200 prompt [0-9]* completion [0-9]* .* ms$' main.err)
[ "$logged" -ge 1000 ] || fail "expected a log line per request, found $logged"

start_server queue "$moe" --threads 1 serve --model "$ck" --port 0 --slots 1 --max-queued 1 \
  --temperature 0
python3 "$client" queue "$port" || fail "queue"
stop_server queue

if [ -x "$(command -v "$mpirun")" ]; then
  start_server ep timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$moe" --threads 1 \
    serve --model "$ck" --port 0 --ep 2
  python3 "$client" greedy "$port" greedy.txt || fail "EP 2 greedy"
  # Rank 0 drains and releases rank 1; mpirun then ends with status 0.
  stop_server ep
else
  echo "no mpirun: EP case skipped"
fi

launched=$main_launched server_pid=$main_pid
python3 "$client" sigterm "$main_port" "$main_pid" || fail "sigterm"
wait "$main_launched"
rc=$?
[ $rc -eq 0 ] || fail "the server exited $rc after SIGTERM"
grep -q "moe serve: stopped" main.err || fail "no 'stopped' line"
echo PASS
