"""PyTorch baseline for bench/e2e_vs_pytorch.sh: the same model (tests/reference/deepseek_ref.py,
or deepseek_v4_ref.py for a deepseek_v4 config, written the way a Hugging Face user would), fp32,
same thread count, full training steps on random tokens with torch.optim.AdamW. Prints one JSON line. Run with Debian's /usr/bin/python3."""
import argparse
import json
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import deepseek_ref as ref  # noqa: E402


def time_and_report(a, step, params):
    """Runs a.warmup untimed steps, then a.steps timed ones; prints the JSON line."""
    for _ in range(a.warmup):
        step()
    t0 = time.perf_counter()
    loss = 0.0
    for _ in range(a.steps):
        loss = float(step())
    secs = time.perf_counter() - t0
    tps = a.steps * a.batch * a.seq / secs
    print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "config": a.config,
                      "threads": a.threads, "batch": a.batch, "seq": a.seq, "params": params,
                      "tokens_per_s": round(tps, 1),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "loss": round(loss, 4)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    path = a.config if os.path.exists(a.config) else os.path.join(ROOT, "configs", "models", a.config + ".json")
    with open(path) as f:
        cfg_dict = json.load(f)
    if a.vocab:
        cfg_dict["vocab_size"] = a.vocab
    if cfg_dict.get("model_type") == "deepseek_v4":
        return run_v4(a, cfg_dict)
    cfg = ref.DeepseekV3Config.from_dict(cfg_dict)
    model = ref.DeepseekV3ForCausalLM(cfg)
    for p in model.parameters():  # plain init: the values do not change the cost
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.02)
    opt = ref.make_optimizer(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    V = cfg.vocab_size

    def step():
        ids = torch.randint(0, V, (a.batch, a.seq))
        tgt = torch.randint(0, V, (a.batch, a.seq))
        return ref.train_step(model, opt, ids, tgt, 0.0, 1.0, 1e-3)

    time_and_report(a, step, sum(p.numel() for p in model.parameters()))


def run_v4(a, cfg_dict):
    """DeepSeek-V4: tests/reference/deepseek_v4_ref.py's model (mHC, CSA/HCA with the indexer,
    hash and sqrtsoftplus routing with a per-expert loop over the routed rows, MTP), fp32, one
    torch.optim.AdamW over every trainable tensor; the selection-only gate biases and hash tables
    stay as they are."""
    import deepseek_v4_ref as ref4
    import gen_v4_fixtures as fx
    cfg = ref4.V4Config.from_dict(cfg_dict)
    state = fx.init_params(cfg, 0)
    params = {}
    for k, v in state.items():
        if v.is_floating_point() and not ref4.is_buffer(k):
            v = v.clone().requires_grad_(True)
        params[k] = v
    trainable = [v for v in params.values() if v.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    V = cfg.vocab_size
    mtp = cfg.num_nextn_predict_layers > 0

    def step():
        ids = torch.randint(0, V, (a.batch, a.seq))
        tgt = torch.randint(0, V, (a.batch, a.seq))
        logits, mtp_logits = ref4.forward(params, cfg, ids, mtp=mtp)
        total, _, _ = ref4.loss_fn(logits, mtp_logits, tgt)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        return total.detach()

    time_and_report(a, step, sum(v.numel() for v in trainable))


if __name__ == "__main__":
    main()
