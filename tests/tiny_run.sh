# Shared by the command-line tests that train the `debug` preset for a few steps (source it
# after cd-ing into the work dir). write_tiny_run STEPS [SCHEDULE_LINES] [MORE_TABLES] writes
# corpus.txt (400 short lines) and tiny.toml, which trains on it into run/.
write_tiny_run() {
  for i in $(seq 1 400); do echo "in the beginning $i the word was with the model and the model was good"; done > corpus.txt
  cat > tiny.toml << TOML
[model]
preset = "debug"
[data]
path = "$PWD/corpus.txt"
seq_len = 32
batch_size = 4
[schedule]
steps = $1
warmup_steps = 1
${2:-}
[logging]
progress = "lines"
log_every = 1
[run]
out_dir = "run"
${3:-}
TOML
}
