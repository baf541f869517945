"""Generates (and checks) the DeepSeek-V4 fixtures from tests/reference/deepseek_v4_ref.py.

  /usr/bin/python3 tests/reference/gen_v4_fixtures.py             # write tests/fixtures/v4/
  /usr/bin/python3 tests/reference/gen_v4_fixtures.py --check     # regenerate in memory, compare bytes
  /usr/bin/python3 tests/reference/gen_v4_fixtures.py --selftest  # invariants, finite differences,
                                                                  # independent formulations, fp32 replay

Every value is computed in float64 from float32 inputs and weights (stored exactly), then rounded
to float32. Layout and tensor names: tests/fixtures/v4/README.md.
"""
import argparse
import filecmp
import json
import math
import os
import shutil
import sys
import tempfile

# Bit-identical regeneration on any x86-64 CPU (see gen_fixtures.py): OpenBLAS's generic kernels.
os.environ.setdefault("OPENBLAS_CORETYPE", "Prescott")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_v4_ref as ref  # noqa: E402
from safetensors_io import load_file, save_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "tests", "fixtures", "v4")
F64 = torch.float64

# Decision margins in the float64 forward: any fp32 implementation must take the same discrete
# decisions (routes, indexer picks, clamp branches).
MIN_ROUTE_GAP = 1e-4      # k-th vs (k+1)-th selection score (sqrtsoftplus + bias)
MIN_INDEX_GAP = 2e-5      # last kept vs first dropped visible indexer score (scores are O(0.1-1))
MIN_CLAMP_GAP = 1e-4      # |pre-clamp value - limit| in every clamped SwiGLU
# quantization_simulation "reference": every quantized value's distance to a rounding midpoint,
# and every block amax's to a scale threshold, relative to the block's amax, must exceed both
# MIN_QUANT_GAP and QUANT_NOISE_FACTOR x the largest displacement of any quantized value in
# torch's float32 replay (~5e-7 of amax at worst, ~4e-8 typically; recorded in fixture.json),
# which must quantize every value alike. The simulation must also change at least one indexer
# pick, so that the fixture checks the FP4 indexer and not only the FP8 KV.
MIN_QUANT_GAP = 2e-6
QUANT_NOISE_FACTOR = 4.0
MAX_ATTEMPTS = 500
MTP_LOSS_SCALE = 0.1      # Automodel MTPConfig.loss_scaling_factor / depths (1)


def setup_determinism():
    torch.ones(2, 2) @ torch.ones(2, 2)  # load the BLAS
    try:
        with open("/proc/self/maps") as f:
            blas = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    except OSError:
        blas = set()
    if not any("openblas" in b for b in blas) or os.environ.get("OPENBLAS_CORETYPE") != "Prescott":
        print(f"gen_v4_fixtures: warning: BLAS {sorted(blas)}, OPENBLAS_CORETYPE="
              f"{os.environ.get('OPENBLAS_CORETYPE')}: regenerated files may differ in the last bits "
              f"(expected OpenBLAS with OPENBLAS_CORETYPE=Prescott)", file=sys.stderr)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)


def hf_v4_config(**fields):
    """A complete HF-style deepseek_v4 config.json (tiny sizes; fields override)."""
    cfg = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=24, o_lora_rank=16,
        o_groups=2, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, routed_scaling_factor=1.5, norm_topk_prob=True,
        scoring_func="sqrtsoftplus", topk_method="noaux_tc", num_hash_layers=1, hidden_act="silu",
        swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, index_n_heads=2,
        index_head_dim=32, index_topk=3, sliding_window=8, rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536,
                          beta_fast=32, beta_slow=1),
        max_position_embeddings=1024, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
        compress_ratios=[0, 4, 16, 4, 0], tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=1, torch_dtype="float32",
    )
    for k, v in fields.items():
        # quantization_simulation: the engine's own field, absent from config.json at "none"
        if k not in cfg and k != "quantization_simulation":
            raise KeyError(f"unknown config field {k}")
        cfg[k] = v
    n = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    if len(cfg["compress_ratios"]) != n:
        raise ValueError("compress_ratios: num_hidden_layers + num_nextn_predict_layers entries")
    return cfg


CASES = {
    # Every layer kind once: layer 0 sliding-only + hash routing, 1 CSA (ratio 4, the indexer keeps
    # 3 of up to 15 visible entries), 2 HCA (ratio 16 stands in for 128); MTP depth 1 (sliding-
    # only, non-hash). S = 61: incomplete trailing windows for both ratios. swiglu_limit 2.5 so the
    # clamps bind (~1 % of the gate/up values). 8 index heads: with 2 or 4, ReLU makes exact-zero
    # scores common enough that ties at the top-k boundary are hard to avoid.
    "mtp": dict(
        config=hf_v4_config(num_hidden_layers=3, compress_ratios=[0, 4, 16, 0], swiglu_limit=2.5,
                            index_n_heads=8),
        batch=2, seq=61, ignore=[], seed=100),
    # Hash routing on a CSA and an HCA layer (num_hash_layers 2), index_topk 16 >= every entry
    # count (the indexer keeps all visible entries), narrower dims (head_dim 16, rope 8, one head
    # per output group, 6 experts top-3), odd window 5, no MTP, S = 48 (complete windows),
    # ignored targets, the released swiglu_limit 10 (never binds here).
    "hash_csa": dict(
        config=hf_v4_config(
            vocab_size=96, hidden_size=32, num_hidden_layers=3, head_dim=16, qk_rope_head_dim=8,
            q_lora_rank=16, o_lora_rank=8, o_groups=4, n_routed_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=16, routed_scaling_factor=2.5, num_hash_layers=2,
            index_n_heads=3, index_head_dim=16, index_topk=16, sliding_window=5,
            num_nextn_predict_layers=0, compress_ratios=[4, 16, 0], swiglu_limit=10.0),
        batch=2, seq=48, ignore=[(0, 5), (1, 47)], seed=200),
    # quantization_simulation "reference" (DeepSeek's reference forward's FP8 KV and Hadamard +
    # FP4 indexer): CSA then HCA (ratio 8), head_dim 80 with rope 16 (one FP8 block of 64
    # non-rope features), 8 index heads of 32 (one FP4 block, a 32-point Hadamard) keeping 2 of
    # up to 8 visible entries. Small (B 1, S 32, ~13k quantized values) because every quantized
    # value must clear MIN_QUANT_GAP.
    "qsim": dict(
        config=hf_v4_config(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=80,
            qk_rope_head_dim=16, q_lora_rank=16, o_lora_rank=8, o_groups=2, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, num_hash_layers=0, index_n_heads=8,
            index_head_dim=32, index_topk=2, sliding_window=6, num_nextn_predict_layers=0,
            compress_ratios=[4, 8], swiglu_limit=10.0, quantization_simulation="reference"),
        batch=1, seq=32, ignore=[(0, 3)], seed=600),
}


# --------------------------------------------------------------------------------------------------
# Weights and batches
# --------------------------------------------------------------------------------------------------
def init_tensor(name, shape, g, cfg):
    """float32 values (int64 for tid2eid). Linear weights N(0,1)/sqrt(in); embed N(0,1); head
    N(0,1)/sqrt(D); hc fn N(0,1)/sqrt(n·D), hc base 0.5 N(0,1), hc scale 1 + 0.3 N(0,1);
    attn_sink N(0,1); ape 0.3 N(0,1); gate.bias 0.05 N(0,1); norm weights 1 + 0.1 N(0,1);
    tid2eid: per token id, k distinct experts (a random permutation's first k)."""
    if name.endswith("gate.tid2eid"):
        V, k = shape
        return torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(V)])
    noise = torch.randn(shape, generator=g, dtype=torch.float32)
    last = name.split(".")[-1]
    if name == "embed.weight":
        return noise
    if name == "head.weight":
        return noise / math.sqrt(shape[1])
    if last.startswith("hc_") and last.endswith("_fn"):
        return noise / math.sqrt(shape[1])
    if last.startswith("hc_") and last.endswith("_base"):
        return 0.5 * noise
    if last.startswith("hc_") and last.endswith("_scale"):
        return 1.0 + 0.3 * noise
    if last == "attn_sink":
        return noise
    if last == "ape":
        return 0.3 * noise
    if name.endswith("gate.bias"):
        return 0.05 * noise
    if len(shape) == 1:
        return 1.0 + 0.1 * noise
    return noise / math.sqrt(shape[1])


def init_params(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: init_tensor(k, s, g, cfg) for k, s in ref.param_shapes(cfg).items()}


def make_batch(vocab, batch, seq, seed, ignore):
    g = torch.Generator().manual_seed(seed + 7919)
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    tokens, targets = stream[:, :seq].clone(), stream[:, 1:].clone()
    for b, s in ignore:
        targets[b, s] = -100
    return tokens, targets


# --------------------------------------------------------------------------------------------------
# Whole-model fixtures
# --------------------------------------------------------------------------------------------------
def to_dtype(state, dtype, grad=True):
    out = {}
    for k, v in state.items():
        if v.is_floating_point():
            v = v.to(dtype)
            if grad and not ref.is_buffer(k):
                v.requires_grad_(True)
        out[k] = v
    return out


def run_model(cfg, state, tokens, targets, dtype=F64, grads=True):
    """Forward (+ backward) at `dtype`. Returns a dict of results and the Trace."""
    mtp = cfg.num_nextn_predict_layers > 0
    params = to_dtype(state, dtype, grads)
    trace = ref.Trace()
    logits, mtp_logits = ref.forward(params, cfg, tokens, mtp=mtp, trace=trace)
    total, ce, mce = ref.loss_fn(logits, mtp_logits, targets, MTP_LOSS_SCALE)
    res = dict(logits=logits.detach(), mtp_logits=None if mtp_logits is None else mtp_logits.detach(),
               loss=total.detach(), ce=ce.detach(), mce=mce.detach())
    if grads:
        names = [k for k, v in params.items() if v.requires_grad]
        gs = torch.autograd.grad(total, [params[k] for k in names], allow_unused=True)
        res["grads"] = {k: (torch.zeros_like(params[k]) if gr is None else gr).detach()
                        for k, gr in zip(names, gs)}
    return res, trace


def case_state(name):
    c = CASES[name]
    cfg = ref.V4Config.from_dict(c["config"])
    tokens, targets = make_batch(cfg.vocab_size, c["batch"], c["seq"], c["seed"], c["ignore"])
    for attempt in range(MAX_ATTEMPTS):
        seed = c["seed"] + attempt
        state = init_params(cfg, seed)
        with torch.no_grad():
            _, tr = run_model(cfg, state, tokens, targets, F64, grads=False)
        if (tr.route_margin > MIN_ROUTE_GAP and tr.index_margin > MIN_INDEX_GAP
                and tr.clamp_margin > MIN_CLAMP_GAP and tr.qsim.margin > MIN_QUANT_GAP):
            # the float32 replay must take every discrete decision the same way
            with torch.no_grad():
                _, t32 = run_model(cfg, state, tokens, targets, torch.float32, grads=False)
            if same_decisions(tr, t32) and simulation_is_checkable(cfg, state, tokens, targets, tr, t32):
                return cfg, state, tokens, targets, seed, tr
    raise RuntimeError(f"{name}: no seed with clear routing / index / clamp / quantization margins")


def same_decisions(a, b):
    for k in a.routing:
        if not torch.equal(a.routing[k][0], b.routing[k][0]):
            return False
    for k in a.picks:
        if not torch.equal(a.picks[k], b.picks[k]):
            return False
    if len(a.qsim.codes) != len(b.qsim.codes):
        return False
    for (fa, qa, sa), (fb, qb, sb) in zip(a.qsim.codes, b.qsim.codes):
        if fa != fb or not torch.equal(qa.double(), qb.double()) or not torch.equal(sa.double(), sb.double()):
            return False
    return True


def simulation_is_checkable(cfg, state, tokens, targets, tr, t32):
    """quantization_simulation cases: clear of float32 noise, and picks the simulation changed."""
    if cfg.quantization_simulation == "none":
        return True
    if tr.qsim.margin <= QUANT_NOISE_FACTOR * quant_noise(t32, tr):
        return False
    plain = ref.V4Config.from_dict(dict(vars(cfg), quantization_simulation="none"))
    with torch.no_grad():
        _, t0 = run_model(plain, state, tokens, targets, F64, grads=False)
    return any(not torch.equal(tr.picks[k], t0.picks[k]) for k in tr.picks)


def quant_noise(a, b):
    """Largest |x_a − x_b| / amax_b over the values two forwards quantized (0: none)."""
    return max((float(((xa.double() - xb.double()).abs() / mb.double()).max())
                for (xa, _), (xb, mb) in zip(a.qsim.inputs, b.qsim.inputs)), default=0.0)


def case_files(name):
    """{relative path: bytes-producing spec} for one whole-model case."""
    c = CASES[name]
    cfg, state, tokens, targets, seed, _ = case_state(name)
    res, tr = run_model(cfg, state, tokens, targets, F64, grads=True)
    mtp = cfg.num_nextn_predict_layers > 0
    exp = {"tokens": tokens.to(torch.int32), "targets": targets.to(torch.int32),
           "logits": res["logits"].float(), "loss": res["loss"].float().reshape(1),
           "ce_loss": res["ce"].float().reshape(1)}
    if mtp:
        mids, mtg = ref.mtp_inputs(tokens, targets)
        exp.update({"mtp_ids": mids.to(torch.int32), "mtp_targets": mtg.to(torch.int32),
                    "mtp_logits": res["mtp_logits"].float(),
                    "mtp_ce_loss": res["mce"].float().reshape(1)})
    for k, v in res["grads"].items():
        exp["grad." + k] = v.float()
    for k, (ids, w) in tr.routing.items():
        exp[f"routing.{k}.ids"] = ids.to(torch.int32)
        exp[f"routing.{k}.weights"] = w.float()
    for k, p in tr.picks.items():
        exp[f"picks.{k}"] = p.to(torch.int32)
    for k, h in tr.hidden.items():
        exp[f"hidden.{k}"] = h.float()
    fixture = {"batch": c["batch"], "seq": c["seq"], "weights_seed": seed,
               "mtp_loss_scale": MTP_LOSS_SCALE if mtp else 0.0,
               "ignored_targets": [list(x) for x in c["ignore"]],
               "margins": {"route": fmt_margin(tr.route_margin), "index": fmt_margin(tr.index_margin),
                           "clamp": fmt_margin(tr.clamp_margin)}}
    if cfg.quantization_simulation != "none":
        # the smallest distance to a quantization decision, and how far float32 rounding moves
        # the quantized values (both relative to their block's amax)
        with torch.no_grad():
            _, t32 = run_model(cfg, state, tokens, targets, torch.float32, grads=False)
        fixture["margins"]["quant"] = fmt_margin(tr.qsim.margin)
        fixture["margins"]["quant_fp32_noise"] = fmt_margin(quant_noise(t32, tr))
    return {
        f"{name}/config.json": ("json", c["config"]),
        f"{name}/fixture.json": ("json", fixture),
        f"{name}/model.safetensors": ("st", state, {}),
        f"{name}/expected.safetensors": ("st", exp, {}),
    }


def fmt_margin(m):
    return None if math.isinf(m) else float(f"{m:.6g}")


# --------------------------------------------------------------------------------------------------
# Per-module fixtures
# --------------------------------------------------------------------------------------------------
# Module dims: hidden 64, 4 heads of 32 (rope 16), q_lora 24, 2 output groups of rank 16, window 8,
# 4 streams, 20 Sinkhorn iterations, 8 experts top-2 of width 32, 4 index heads of 32, topk 3.
M = dict(D=64, H=4, d=32, rd=16, ql=24, g=2, r=16, win=8, n=4, iters=20, E=8, k=2, I=32, Hi=4,
         dI=32, topk=3, eps=1e-6, hc_eps=1e-6, B=2, S=42, theta=10000.0, ctheta=160000.0,
         yarn=dict(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1))


def inv_freq_for(ratio, rd=M["rd"]):
    if ratio == 0:
        return ref.rope_inv_freq(rd, M["theta"], None)
    return ref.rope_inv_freq(rd, M["ctheta"], M["yarn"])


def rn(g, *shape, std=1.0, mean=0.0):
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    return x * std + mean if (std != 1.0 or mean != 0.0) else x


def lin(g, out_f, in_f):
    return rn(g, out_f, in_f) / math.sqrt(in_f)


def module_fixture(name, g, inputs, params, fn, project, hyper, extra=None):
    """inputs / params: {name: float32 or int tensor}. fn(in64, p64) -> {out name: tensor}.
    L = Σ_{o in project} <dout.o, out.o>; grad.in.* / grad.param.* = dL/d(input / param) in fp64.
    Stored: in.*, param.*, out.*, dout.*, grad.in.*, grad.param.* (float32; ints as I32/I64)."""
    leaves = {}

    def prep(d, prefix):
        out = {}
        for k, v in d.items():
            if v.is_floating_point():
                v = v.to(F64).requires_grad_(True)
                leaves[prefix + k] = v
            out[k] = v
        return out

    i64, p64 = prep(inputs, "in."), prep(params, "param.")
    outs = fn(i64, p64)
    douts = {o: rn(g, *outs[o].shape) for o in project}
    tensors = {}
    for k, v in inputs.items():
        tensors["in." + k] = v
    for k, v in params.items():
        tensors["param." + k] = v
    for k, v in outs.items():
        tensors["out." + k] = v.detach().float() if v.is_floating_point() else v.to(torch.int32)
    for k, v in douts.items():
        tensors["dout." + k] = v
    if project:
        L = sum((outs[o] * douts[o].to(F64)).sum() for o in project)
        names = list(leaves)
        gs = torch.autograd.grad(L, [leaves[k] for k in names], allow_unused=True)
        for k, gr in zip(names, gs):
            tensors["grad." + k] = (torch.zeros_like(leaves[k]) if gr is None else gr).float()
    if extra:
        tensors.update(extra)
    return {f"modules/{name}.safetensors": ("st", tensors, {"hyper": json.dumps(hyper, sort_keys=True)})}, hyper


def hc_params(g, n, D, head=False):
    mix = n if head else (2 + n) * n
    return {"fn": rn(g, mix, n * D) / math.sqrt(n * D), "base": rn(g, mix, std=0.5),
            "scale": rn(g, 1 if head else 3, std=0.3, mean=1.0)}


def mod_hc_site(seed):
    g = torch.Generator().manual_seed(seed)
    B, S, n, D = 2, 5, M["n"], M["D"]
    inputs = {"X": rn(g, B, S, n, D), "out": rn(g, B, S, D)}
    params = hc_params(g, n, D)
    hyper = dict(hc_mult=n, hidden=D, rms_eps=M["eps"], hc_eps=M["hc_eps"], iters=M["iters"],
                 doc="u,post,comb = hc_pre(X); Xn = hc_post(out, X, post, comb); L = <dout.u,u> + <dout.Xn,Xn>")

    def fn(i, p):
        u, post, comb = ref.hc_pre(i["X"], p["fn"], p["base"], p["scale"], M["eps"], M["hc_eps"], M["iters"])
        return {"u": u, "post": post, "comb": comb, "Xn": ref.hc_post(i["out"], i["X"], post, comb)}
    return module_fixture("hc_site", g, inputs, params, fn, ["u", "Xn"], hyper)


def mod_hc_head(seed):
    g = torch.Generator().manual_seed(seed)
    B, S, n, D = 2, 5, M["n"], M["D"]
    inputs = {"X": rn(g, B, S, n, D)}
    params = hc_params(g, n, D, head=True)
    hyper = dict(hc_mult=n, hidden=D, rms_eps=M["eps"], hc_eps=M["hc_eps"], doc="h = hc_head(X)")

    def fn(i, p):
        return {"h": ref.hc_head(i["X"], p["fn"], p["base"], p["scale"], M["eps"], M["hc_eps"])}
    return module_fixture("hc_head", g, inputs, params, fn, ["h"], hyper)


def attn_params(g):
    D, H, d, ql, gr, r = M["D"], M["H"], M["d"], M["ql"], M["g"], M["r"]
    return {"wq_a.weight": lin(g, ql, D), "q_norm.weight": rn(g, ql, std=0.1, mean=1.0),
            "wq_b.weight": lin(g, H * d, ql), "wkv.weight": lin(g, d, D),
            "kv_norm.weight": rn(g, d, std=0.1, mean=1.0),
            "wo_a.weight": lin(g, gr * r, H * d // gr), "wo_b.weight": lin(g, D, gr * r),
            "attn_sink": rn(g, H)}


def random_picks(g, B, S, N, ratio, K):
    picks = torch.full((B, S, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(S):
            v = min(N, (t + 1) // ratio)
            if v == 0:
                continue
            chosen = torch.sort(torch.randperm(v, generator=g)[:min(K, v)]).values
            picks[b, t, :chosen.numel()] = chosen.to(torch.int32)
    return picks


def mod_attention(seed, ratio):
    g = torch.Generator().manual_seed(seed)
    B, S, D, d = M["B"], M["S"], M["D"], M["d"]
    inputs = {"x": rn(g, B, S, D)}
    N = S // ratio if ratio else 0
    if ratio:
        inputs["entries"] = rn(g, B, N, d)
    params = attn_params(g)
    picks = random_picks(g, B, S, N, ratio, min(M["topk"], N)) if ratio == 4 else None
    if picks is not None:
        inputs["picks"] = picks
    hyper = dict(hidden=D, n_heads=M["H"], head_dim=d, rope_dim=M["rd"], q_lora_rank=M["ql"],
                 o_groups=M["g"], o_lora_rank=M["r"], rms_eps=M["eps"], window=M["win"], ratio=ratio,
                 rope_theta=M["ctheta"] if ratio else M["theta"],
                 rope_scaling=dict(type="yarn", **M["yarn"]) if ratio else None,
                 doc="y = attention(x, entries, picks); L = <dout.y, y>; out.qr / out.o: forward aids")

    def fn(i, p):
        aux = {}
        y = ref.attention(i["x"], p, n_heads=M["H"], head_dim=d, rope_dim=M["rd"], o_groups=M["g"],
                          o_lora_rank=M["r"], eps=M["eps"], window=M["win"], ratio=ratio,
                          inv_freq=inv_freq_for(ratio), entries=i.get("entries"),
                          picks=i.get("picks"), aux=aux)
        return {"y": y, "qr": aux["qr"], "o": aux["o"]}
    return module_fixture(f"attention_r{ratio}", g, inputs, params, fn, ["y"], hyper)


def comp_params(g, ratio, d_c, D):
    coff = 2 if ratio == 4 else 1
    return {"wkv.weight": lin(g, coff * d_c, D), "wgate.weight": lin(g, coff * d_c, D),
            "ape": rn(g, ratio, coff * d_c, std=0.3), "norm.weight": rn(g, d_c, std=0.1, mean=1.0)}


def mod_compressor(seed, ratio):
    g = torch.Generator().manual_seed(seed)
    B, S, D, d = M["B"], M["S"], M["D"], M["d"]
    inputs = {"x": rn(g, B, S, D)}
    params = comp_params(g, ratio, d, D)
    hyper = dict(hidden=D, head_dim=d, rope_dim=M["rd"], ratio=ratio, overlap=ratio == 4,
                 rms_eps=M["eps"], rope_theta=M["ctheta"], rope_scaling=dict(type="yarn", **M["yarn"]),
                 doc="entries = compressor(x) [B, S // ratio, head_dim]; L = <dout.entries, entries>")

    def fn(i, p):
        return {"entries": ref.compressor(i["x"], p, ratio, d, inv_freq_for(ratio), M["eps"])}
    kind = "csa" if ratio == 4 else "hca"
    return module_fixture(f"compressor_{kind}", g, inputs, params, fn, ["entries"], hyper)


def indexer_params(g):
    D, ql, Hi, dI = M["D"], M["ql"], M["Hi"], M["dI"]
    p = {"wq_b.weight": lin(g, Hi * dI, ql), "weights_proj.weight": lin(g, Hi, D)}
    p.update({"compressor." + k: v for k, v in comp_params(g, 4, dI, D).items()})
    return p


def mod_indexer(seed0):
    for attempt in range(MAX_ATTEMPTS):
        seed = seed0 + attempt
        g = torch.Generator().manual_seed(seed)
        B, S, D = M["B"], M["S"], M["D"]
        inputs = {"x": rn(g, B, S, D), "qr": rn(g, B, S, M["ql"])}
        params = indexer_params(g)
        margins = []
        for dt in (F64, torch.float32):
            sc, _, _ = ref.indexer_scores(inputs["x"].to(dt), inputs["qr"].to(dt),
                                          {k: v.to(dt) for k, v in params.items()}, 4, M["Hi"],
                                          M["dI"], inv_freq_for(4), M["eps"])
            margins.append(ref.indexer_picks(sc, 4, M["topk"]))
        if float(margins[0][1].min()) > MIN_INDEX_GAP and torch.equal(margins[0][0], margins[1][0]):
            break
    else:
        raise RuntimeError("indexer: no seed with clear margins")
    hyper = dict(hidden=D, q_lora_rank=M["ql"], index_n_heads=M["Hi"], index_head_dim=M["dI"],
                 rope_dim=M["rd"], ratio=4, index_topk=M["topk"], rms_eps=M["eps"],
                 rope_theta=M["ctheta"], rope_scaling=dict(type="yarn", **M["yarn"]), seed=seed,
                 min_gap=fmt_margin(float(margins[0][1].min())),
                 doc="scores [B,S,N] unmasked; picks [B,S,K]: top min(topk, #visible) visible ids "
                     "ascending, -1 padded; qI / kI: rotated indexer queries / compressed keys; no "
                     "gradients (integer output)")

    def fn(i, p):
        sc, q, k = ref.indexer_scores(i["x"], i["qr"], p, 4, M["Hi"], M["dI"], inv_freq_for(4), M["eps"])
        picks, _ = ref.indexer_picks(sc, 4, M["topk"])
        return {"scores": sc, "picks": picks, "qI": q, "kI": k}
    return module_fixture("indexer", g, inputs, params, fn, [], hyper)


def mod_router(seed0, hash_):
    for attempt in range(MAX_ATTEMPTS):
        seed = seed0 + attempt
        g = torch.Generator().manual_seed(seed)
        T, D, E, k, V = 24, M["D"], M["E"], M["k"], 32
        x = rn(g, T, D)
        W = lin(g, E, D)
        inputs = {"x": x}
        params = {"weight": W}
        if hash_:
            tid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])
            ids = torch.randint(0, V, (T,), generator=g).to(torch.int32)
            # token 0: its first hash expert gets logit -40, so softplus (4e-18) is floored at 1e-12
            e0 = int(tid[int(ids[0]), 0])
            w0 = W[e0].double()
            x0 = x[0].double()
            x[0] = (x0 - ((w0 @ x0 + 40.0) / (w0 @ w0)) * w0).float()
            inputs["input_ids"] = ids
            params["tid2eid"] = tid
        else:
            params["bias"] = rn(g, E, std=0.05)
        _, _, margin = ref.route(x.double(), W.double(), k, 1.5, bias=None if hash_ else params["bias"].double(),
                                 tid2eid=params.get("tid2eid"), input_ids=inputs.get("input_ids"))
        if float(margin.min()) > MIN_ROUTE_GAP:
            break
    else:
        raise RuntimeError("router: no seed with clear margins")
    hyper = dict(hidden=D, n_experts=E, top_k=k, routed_scaling_factor=1.5, hash=hash_,
                 sqrtsoftplus_floor=ref.SQRTSOFTPLUS_FLOOR, seed=seed,
                 doc="ids [T,k] (descending selection score; hash: tid2eid order), weights [T,k] = "
                     "normalised sqrtsoftplus scores x 1.5; L = <dout.weights, weights>"
                     + ("; row 0 has a floored score (logit -40)" if hash_ else ""))

    def fn(i, p):
        ids, w, _ = ref.route(i["x"], p["weight"], k, 1.5, bias=p.get("bias"), tid2eid=p.get("tid2eid"),
                              input_ids=i.get("input_ids"))
        return {"ids": ids, "weights": w, "scores": ref.sqrtsoftplus(i["x"] @ p["weight"].t())}
    return module_fixture("router_hash" if hash_ else "router_topk", g, inputs, params, fn,
                          ["weights"], hyper)


def mod_expert(seed0):
    limit = 2.0
    for attempt in range(MAX_ATTEMPTS):
        seed = seed0 + attempt
        g = torch.Generator().manual_seed(seed)
        T, D, I = 16, M["D"], M["I"]
        inputs = {"x": rn(g, T, D, std=1.5), "route_weight": torch.rand(T, generator=g) + 0.25}
        params = {"w1.weight": lin(g, I, D), "w2.weight": lin(g, D, I), "w3.weight": lin(g, I, D)}
        tr = ref.Trace()
        x = inputs["x"].double()
        ref.swiglu_clamped(x, *(params[k].double() for k in ("w1.weight", "w2.weight", "w3.weight")),
                           limit, None, tr)
        if tr.clamp_margin > MIN_CLAMP_GAP:
            break
    else:
        raise RuntimeError("expert: no seed with clear margins")
    a = x @ params["w1.weight"].double().t()
    b = x @ params["w3.weight"].double().t()
    hyper = dict(hidden=D, intermediate=I, swiglu_limit=limit, seed=seed,
                 clamped_gate=int((a > limit).sum()), clamped_up=int((b.abs() > limit).sum()),
                 doc="y = w2(route_weight * silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)); "
                     "y_shared = the same without route_weight; L = <dout.y, y> + <dout.y_shared, y_shared>")

    def fn(i, p):
        w = (p["w1.weight"], p["w2.weight"], p["w3.weight"])
        return {"y": ref.swiglu_clamped(i["x"], *w, limit, i["route_weight"]),
                "y_shared": ref.swiglu_clamped(i["x"], *w, limit, None)}
    return module_fixture("expert_clamped", g, inputs, params, fn, ["y", "y_shared"], hyper)


def mod_moe(seed0, hash_):
    limit = 2.0
    B, S, D, E, k, I, V = 2, 12, 32, M["E"], M["k"], 16, 32
    for attempt in range(MAX_ATTEMPTS):
        seed = seed0 + attempt
        g = torch.Generator().manual_seed(seed)
        inputs = {"x": rn(g, B, S, D)}
        params = {"gate.weight": lin(g, E, D)}
        if hash_:
            params["gate.tid2eid"] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])
            inputs["input_ids"] = torch.randint(0, V, (B, S), generator=g).to(torch.int32)
        else:
            params["gate.bias"] = rn(g, E, std=0.05)
        for e in range(E):
            params[f"experts.{e}.w1.weight"] = lin(g, I, D)
            params[f"experts.{e}.w2.weight"] = lin(g, D, I)
            params[f"experts.{e}.w3.weight"] = lin(g, I, D)
        for w in ("w1", "w3"):
            params[f"shared_experts.{w}.weight"] = lin(g, I, D)
        params["shared_experts.w2.weight"] = lin(g, D, I)
        tr = ref.Trace()
        p64 = {kk: (v.double() if v.is_floating_point() else v) for kk, v in params.items()}
        ref.moe(inputs["x"].double(), p64, n_experts=E, top_k=k, scale=1.5, limit=limit, is_hash=hash_,
                input_ids=inputs.get("input_ids"), has_shared=True, trace=tr, name="m")
        if tr.route_margin > MIN_ROUTE_GAP and tr.clamp_margin > MIN_CLAMP_GAP:
            break
    else:
        raise RuntimeError("moe: no seed with clear margins")
    hyper = dict(hidden=D, n_experts=E, top_k=k, intermediate=I, n_shared_experts=1,
                 routed_scaling_factor=1.5, swiglu_limit=limit, hash=hash_, seed=seed,
                 doc="y = Σ_routed + shared over x [B,S,D] (after ffn_norm); keys as under "
                     "layers.L.ffn.; L = <dout.y, y>")

    def fn(i, p):
        t = ref.Trace()
        y = ref.moe(i["x"], p, n_experts=E, top_k=k, scale=1.5, limit=limit, is_hash=hash_,
                    input_ids=i.get("input_ids"), has_shared=True, trace=t, name="m")
        ids, w = t.routing["m"]
        return {"y": y, "ids": ids, "weights": w}
    return module_fixture("moe_hash" if hash_ else "moe_topk", g, inputs, params, fn, ["y"], hyper)


MODULES = [
    lambda: mod_hc_site(1001),
    lambda: mod_hc_head(1002),
    lambda: mod_attention(1003, 0),
    lambda: mod_attention(1004, 4),
    lambda: mod_attention(1005, 16),
    lambda: mod_compressor(1006, 4),
    lambda: mod_compressor(1007, 16),
    lambda: mod_indexer(1100),
    lambda: mod_router(1200, False),
    lambda: mod_router(1300, True),
    lambda: mod_expert(1400),
    lambda: mod_moe(1500, False),
    lambda: mod_moe(1600, True),
]


def all_files():
    files = {}
    index = {}
    for make in MODULES:
        f, hyper = make()
        files.update(f)
        (path,) = f.keys()
        index[os.path.splitext(os.path.basename(path))[0]] = hyper
    files["modules/modules.json"] = ("json", index)
    for name in CASES:
        files.update(case_files(name))
    return files


def write_files(files, root):
    for rel, spec in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if spec[0] == "json":
            with open(path, "w") as f:
                json.dump(spec[1], f, indent=2, sort_keys=True)
                f.write("\n")
        else:
            save_file(spec[1], path, spec[2] if len(spec) > 2 else None)


def check(files):
    tmp = tempfile.mkdtemp(prefix="v4fx")
    try:
        write_files(files, tmp)
        bad = [rel for rel in files
               if not os.path.exists(os.path.join(OUT, rel))
               or not filecmp.cmp(os.path.join(tmp, rel), os.path.join(OUT, rel), shallow=False)]
    finally:
        shutil.rmtree(tmp)
    for rel in bad:
        print(f"gen_v4_fixtures: {rel} differs from the regenerated bytes")
    print(f"gen_v4_fixtures --check: {len(files) - len(bad)} of {len(files)} files identical")
    return not bad


# --------------------------------------------------------------------------------------------------
# Self-test: invariants of the math, independent re-formulations, finite differences, fp32 replay
# --------------------------------------------------------------------------------------------------
class Checker:
    def __init__(self):
        self.failed = 0
        self.passed = 0

    def __call__(self, ok, what, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"  {'ok  ' if ok else 'FAIL'} {what}{(': ' + detail) if detail else ''}")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def sinkhorn_scalar(mixes, scale, base, n, iters, eps):
    """Sinkhorn of one token with Python floats and explicit loops (the scalar ports' form)."""
    m = [float(v) for v in mixes]
    sc = [float(v) for v in scale]
    bs = [float(v) for v in base]
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    pre = [sig(m[i] * sc[0] + bs[i]) + eps for i in range(n)]
    post = [2.0 * sig(m[n + i] * sc[1] + bs[n + i]) for i in range(n)]
    c = [[m[2 * n + i * n + j] * sc[2] + bs[2 * n + i * n + j] for j in range(n)] for i in range(n)]
    for i in range(n):
        mx = max(c[i])
        e = [math.exp(v - mx) for v in c[i]]
        tot = sum(e)
        c[i] = [v / tot + eps for v in e]

    def cols():
        for j in range(n):
            tot = sum(c[i][j] for i in range(n)) + eps
            for i in range(n):
                c[i][j] /= tot

    def rows():
        for i in range(n):
            tot = sum(c[i]) + eps
            c[i] = [v / tot for v in c[i]]
    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return pre, post, c


def attention_sparse(x, p, *, n_heads, head_dim, o_groups, o_lora_rank, eps, window, ratio, inv_freq,
                     entries=None, picks=None):
    """REF-style attention: per query, gather the index list (window ∪ compressed), softmax with the
    sink column; complex-multiply RoPE. An independent formulation of ref.attention."""
    B, S, _ = x.shape
    H, d = n_heads, head_dim
    rd = 2 * inv_freq.shape[0]
    ang = torch.arange(S, dtype=F64)[:, None] * inv_freq
    cis = torch.polar(torch.ones_like(ang), ang)                       # [S, rd/2]

    def rot(v, pos_cis):
        z = torch.view_as_complex(v[..., -rd:].contiguous().unflatten(-1, (-1, 2)))
        return torch.cat((v[..., :-rd], torch.view_as_real(z * pos_cis).flatten(-2)), dim=-1)

    def rms(v, w=None):
        y = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w
    qr = rms(torch.matmul(x, p["wq_a.weight"].t()), p["q_norm.weight"])
    q = rms(torch.matmul(qr, p["wq_b.weight"].t()).view(B, S, H, d))
    kv = rms(torch.matmul(x, p["wkv.weight"].t()), p["kv_norm.weight"])
    out = torch.zeros(B, S, H, d, dtype=F64)
    for b in range(B):
        for t in range(S):
            idx = list(range(max(0, t - window + 1), t + 1))
            keys = [rot(kv[b, j], cis[j]) for j in idx]
            if ratio and entries is not None:
                if picks is not None:
                    ws = [int(w) for w in picks[b, t] if int(w) >= 0]
                else:
                    ws = list(range(min(entries.shape[1], (t + 1) // ratio)))
                keys += [entries[b, w] for w in ws]
            K = torch.stack(keys)                                          # [n_keys, d]
            qt = rot(q[b, t], cis[t][None, :])                             # [H, d]
            logits = torch.cat((qt @ K.t() / math.sqrt(d), p["attn_sink"][:, None]), dim=1)
            pr = torch.softmax(logits, dim=1)[:, :-1]
            out[b, t] = rot(pr @ K, cis[t].conj()[None, :])
    g = o_groups
    og = out.reshape(B, S, g, H * d // g)
    wa = p["wo_a.weight"]
    z = torch.cat([og[:, :, j] @ wa[j * o_lora_rank:(j + 1) * o_lora_rank].t() for j in range(g)], dim=-1)
    return z @ p["wo_b.weight"].t()


def compressor_streaming(x, p, ratio, d, inv_freq, eps):
    """REF's decode path re-expressed: tokens arrive one at a time into a state of
    coff·ratio slots; a window is emitted when it completes (then the CSA state shifts)."""
    B, S, _ = x.shape
    overlap = ratio == 4
    coff = 2 if overlap else 1
    out = []
    for b in range(B):
        kv_state = torch.zeros(coff * ratio, coff * d, dtype=F64)
        sc_state = torch.full((coff * ratio, coff * d), -math.inf, dtype=F64)
        ents = []
        for t in range(S):
            c = x[b, t] @ p["wkv.weight"].t()
            z = x[b, t] @ p["wgate.weight"].t() + p["ape"][t % ratio]
            slot = (ratio if overlap else 0) + t % ratio
            kv_state[slot], sc_state[slot] = c, z
            if (t + 1) % ratio:
                continue
            if overlap:
                kvs = torch.cat((kv_state[:ratio, :d], kv_state[ratio:, d:]), dim=0)
                scs = torch.cat((sc_state[:ratio, :d], sc_state[ratio:, d:]), dim=0)
            else:
                kvs, scs = kv_state, sc_state
            pooled = (torch.softmax(scs, dim=0) * kvs).sum(0)
            e = pooled / torch.sqrt((pooled ** 2).mean() + eps) * p["norm.weight"]
            pos = t + 1 - ratio
            cos, sin = ref.rope_cos_sin(torch.tensor(pos), inv_freq, F64)
            ents.append(ref.apply_rope(e, cos, sin))
            if overlap:
                kv_state[:ratio] = kv_state[ratio:].clone()
                sc_state[:ratio] = sc_state[ratio:].clone()
        out.append(torch.stack(ents) if ents else torch.zeros(0, d, dtype=F64))
    return torch.stack(out)


def picks_loop(scores, ratio, topk):
    B, S, N = scores.shape
    K = min(topk, N)
    out = torch.full((B, S, K), -1, dtype=torch.long)
    for b in range(B):
        for t in range(S):
            vis = [w for w in range(N) if w < (t + 1) // ratio]
            best = sorted(vis, key=lambda w: -float(scores[b, t, w]))[:K]
            for i, w in enumerate(sorted(best)):
                out[b, t, i] = w
    return out


def fd_check(chk, what, f, tensors, n=4, h=1e-6, seed=0):
    """Central differences of the scalar f(tensors) at n random entries of every tensor."""
    g = torch.Generator().manual_seed(seed)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in tensors.items()}
    L = f(leaves)
    grads = torch.autograd.grad(L, list(leaves.values()), allow_unused=True)
    worst = 0.0
    for (k, v), gr in zip(leaves.items(), grads):
        gr = torch.zeros_like(v) if gr is None else gr
        flat = v.detach().clone().reshape(-1)
        for _ in range(n):
            i = int(torch.randint(0, flat.numel(), (1,), generator=g))
            vals = []
            for sgn in (1, -1):
                pert = flat.clone()
                pert[i] += sgn * h
                args = dict((kk, vv.detach()) for kk, vv in leaves.items())
                args[k] = pert.view_as(v)
                with torch.no_grad():
                    vals.append(float(f(args)))
            fd = (vals[0] - vals[1]) / (2 * h)
            an = float(gr.reshape(-1)[i])
            err = abs(fd - an) / (abs(an) + 1e-6 * max(1.0, abs(float(L))))
            worst = max(worst, err)
    chk(worst < 1e-4, f"finite differences: {what}", f"worst rel err {worst:.2e}")


def selftest():
    chk = Checker()
    D, H, d, n = M["D"], M["H"], M["d"], M["n"]
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(s, generator=g, dtype=F64)  # noqa: E731

    print("mHC / Sinkhorn")
    X = rnd(2, 5, n, D)
    hp = {k: v.double() for k, v in hc_params(torch.Generator().manual_seed(3), n, D).items()}
    u, post, comb = ref.hc_pre(X, hp["fn"], hp["base"], hp["scale"], M["eps"], M["hc_eps"], M["iters"])
    chk(float((comb.sum(-2) - 1).abs().max()) < 1e-5 and float((comb.sum(-1) - 1).abs().max()) < 1e-3,
        "comb doubly stochastic after 20 iterations",
        f"|colsum-1| {float((comb.sum(-2) - 1).abs().max()):.1e}, |rowsum-1| {float((comb.sum(-1) - 1).abs().max()):.1e}")
    chk(bool((comb > 0).all()) and bool((post > 0).all()) and bool((post < 2).all()), "comb > 0, post in (0, 2)")
    mixes = ref.hc_mixes(X, hp["fn"], M["eps"])
    pre_s, post_s, c_s = sinkhorn_scalar(mixes[1, 3], hp["scale"], hp["base"], n, M["iters"], M["hc_eps"])
    pre_v, post_v, c_v = ref.sinkhorn_split(mixes[1, 3], hp["scale"], hp["base"], n, M["iters"], M["hc_eps"])
    err = max(rel_err(pre_v, torch.tensor(pre_s, dtype=F64)), rel_err(post_v, torch.tensor(post_s, dtype=F64)),
              rel_err(c_v, torch.tensor(c_s, dtype=F64)))
    chk(err < 1e-13, "vectorised Sinkhorn == scalar loop", f"rel err {err:.1e}")
    Fo = rnd(2, 5, D)
    Xn = ref.hc_post(Fo, X, post, comb)
    manual = torch.stack([post[..., i, None] * Fo + sum(comb[..., j, i, None] * X[..., j, :] for j in range(n))
                          for i in range(n)], dim=-2)
    chk(rel_err(Xn, manual) < 1e-14, "hc_post consumes comb transposed (X'_i = post_i out + Σ_j C[j,i] X_j)")
    fd_check(chk, "hc_pre + hc_post", lambda t: (ref.hc_pre(t["X"], t["fn"], t["base"], t["scale"], M["eps"],
             M["hc_eps"], M["iters"])[0] * 0.7).sum() + (ref.hc_post(t["F"], t["X"], *ref.hc_pre(
                 t["X"], t["fn"], t["base"], t["scale"], M["eps"], M["hc_eps"], M["iters"])[1:]) ** 2).sum(),
             dict(X=X, F=Fo, **hp))
    hh = {k: v.double() for k, v in hc_params(torch.Generator().manual_seed(4), n, D, head=True).items()}
    fd_check(chk, "hc_head", lambda t: (ref.hc_head(t["X"], t["fn"], t["base"], t["scale"], M["eps"],
                                                    M["hc_eps"]) ** 2).sum(), dict(X=X, **hh))

    print("RoPE / YaRN")
    lo, hi = ref.yarn_correction_range(32, 1, 64, 160000.0, 65536)
    chk((lo, hi) == (15, 25), "YaRN range for V4-Flash (rope 64, θ 160000, L 65536) = [15, 25]", f"{(lo, hi)}")
    f_plain = ref.rope_inv_freq(64, 160000.0, None)
    f_yarn = ref.rope_inv_freq(64, 160000.0, dict(factor=16, original_max_position_embeddings=65536,
                                                  beta_fast=32, beta_slow=1))
    chk(torch.equal(f_plain[:16], f_yarn[:16]) and rel_err(f_yarn[25:], f_plain[25:] / 16) < 1e-15,
        "YaRN keeps dims < low, divides dims >= high by the factor")
    v = rnd(3, 5, 24)
    inv = inv_freq_for(4)
    cos, sin = ref.rope_cos_sin(torch.arange(3), inv, F64)
    r = ref.apply_rope(v, cos[:, None], sin[:, None])
    chk(rel_err(ref.apply_rope(r, cos[:, None], sin[:, None], inverse=True), v) < 1e-15
        and torch.equal(r[..., :8], v[..., :8]), "inverse RoPE undoes RoPE; nope dims untouched")
    ang = torch.arange(3, dtype=F64)[:, None] * inv
    z = torch.view_as_complex(v[..., -16:].contiguous().unflatten(-1, (-1, 2))) * torch.polar(
        torch.ones_like(ang), ang)[:, None]
    chk(rel_err(r[..., -16:], torch.view_as_real(z).flatten(-2)) < 1e-15, "RoPE == complex multiply of adjacent pairs")
    q1, k1 = rnd(16), rnd(16)
    dots = []
    for p0 in (0, 5):
        cq, sq = ref.rope_cos_sin(torch.tensor(p0 + 7), inv, F64)
        ck, sk = ref.rope_cos_sin(torch.tensor(p0 + 2), inv, F64)
        dots.append(float(ref.apply_rope(q1, cq, sq) @ ref.apply_rope(k1, ck, sk)))
    chk(abs(dots[0] - dots[1]) < 1e-12, "q·k depends on the relative position only")

    print("attention")
    ap = {k: v.double() for k, v in attn_params(torch.Generator().manual_seed(5)).items()}
    x = rnd(2, 42, D)
    kw = dict(n_heads=H, head_dim=d, o_groups=M["g"], o_lora_rank=M["r"], eps=M["eps"], window=M["win"])
    for ratio in (0, 4, 16):
        N = 42 // ratio if ratio else 0
        ent = rnd(2, N, d) if ratio else None
        pk = random_picks(torch.Generator().manual_seed(9), 2, 42, N, ratio, 3).long() if ratio == 4 else None
        aux = {}
        y = ref.attention(x, ap, rope_dim=M["rd"], ratio=ratio, inv_freq=inv_freq_for(ratio), entries=ent,
                          picks=pk, aux=aux, **kw)
        ys = attention_sparse(x, ap, ratio=ratio, inv_freq=inv_freq_for(ratio), entries=ent, picks=pk, **kw)
        chk(rel_err(y, ys) < 1e-13, f"r{ratio}: dense masked == per-query gathered (REF-style)",
            f"rel err {rel_err(y, ys):.1e}")
        tot = aux["probs"].sum(-1)
        chk(bool((tot < 1).all()) and rel_err(tot, 1 - aux["sink_prob"]) < 1e-14,
            f"r{ratio}: the sink takes mass (Σ p < 1, = 1 − p_sink)", f"max Σp {float(tot.max()):.4f}")
        t0 = 29
        x2 = x.clone()
        x2[:, t0:] += rnd(2, 42 - t0, D)
        ent2 = None
        if ratio:
            ent2 = ent.clone()
            ent2[:, t0 // ratio:] += rnd(2, N - t0 // ratio, d)   # entries no query < t0 may see
        y2 = ref.attention(x2, ap, rope_dim=M["rd"], ratio=ratio, inv_freq=inv_freq_for(ratio), entries=ent2,
                           picks=pk, **kw)
        chk(torch.equal(y[:, :t0], y2[:, :t0]) and not torch.equal(y[:, t0:], y2[:, t0:]),
            f"r{ratio}: queries before t0 ignore future tokens and invisible entries")
        if ratio:
            vis = aux["mask"][:, :, 42:]
            tq = torch.arange(42)
            far = (tq[:, None] - tq[None, :]) >= M["win"]
            chk(not bool(aux["mask"][:, :, :42][:, far].any()) and
                not bool((vis & ~ref.visible_entries(42, N, ratio)).any()),
                f"r{ratio}: no key outside the window, no invisible entry")
        fd_check(chk, f"attention r{ratio}", lambda t, ratio=ratio, pk=pk: (ref.attention(
            t["x"], t, rope_dim=M["rd"], ratio=ratio, inv_freq=inv_freq_for(ratio), entries=t.get("entries"),
            picks=pk, **kw) ** 2).sum(), dict(x=x, **({"entries": ent} if ratio else {}), **ap), n=2)

    print("compressor")
    for ratio in (4, 16):
        cp = {k: v.double() for k, v in comp_params(torch.Generator().manual_seed(11 + ratio), ratio, d, D).items()}
        e = ref.compressor(x, cp, ratio, d, inv_freq_for(ratio), M["eps"])
        es = compressor_streaming(x, cp, ratio, d, inv_freq_for(ratio), M["eps"])
        chk(e.shape == (2, 42 // ratio, d) and rel_err(e, es) < 1e-13,
            f"ratio {ratio}: batched == token-by-token streaming state (REF decode form)",
            f"rel err {rel_err(e, es):.1e}")
        t0 = 21
        x2 = x.clone()
        x2[:, t0:] += 1.0
        e2 = ref.compressor(x2, cp, ratio, d, inv_freq_for(ratio), M["eps"])
        chk(torch.equal(e[:, :t0 // ratio], e2[:, :t0 // ratio]) and not torch.equal(e, e2),
            f"ratio {ratio}: entries of windows ending before t0 ignore tokens >= t0")
        fd_check(chk, f"compressor ratio {ratio}", lambda t, ratio=ratio: (ref.compressor(
            t["x"], t, ratio, d, inv_freq_for(ratio), M["eps"]) ** 2).sum(), dict(x=x, **cp), n=3)

    print("indexer")
    ip = {k: v.double() for k, v in indexer_params(torch.Generator().manual_seed(13)).items()}
    qr = rnd(2, 42, M["ql"])
    sc, _, _ = ref.indexer_scores(x, qr, ip, 4, M["Hi"], M["dI"], inv_freq_for(4), M["eps"])
    for topk in (3, 20):
        pk, _ = ref.indexer_picks(sc, 4, topk)
        chk(torch.equal(pk, picks_loop(sc, 4, topk)), f"topk {topk}: vectorised picks == per-query loop")
        vis_n = torch.clamp((torch.arange(42) + 1) // 4, max=10)
        cnt = (pk >= 0).sum(-1)
        chk(torch.equal(cnt, torch.minimum(vis_n, torch.tensor(min(topk, 10))).expand(2, 42)) and
            bool(((pk < vis_n[None, :, None]) | (pk < 0)).all()),
            f"topk {topk}: min(topk, #visible) picks per query, all visible")
    x2 = x.clone()
    x2[:, 30:] += 1.0
    sc2, _, _ = ref.indexer_scores(x2, qr, ip, 4, M["Hi"], M["dI"], inv_freq_for(4), M["eps"])
    chk(torch.equal(ref.indexer_picks(sc, 4, 3)[0][:, :30], ref.indexer_picks(sc2, 4, 3)[0][:, :30]),
        "picks of queries before t0 ignore tokens >= t0")

    print("router / experts")
    xr = rnd(40, D)
    W = rnd(M["E"], D) / 8
    tid = torch.stack([torch.randperm(M["E"], generator=g)[:2] for _ in range(16)])
    ids_in = torch.randint(0, 16, (40,), generator=g)
    a_ids, a_w, _ = ref.route(xr, W, 2, 1.5, tid2eid=tid, input_ids=ids_in)
    b_ids, _, _ = ref.route(rnd(40, D), W, 2, 1.5, tid2eid=tid, input_ids=ids_in)
    chk(torch.equal(a_ids, b_ids) and torch.equal(a_ids, tid[ids_in]), "hash routing ignores x (ids = tid2eid[input_ids])")
    chk(rel_err(a_w.sum(-1), torch.full((40,), 1.5, dtype=F64)) < 1e-15, "routing weights sum to routed_scaling_factor")
    bias = rnd(M["E"]) * 0.05
    t_ids, t_w, _ = ref.route(xr, W, 2, 1.5, bias=bias)
    s = ref.sqrtsoftplus(xr @ W.t())
    chk(torch.equal(t_ids, torch.topk(s + bias, 2, dim=-1).indices) and
        rel_err(t_w, s.gather(1, t_ids) / s.gather(1, t_ids).sum(-1, keepdim=True) * 1.5) < 1e-15,
        "bias selects, unbiased scores weigh")
    lg = torch.tensor([-40.0, -200.0, 0.3], dtype=F64, requires_grad=True)
    sv = ref.sqrtsoftplus(lg)
    (gl,) = torch.autograd.grad(sv.sum(), lg)
    chk(abs(float(sv[0]) - 1e-6) < 1e-18 and bool(torch.isfinite(gl).all()) and float(gl[0]) == 0.0,
        "sqrtsoftplus floor: sqrt(max(softplus, 1e-12)), finite backward, no gradient when floored")
    mp = {kk: (v.double() if v.is_floating_point() else v) for kk, v in
          mod_moe_params(torch.Generator().manual_seed(17)).items()}
    xm = rnd(2, 12, 32) * 2
    y = ref.moe(xm, mp, n_experts=M["E"], top_k=2, scale=1.5, limit=2.0, is_hash=False, input_ids=None,
                has_shared=True)
    xf = xm.reshape(-1, 32)
    ids, w, _ = ref.route(xf, mp["gate.weight"], 2, 1.5, bias=mp["gate.bias"])
    dense = torch.stack([ref.swiglu_clamped(xf, mp[f"experts.{e}.w1.weight"], mp[f"experts.{e}.w2.weight"],
                                            mp[f"experts.{e}.w3.weight"], 2.0) for e in range(M["E"])], 1)
    gate = torch.zeros(xf.shape[0], M["E"], dtype=F64).scatter(1, ids, w)
    yd = (gate[..., None] * dense).sum(1) + ref.swiglu_clamped(
        xf, mp["shared_experts.w1.weight"], mp["shared_experts.w2.weight"], mp["shared_experts.w3.weight"], 2.0)
    chk(rel_err(y.reshape(-1, 32), yd) < 1e-14, "sparse MoE == dense (all experts × gate matrix)",
        f"rel err {rel_err(y.reshape(-1, 32), yd):.1e}")
    ex = {k: mp["experts.0." + k] for k in ("w1.weight", "w2.weight", "w3.weight")}
    xe = rnd(16, 32) * 2
    a = xe @ ex["w1.weight"].t()
    b = xe @ ex["w3.weight"].t()
    chk(bool((a > 2).any()) and bool((b.abs() > 2).any()), "expert test data crosses the clamp")
    fd_check(chk, "clamped SwiGLU expert", lambda t: (ref.swiglu_clamped(
        t["x"], t["w1.weight"], t["w2.weight"], t["w3.weight"], 2.0, t["rw"]) ** 2).sum(),
        dict(x=xe, rw=rnd(16).abs(), **ex))
    mpf = {k: v for k, v in mp.items() if k != "gate.bias"}
    fd_check(chk, "MoE layer (router weights + experts)", lambda t: (ref.moe(
        t["x"], dict(t, **{"gate.bias": mp["gate.bias"]}), n_experts=M["E"], top_k=2, scale=1.5, limit=2.0,
        is_hash=False, input_ids=None, has_shared=True) ** 2).sum(), dict(x=xm, **mpf), n=1)

    print("quantization simulation (quantization_simulation = reference)")
    for fmt, top in ((ref.FP8_E4M3, 448.0), (ref.FP4_E2M1, 6.0)):
        # the grid by its codes: (1 + m/2^mbits)·2^e for normals, m/2^mbits·2^emin below
        grid, even = [], []
        for m in range(2 ** fmt.mbits):
            grid.append(m / 2 ** fmt.mbits * 2.0 ** fmt.emin)
            even.append(m % 2 == 0)
        e = fmt.emin
        while (1.0 * 2.0 ** e) <= top:
            for m in range(2 ** fmt.mbits):
                if (1 + m / 2 ** fmt.mbits) * 2.0 ** e <= top:
                    grid.append((1 + m / 2 ** fmt.mbits) * 2.0 ** e)
                    even.append(m % 2 == 0)
            e += 1
        gt = torch.tensor(grid, dtype=F64)
        v = torch.cat((torch.rand(4000, generator=g, dtype=F64) * top,
                       (gt[1:] + gt[:-1]) / 2))                            # every tie too
        dist = (v[:, None] - gt[None, :]).abs()
        nearest = dist == dist.min(-1, keepdim=True).values               # one, or two at a tie
        nearest_even = nearest & torch.tensor(even)[None, :]
        pick = torch.where(nearest_even.any(-1), gt[nearest_even.float().argmax(-1)],
                           gt[nearest.float().argmax(-1)])
        chk(torch.equal(fmt.round(v), pick) and torch.equal(fmt.round(-v), -pick),
            f"{fmt.name}: nearest grid value, ties to the even code ({len(grid)} values up to {top:g})")
        q = ref.QuantSim()
        x = rnd(6, 64) * torch.logspace(-3, 3, 6, dtype=F64)[:, None]    # amax above the floors
        y = q.quant_dequant(x, fmt)
        amax = x.unflatten(-1, (-1, fmt.block)).abs().amax(-1)
        s = q.codes[0][2].squeeze(-1)
        chk(bool((torch.frexp(s)[0] == 0.5).all()) and bool((amax <= top * s).all()) and bool((amax > top * s / 2).all())
            and torch.equal(q.quant_dequant(y, fmt), y),
            f"{fmt.name}: scales 2^ceil(log2(amax / {top:g})), values it holds stay")
    for n in (1, 2, 32, 128):
        h = ref.hadamard_matrix(n)
        chk(torch.equal(h @ h.t(), n * torch.eye(n, dtype=F64)) and torch.equal(h, h.t()),
            f"Hadamard {n}: H = Hᵀ, H·Hᵀ = n·I (the rotation H/√n is orthonormal)")
    sim = ref.QuantSim()
    x = rnd(3, 80).requires_grad_(True)
    w = rnd(3, 80)
    y = sim.fp8_nope(x, 16)
    (gx,) = torch.autograd.grad((y * w).sum(), x)
    chk(torch.equal(y[:, 64:], x[:, 64:]) and not torch.equal(y[:, :64], x[:, :64]) and torch.equal(gx, w),
        "fp8_nope: rope tail untouched, straight-through gradient")

    print("whole model")
    for name in CASES:
        cfg, state, tokens, targets, seed, _ = case_state(name)
        res, tr = run_model(cfg, state, tokens, targets, F64, grads=True)
        r32, t32 = run_model(cfg, state, tokens, targets, torch.float32, grads=True)
        worst_g, worst_k = max((rel_err(r32["grads"][k], v), k) for k, v in res["grads"].items()
                               if float(v.norm()) > 0)
        chk(same_decisions(tr, t32) and rel_err(r32["logits"], res["logits"]) < 1e-5,
            f"{name}: fp32 replay takes the same routes/picks",
            f"logits rel {rel_err(r32['logits'], res['logits']):.1e}, loss rel "
            f"{abs(float(r32['loss']) / float(res['loss']) - 1):.1e}, worst grad tensor rel {worst_g:.1e} ({worst_k})")
        zero = [k for k, v in res["grads"].items() if float(v.abs().max()) == 0]
        expected_zero = all(".indexer." in k or ".experts." in k for k in zero)
        chk(expected_zero and any(".indexer." in k for k in zero) == any(
            cfg.ratio(L) == 4 for L in range(cfg.num_hidden_layers)),
            f"{name}: zero gradients only for the indexer and unrouted experts", f"{len(zero)} tensors")
        t0 = tokens.shape[1] - 13
        tok2 = tokens.clone()
        tok2[:, t0:] = torch.flip(tok2[:, t0:], dims=[1])
        tok2[:, t0] = (tokens[:, t0] + 1) % cfg.vocab_size
        with torch.no_grad():
            l1, m1 = ref.forward(to_dtype(state, F64, False), cfg, tokens, mtp=cfg.num_nextn_predict_layers > 0)
            l2, m2 = ref.forward(to_dtype(state, F64, False), cfg, tok2, mtp=cfg.num_nextn_predict_layers > 0)
        # (not bitwise: an expert's GEMM sees a different row count when later tokens route
        # differently, and OpenBLAS rounds the same row differently then)
        ok = rel_err(l2[:, :t0], l1[:, :t0]) < 1e-13 and rel_err(l2[:, t0:], l1[:, t0:]) > 1e-3
        if m1 is not None:
            ok = ok and rel_err(m2[:, :t0 - 1], m1[:, :t0 - 1]) < 1e-13 and rel_err(m2[:, t0 - 1], m1[:, t0 - 1]) > 1e-3
        chk(ok, f"{name}: changing tokens >= t0 leaves logits before t0 (MTP: before t0-1) unchanged",
            f"rel change before t0 {rel_err(l2[:, :t0], l1[:, :t0]):.1e}")
        picks = [k for k in ("layers.1.attn.compressor.ape", "layers.0.attn.attn_sink", "layers.0.hc_attn_scale",
                             "layers.1.attn.wo_a.weight", "layers.2.attn.compressor.wgate.weight",
                             "layers.1.ffn.gate.weight", "layers.0.ffn.experts.3.w1.weight", "hc_head_fn",
                             "mtp.0.e_proj.weight", "mtp.0.hc_ffn_base", "embed.weight", "head.weight",
                             "layers.0.attn.compressor.ape", "layers.0.ffn.gate.weight",
                             "layers.0.attn.kv_norm.weight")
                 if k in state]
        p64 = to_dtype(state, F64, False)
        # Quantization is piecewise constant, and its gradient straight-through: differentiate
        # the smooth stand-in that adds this forward's quantization errors as constants, whose
        # value and gradient here are the model's (checked first).
        replay = tr.qsim.offsets if cfg.quantization_simulation != "none" else None

        def loss_of(t, cfg=cfg, tokens=tokens, targets=targets, p64=p64, replay=replay):
            pp = dict(p64)
            pp.update(t)
            trace = ref.Trace()
            if replay is not None:
                trace.qsim = ref.QuantSim(replay=replay)
            lg, ml = ref.forward(pp, cfg, tokens, mtp=cfg.num_nextn_predict_layers > 0, trace=trace)
            return ref.loss_fn(lg, ml, targets, MTP_LOSS_SCALE)[0]
        if replay is not None:
            leaves = {k: p64[k].clone().requires_grad_(True) for k in picks}
            stand_in = loss_of(leaves)
            gs = torch.autograd.grad(stand_in, list(leaves.values()))
            err = max(rel_err(gr, res["grads"][k]) for k, gr in zip(picks, gs))
            chk(abs(float(stand_in) - float(res["loss"])) < 1e-14 * abs(float(res["loss"])) and err < 1e-12,
                f"{name}: the stand-in has the model's loss and (straight-through) gradients",
                f"worst grad rel {err:.1e}")
        fd_check(chk, f"{name}: loss vs {len(picks)} parameter tensors", loss_of, {k: p64[k] for k in picks}, n=2)
        if cfg.quantization_simulation != "none":
            plain = ref.V4Config.from_dict(dict(vars(cfg), quantization_simulation="none"))
            r0, t0_ = run_model(plain, state, tokens, targets, F64, grads=False)
            changed = sum(int((tr.picks[k] != t0_.picks[k]).any(-1).sum()) for k in tr.picks)
            chk(rel_err(res["logits"], r0["logits"]) > 1e-3 and changed > 0,
                f"{name}: the simulation changes the logits and some indexer picks",
                f"logits rel {rel_err(res['logits'], r0['logits']):.1e}, {changed} queries' picks")
    print(f"selftest: {chk.passed} passed, {chk.failed} failed")
    return chk.failed == 0


def mod_moe_params(g, D=32, I=16):
    E = M["E"]
    p = {"gate.weight": lin(g, E, D), "gate.bias": rn(g, E, std=0.05)}
    for e in range(E):
        p[f"experts.{e}.w1.weight"] = lin(g, I, D)
        p[f"experts.{e}.w2.weight"] = lin(g, D, I)
        p[f"experts.{e}.w3.weight"] = lin(g, I, D)
    for w in ("w1", "w3"):
        p[f"shared_experts.{w}.weight"] = lin(g, I, D)
    p["shared_experts.w2.weight"] = lin(g, D, I)
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--selftest", action="store_true")
    args = ap.parse_args()
    setup_determinism()
    if args.selftest:
        sys.exit(0 if selftest() else 1)
    files = all_files()
    if args.check:
        sys.exit(0 if check(files) else 1)
    write_files(files, OUT)
    total = sum(os.path.getsize(os.path.join(OUT, r)) for r in files)
    print(f"gen_v4_fixtures: wrote {len(files)} files, {total / 1e6:.2f} MB, torch {torch.__version__}")


if __name__ == "__main__":
    main()
