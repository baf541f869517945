#!/usr/bin/env bash
# DeepSeek-V4 end to end on the command line, through the same commands as V3: the debug-v4
# model (mHC, CSA and HCA layers, a hash-routed layer, MTP) is pretrained; LoRA-fine-tuned over
# MXFP4 experts, its adapters saved in PEFT's layout for Hugging Face's deepseek_v4 (fused
# experts via target_parameters), at EP 2 with one process's losses; the adapter generates the
# same greedy text unmerged as merged; the model is written in DeepSeek's release layout (FP8 +
# E8M0 tile scales, MXFP4 experts) and generates from it, also with int8 expert activations (the
# same replies at 1 and 2 threads and at EP 2, some unlike the exact path's); it is served over
# HTTP, where a greedy completion equals `moe generate`'s.
# Usage: cli_v4.sh MOE MPIRUN WORK_DIR
set -u
moe=$1 mpirun=$2 work=$3
client="$(cd "$(dirname "$0")" && pwd)/serve_client.py"
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
. "$(dirname "$client")/cli_lib.sh"
have_mpi() { [ -x "$(command -v "$mpirun")" ]; }

for i in $(seq 1 300); do echo "in the beginning $i the word was with the model and the model was good"; done > corpus.txt
for i in $(seq 1 120); do echo "{\"prompt\": \"count after $i:\", \"completion\": \" $((i + 1))\"}"; done > pc.jsonl
common=(--logging.progress lines --logging.log_every 1 --data.batch_size 4)
"$moe" --threads 1 train --config /dev/null --model.preset debug-v4 --data.path corpus.txt \
  --data.seq_len 32 --schedule.steps 3 --schedule.warmup_steps 1 --run.out_dir base "${common[@]}" \
  > base.log 2>&1 || { cat base.log; fail "V4 pretraining"; }
grep -q "model: .* 3 layers, 8 routed experts" base.log || { cat base.log; fail "no model line"; }
base=base/checkpoints/step_3

losses() { python3 -c "import json,sys; print(' '.join(repr(json.loads(l)['loss']) for l in open(sys.argv[1]) if 'loss' in l))" "$1"; }
ft=(--config "$MOE_SOURCE_DIR/configs/finetune-small.toml" --model.weights "$base"
    --model.experts mxfp4 --data.path pc.jsonl --data.seq_len 24 --schedule.steps 6
    --schedule.warmup_steps 1 --checkpoint.every 3 --logging.val_every 3 --lora.dropout 0.1
    --lora.expert_r 4 "${common[@]}")
"$moe" --threads 1 finetune "${ft[@]}" --run.out_dir ft > ft.log 2>&1 || { cat ft.log; fail "V4 finetune"; }
grep -q "LoRA: .* adapter matrices" ft.log || { cat ft.log; fail "no LoRA line"; }
adapter=ft/checkpoints/step_6
python3 - "$adapter" <<'PY' || fail "V4 adapter layout"
import json, struct, sys
d = sys.argv[1]
cfg = json.load(open(f"{d}/adapter_config.json"))
assert cfg["peft_type"] == "LORA", cfg
assert any(p.endswith("mlp.experts.gate_up_proj") for p in cfg["target_parameters"]), cfg
with open(f"{d}/adapter_model.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    keys = json.loads(f.read(n)).keys()
need = ["base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.o_b_proj.lora_B.weight",
        "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",
        "base_model.model.model.layers.1.mlp.experts.lora_B.weight"]
missing = [k for k in need if k not in keys]
assert not missing, missing
assert not any("o_a_proj" in k or "indexer" in k for k in keys), sorted(keys)
PY

# EP 2: the same losses as one process (cross-rank sums re-associate: 1e-5).
if have_mpi; then
  timeout 180 $mpirun --allow-run-as-root --oversubscribe -np 2 "$moe" --threads 1 finetune "${ft[@]}" \
    --run.out_dir ep2 --ep 2 > ep2.log 2>&1 || { cat ep2.log; fail "V4 finetune --ep 2"; }
  python3 - "$(losses ft/metrics.jsonl)" "$(losses ep2/metrics.jsonl)" <<'PY' || fail "EP 2 losses differ"
import sys
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
assert len(a) == len(b) == 6, (a, b)
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print("V4 fine-tune, EP 2 vs one process, worst relative loss difference", worst)
assert worst < 1e-5, worst
PY
fi

# Generation: the adapter unmerged equals the merged model (fp32 experts hold base + delta).
prompt="in the beginning 7 the word was"
gen=(--threads 1 generate --max-tokens 12 --temperature 0 --prompt "$prompt" --quiet)
greedy() { python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read())['text'], end='')" "$1"; }
"$moe" "${gen[@]}" --model "$base" --output base.jsonl 2> gen.err || { cat gen.err; fail "generate"; }
"$moe" "${gen[@]}" --model "$base" --adapter "$adapter" --output lora.jsonl 2> gen.err || { cat gen.err; fail "generate --adapter"; }
"$moe" --threads 1 merge --model "$base" --adapter "$adapter" --out merged --experts f32 > merge.log 2>&1 \
  || { cat merge.log; fail "merge"; }
"$moe" "${gen[@]}" --model merged --output merged.jsonl 2> gen.err || { cat gen.err; fail "generate merged"; }
[ "$(greedy lora.jsonl)" = "$(greedy merged.jsonl)" ] || fail "adapter '$(greedy lora.jsonl)' merged '$(greedy merged.jsonl)'"
[ "$(python3 -c "import json; print(json.loads(open('lora.jsonl').read())['completion_tokens'])")" -gt 0 ] \
  || fail "no tokens generated"

# DeepSeek's release layout: FP8 dense weights with E8M0 tile scales, MXFP4 experts.
"$moe" convert --model merged --out released --layout released --experts mxfp4 > conv.log 2>&1 \
  || { cat conv.log; fail "convert --layout released"; }
"$moe" inspect released > inspect.log 2>&1 || { cat inspect.log; fail "inspect released"; }
grep -q "F8_E4M3" inspect.log || { cat inspect.log; fail "no FP8 tensors in the released layout"; }
python3 - <<'PY' || fail "released config.json"
import json
c = json.load(open("released/config.json"))
assert c["model_type"] == "deepseek_v4" and c["expert_dtype"] == "fp4", c
assert c["quantization_config"]["weight_block_size"] == [128, 128], c
PY
"$moe" "${gen[@]}" --model released --output released.jsonl 2> gen.err || { cat gen.err; fail "generate released"; }
"$moe" convert --model merged --out released_again --layout released --experts mxfp4 > /dev/null 2>&1
cmp -s released/model.safetensors released_again/model.safetensors || fail "released layout not reproducible"
"$moe" convert --model merged --out released --layout released > bad.log 2>&1 && fail "a non-empty --out must fail"
grep -q "already exists" bad.log || { cat bad.log; fail "--out message"; }

# Int8 expert activations over the released layout's MXFP4 experts (the hash-routed layer
# included): the logits move off the exact path's; 20 sampled replies are the same at 1 and 2
# threads and at EP 2, and some differ from the exact path's (so an EP rank left exact would show).
echo "1 2 3 4 5 6 7 8 9 10" > ids.txt
"$moe" --threads 1 logits --model released --tokens ids.txt --out exact.safetensors > /dev/null || fail "V4 logits"
"$moe" --threads 1 logits --model released --tokens ids.txt --out int8.safetensors \
  --expert-activations int8 > /dev/null || fail "V4 logits --expert-activations int8"
cmp -s exact.safetensors int8.safetensors && fail "V4: --expert-activations int8 left the logits unchanged"
for i in $(seq 1 20); do echo "prompt number $i: the word was"; done > many.txt
sampled=(generate --model released --prompts many.txt --max-tokens 32 --temperature 0.9 --top-k 20 --seed 3 --quiet)
"$moe" --threads 1 "${sampled[@]}" --output exact.jsonl 2> gen.err || { cat gen.err; fail "V4 generate"; }
"$moe" --threads 1 "${sampled[@]}" --expert-activations int8 --output q8_t1.jsonl 2> gen.err || { cat gen.err; fail "V4 int8 generate"; }
cmp -s exact.jsonl q8_t1.jsonl && fail "V4: no sampled reply differs between fp32 and int8 expert activations (use more prompts or tokens)"
"$moe" --threads 2 "${sampled[@]}" --expert-activations int8 --output q8_t2.jsonl 2> gen.err || { cat gen.err; fail "V4 int8 generate, 2 threads"; }
cmp -s q8_t1.jsonl q8_t2.jsonl || fail "V4 int8 replies differ between 1 and 2 threads"
if [ -x "$(command -v "$mpirun")" ]; then
  timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$moe" --threads 1 "${sampled[@]}" \
    --expert-activations int8 --ep 2 --output q8_ep.jsonl > q8_ep.log 2>&1 || { cat q8_ep.log; fail "V4 int8 generate --ep 2"; }
  cmp -s q8_ep.jsonl q8_t1.jsonl || fail "V4 int8 generate at EP 2 differs from one process"
fi

# Serving: a greedy completion over HTTP equals moe generate's text.
greedy base.jsonl > greedy.txt
start_server v4 "$moe" --threads 1 serve --model "$base" --port 0 --slots 2
python3 "$client" greedy "$port" greedy.txt || fail "V4 greedy over HTTP"
stop_server v4
echo PASS
