"""Plain PyTorch reference of DeepSeek-V4 (V4-Flash family), written from the public math.

Functional pieces, each usable alone and dtype-agnostic (the fixtures run them in float64 from
float32 weights); autograd gives the backward. Parameters are looked up in a flat dict keyed by
the released checkpoint's names (SPEC §6.3 / §6.10: `embed.weight`, `layers.L.attn.wq_a.weight`,
`layers.L.hc_attn_fn`, `layers.L.ffn.gate.tid2eid`, `mtp.0.e_proj.weight`, `head.weight`, ...).
The per-module functions take the sub-dict of one module with the prefix removed (`sub(p, pre)`).

Sources of the math (read, not copied): SPEC §6; DeepSeek's V4 inference `model.py` (REF),
Hugging Face transformers `models/deepseek_v4/modeling_deepseek_v4.py` (HF), NeMo Automodel
`components/models/deepseek_v4` (AM). Conventions fixed here (details: tests/fixtures/v4/README.md):

  * mHC (SPEC §6.4): mixes = (fn · flat(X)) · rsqrt(mean(flat(X)²) + rms_eps);
    pre = sigmoid(m·s0 + b) + hc_eps, post = 2·sigmoid(m·s1 + b), comb = row softmax + hc_eps, then
    one column normalisation and iters−1 (row, column) passes, each x / (sum + hc_eps).
    hc_post: X'_i = post_i · out + Σ_j comb[j, i] · X_j (comb used transposed).
  * RoPE: adjacent pairs (2i, 2i+1) of the LAST rope_dim features (DeepSeek's complex view);
    x'_{2i} = x_{2i} cos − x_{2i+1} sin, x'_{2i+1} = x_{2i} sin + x_{2i+1} cos; angle = pos · f_i,
    f_i = θ^(−2i/rope_dim), computed in float64. Ratio-0 layers: θ = rope_theta, no YaRN.
    Compressed layers (attention Q/KV, compressor, indexer): θ = compress_rope_theta with YaRN
    frequency interpolation applied unconditionally (REF precompute_freqs_cis with
    original_seq_len > 0), no mscale. Inverse rotation (−sin) on the attention output.
  * Attention: local window = keys max(0, t−win+1)..t; compressed entry w visible iff
    w < floor((t+1)/ratio); HCA attends every visible entry, CSA the indexer's picks; a per-head
    sink logit is one more softmax column with a zero value; scale head_dim^-0.5.
  * CSA ⇔ ratio == 4 (overlapping windows, coff 2, indexer), as in REF; any other ratio > 0 is
    HCA (coff 1, no indexer).
  * Simulated low precision (config quantization_simulation, SPEC §6.5 / §6.6): "none" (the
    default, as HF and AM) quantizes nothing. "reference" does what REF's forward does (REF
    kernel.py act_quant / fp4_act_quant with inplace=True, model.py rotate_activation): the
    attention's KV and the main compressor's entries, after their RoPE, FP8-E4M3 quantize-
    dequantized on their non-rope features in blocks of 64; the indexer's q (per head, after
    RoPE) and its compressor's entries Hadamard-rotated (orthonormal, Sylvester order) then
    FP4-E2M1 quantize-dequantized in blocks of 32. Per block s = 2^ceil(log2(amax / max)) with
    amax = max(max|x|, floor) (FP8: max 448, floor 1e-4; FP4: max 6, floor 6·2^-126), values
    rounded to the format's grid (nearest, ties to even) within ±max, times s. The KV's
    gradient passes the quantization as identity (straight-through); the indexer has none.
    (REF rounds its bf16 activations; here the dtype's own values are rounded.)
  * Indexer: picks per query: the top min(index_topk, #visible) visible entries, stored in
    ascending id order, padded with −1 to K = min(index_topk, #entries).
  * Router: s = sqrt(max(softplus(W·x), 1e-12)) (the floor is AM's: it keeps the backward of
    sqrt finite where softplus underflows; clamp_min passes no gradient to floored entries);
    non-hash layers select top-k of s + bias (bias for selection only, ties to the lower id),
    hash layers (layer < num_hash_layers) take tid2eid[input_id]; w = s[idx] / Σ s[idx] (exact,
    no 1e-20) × routed_scaling_factor. Ids per token in descending selection order (hash:
    tid2eid's order).
  * Experts (routed and shared): a = min(w1·x, limit), b = clamp(w3·x, −limit, limit),
    h = silu(a)·b, h ← w_route·h (routed only), y = w2·h; limit 0 disables the clamp.
  * MTP depth 1 (SPEC §6.8): ids rolled left by one with 0 written in the last slot (AM
    roll_tensor); X_in,i = e_proj(enorm(embed(id'))) + h_proj(hnorm(X_i)) over the main model's
    final 4-stream state (before hc_head); one block (non-hash, ratio compress_ratios[n_layers]);
    own hc_head + norm; shared head. Targets rolled the same way with −100 in the last slot;
    loss = CE + mtp_loss_scale · CE_mtp (mtp_loss_scale = 0.1 / depths).
"""
import math

import torch
import torch.nn.functional as F

SQRTSOFTPLUS_FLOOR = 1e-12


# --------------------------------------------------------------------------------------------------
# Configuration (HF config.json field names; defaults = the released V4-Flash config.json)
# --------------------------------------------------------------------------------------------------
class V4Config:
    defaults = dict(
        model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43,
        num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=2048, routed_scaling_factor=1.5,
        norm_topk_prob=True, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
        num_hash_layers=3, hidden_act="silu", swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536,
                          beta_fast=32, beta_slow=1),
        max_position_embeddings=1048576, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
        tie_word_embeddings=False, compress_ratios=None, quantization_simulation="none",
    )

    def __init__(self, **kw):
        for k, v in self.defaults.items():
            setattr(self, k, kw.pop(k, v))
        for k, v in kw.items():
            setattr(self, k, v)
        if self.compress_ratios is None:
            self.compress_ratios = [0] * (self.num_hidden_layers + self.num_nextn_predict_layers)
        if len(self.compress_ratios) < self.num_hidden_layers + self.num_nextn_predict_layers:
            raise ValueError("compress_ratios needs num_hidden_layers + num_nextn_predict_layers entries")
        if self.scoring_func != "sqrtsoftplus" or not self.norm_topk_prob:
            raise ValueError("V4 reference: scoring_func sqrtsoftplus with norm_topk_prob only")
        if self.n_shared_experts not in (0, 1):
            raise ValueError("n_shared_experts must be 0 or 1")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError("o_groups must divide num_attention_heads * head_dim")
        if self.quantization_simulation not in ("none", "reference"):
            raise ValueError("quantization_simulation must be 'none' or 'reference'")

    @classmethod
    def from_dict(cls, d):
        return cls(**dict(d))

    def ratio(self, layer):  # layer index; num_hidden_layers + d is MTP depth d
        return int(self.compress_ratios[layer])

    def is_hash(self, layer):
        return layer < self.num_hash_layers

    def yarn(self):
        rs = self.rope_scaling
        if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
            return None
        return dict(factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)))

    def inv_freq(self, ratio):
        """RoPE frequencies of a layer with this compress ratio (float64, [rope_dim/2])."""
        if ratio == 0:
            return rope_inv_freq(self.qk_rope_head_dim, self.rope_theta, None)
        return rope_inv_freq(self.qk_rope_head_dim, self.compress_rope_theta, self.yarn())


def sub(params, prefix):
    """The entries of `params` under `prefix` (e.g. 'layers.2.attn.'), prefix removed."""
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


# --------------------------------------------------------------------------------------------------
# Norms, RoPE
# --------------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    """x · rsqrt(mean(x²) + eps) over the last dim, times weight (None: weightless)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def yarn_correction_range(beta_fast, beta_slow, dim, base, original_len):
    def corr(rot):
        return dim * math.log(original_len / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = math.floor(corr(beta_fast))
    high = math.ceil(corr(beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(rope_dim, theta, yarn=None):
    """f_i = θ^(−2i/rope_dim), i < rope_dim/2, float64; with YaRN (REF precompute_freqs_cis):
    f_i' = f_i/factor · ramp_i + f_i · (1 − ramp_i), ramp = clamp((i − low)/(high − low), 0, 1)."""
    f = float(theta) ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if yarn is not None and yarn["original_max_position_embeddings"] > 0:
        low, high = yarn_correction_range(yarn["beta_fast"], yarn["beta_slow"], rope_dim,
                                          float(theta), yarn["original_max_position_embeddings"])
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        f = f / yarn["factor"] * ramp + f * (1 - ramp)
    return f


def rope_cos_sin(positions, inv_freq, dtype):
    """cos, sin [*positions.shape, rope_dim/2] (angles in float64, then cast to dtype)."""
    ang = positions.to(torch.float64)[..., None] * inv_freq
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin, inverse=False):
    """Rotate the adjacent pairs of the last 2·cos.shape[-1] features of x. cos/sin must broadcast
    against x[..., :rd/2] (e.g. [S, 1, rd/2] for x [B, S, H, d]). inverse: rotate by −angle."""
    rd = 2 * cos.shape[-1]
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = rope.unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rot), dim=-1)


# --------------------------------------------------------------------------------------------------
# Simulated low precision (quantization_simulation = "reference"; module docstring)
# --------------------------------------------------------------------------------------------------
class GridFormat:
    """A small float format by its grid: |value| <= max, steps of 2^(max(floor(log2|v|), emin) −
    mbits) (emin: the smallest normal exponent; below it the subnormal step)."""

    def __init__(self, name, max_value, emin, mbits, block, amax_floor):
        self.name, self.max, self.emin, self.mbits = name, max_value, emin, mbits
        self.block, self.amax_floor = block, amax_floor

    def step(self, a):
        """Grid step of magnitudes a >= 0 (at a power of two: the step above it)."""
        e = torch.where(a > 0, torch.frexp(a)[1].to(a.dtype) - 1, torch.full_like(a, self.emin))
        return torch.pow(2.0, torch.clamp(e, min=self.emin) - self.mbits)   # e: floor(log2 a)

    def round(self, v):
        """Nearest grid value of v (|v| <= max), ties to the even multiple of the step."""
        st = self.step(v.abs())
        return torch.round(v / st) * st

    def boundary_distance(self, v, q):
        """|v − the nearest rounding midpoint| around q = round(v): midpoints with q's grid
        neighbours (none above max, none below 0, where ±0 decode alike)."""
        a, qa = v.abs(), q.abs()
        up = torch.where(qa < self.max, qa + self.step(qa) / 2, torch.full_like(qa, math.inf))
        # the neighbour below q: a step of the binade below when q is a power of two above emin
        st_below = torch.where((torch.frexp(qa)[0] == 0.5) & (qa > 2.0 ** self.emin),
                               self.step(qa) / 2, self.step(qa))
        down = torch.where(qa > 0, qa - st_below / 2, torch.full_like(qa, -math.inf))
        return torch.minimum(up - a, a - down)


FP8_E4M3 = GridFormat("fp8_e4m3", 448.0, -6, 3, 64, 1e-4)
FP4_E2M1 = GridFormat("fp4_e2m1", 6.0, 0, 1, 32, 6 * 2.0 ** -126)


def hadamard_matrix(n, dtype=torch.float64):
    """Sylvester's H_n (H_1 = [1], H_2m = [[H, H], [H, −H]]), n a power of two, unnormalised."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    if h.shape[0] != n:
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    return h


class QuantSim:
    """The "reference" simulation, recording every decision it takes: `margin` is the smallest
    distance of a quantized value to a rounding midpoint, or of a block's amax to a scale
    threshold max·2^k, relative to its block's amax (the scale of a float implementation's
    rounding errors in that block), over the whole forward; `codes` lists per call the rounded
    grid values x / s and the scales, to compare the decisions of two dtypes."""

    def __init__(self, replay=None):
        self.margin = math.inf
        self.codes = []
        self.inputs = []      # per call (x blocks, block amax) before quantization
        self.offsets = []     # per call the quantization error q(x) − x
        self.replay = replay  # offsets of an earlier forward: then x ↦ x + offset (a smooth
                              # stand-in whose derivative is the straight-through gradient)

    def quant_dequant(self, x, fmt):
        """Block quantize-dequantize of x's last dim (a multiple of fmt.block); no gradient."""
        x = x.detach()
        if self.replay is not None:
            off = self.replay[len(self.offsets)]
            self.offsets.append(off)
            return x + off
        xb = x.unflatten(-1, (-1, fmt.block))
        amax = xb.abs().amax(-1, keepdim=True).clamp_min(fmt.amax_floor)
        m, e = torch.frexp(amax / fmt.max)
        s = torch.pow(2.0, torch.where(m == 0.5, e - 1, e).to(x.dtype))   # 2^ceil(log2(amax/max))
        v = (xb / s).clamp(-fmt.max, fmt.max)
        q = fmt.round(v)
        self.codes.append((fmt.name, q, s))
        self.inputs.append((xb, amax))
        rounding = (fmt.boundary_distance(v, q) * s).amin(-1, keepdim=True)
        scale = torch.minimum(amax - fmt.max * s / 2, fmt.max * s - amax)
        self.margin = min(self.margin, float((torch.minimum(rounding, scale) / amax).min()))
        out = (q * s).flatten(-2)
        self.offsets.append(out - x)
        return out

    def fp8_nope(self, x, rope_dim):
        """The attention KV / main compressor entries: FP8 on the first d − rope_dim features;
        the gradient passes as identity (straight-through)."""
        nope = x[..., :x.shape[-1] - rope_dim]
        sim = self.quant_dequant(nope, FP8_E4M3) + (nope - nope.detach())
        return torch.cat((sim, x[..., x.shape[-1] - rope_dim:]), dim=-1)

    def hadamard_fp4(self, x):
        """The indexer's q and keys: orthonormal Hadamard rotation, then FP4 (no gradient)."""
        n = x.shape[-1]
        rotated = x @ hadamard_matrix(n, x.dtype) * n ** -0.5       # H is symmetric
        return self.quant_dequant(rotated, FP4_E2M1)


# --------------------------------------------------------------------------------------------------
# Manifold-constrained hyper-connections (SPEC §6.4)
# --------------------------------------------------------------------------------------------------
def sinkhorn_split(mixes, scale, base, n, iters, eps_hc):
    """mixes [..., (2+n)·n] -> pre [..., n], post [..., n], comb [..., n, n]."""
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps_hc
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = mixes[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(logits, dim=-1) + eps_hc
    comb = comb / (comb.sum(-2, keepdim=True) + eps_hc)          # columns first
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps_hc)      # rows
        comb = comb / (comb.sum(-2, keepdim=True) + eps_hc)      # columns
    return pre, post, comb


def hc_mixes(X, fn, eps_rms):
    flat = X.flatten(-2)
    return (flat @ fn.t()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps_rms)


def hc_pre(X, fn, base, scale, eps_rms, eps_hc, iters):
    """X [..., n, D] -> (u [..., D] = Σ_i pre_i X_i, post [..., n], comb [..., n, n])."""
    n = X.shape[-2]
    pre, post, comb = sinkhorn_split(hc_mixes(X, fn, eps_rms), scale, base, n, iters, eps_hc)
    u = (pre.unsqueeze(-1) * X).sum(-2)
    return u, post, comb


def hc_post(out, X, post, comb):
    """X'_i = post_i · out + Σ_j comb[j, i] · X_j; out [..., D], X [..., n, D]."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), X)


def hc_head(X, fn, base, scale, eps_rms, eps_hc):
    """Final collapse: pre = sigmoid(mixes·scale + base) + eps_hc; h = Σ_i pre_i X_i."""
    pre = torch.sigmoid(hc_mixes(X, fn, eps_rms) * scale + base) + eps_hc
    return (pre.unsqueeze(-1) * X).sum(-2)


# --------------------------------------------------------------------------------------------------
# Compressor (SPEC §6.6)
# --------------------------------------------------------------------------------------------------
def compressor(x, p, ratio, head_dim, inv_freq, eps, simulate=None):
    """x [B, S, D]; p: wkv.weight, wgate.weight [coff·d_c, D], ape [ratio, coff·d_c],
    norm.weight [d_c]. Returns the entries [B, S // ratio, d_c] (complete windows only), RMS-
    normalised and rotated (last rope dims) at position w·ratio, then simulate(entries) if given
    (QuantSim.fp8_nope / hadamard_fp4)."""
    B, S, _ = x.shape
    d = head_dim
    overlap = ratio == 4
    n = S // ratio
    if n == 0:
        return x.new_zeros(B, 0, d)
    xs = x[:, :n * ratio]
    kv = (xs @ p["wkv.weight"].t()).unflatten(1, (n, ratio))          # [B, n, ratio, coff·d]
    sc = (xs @ p["wgate.weight"].t()).unflatten(1, (n, ratio)) + p["ape"]
    if overlap:
        # slots [0, ratio): window w−1's tokens, first half; [ratio, 2·ratio): window w's, second half
        prev_kv = torch.cat((kv.new_zeros(B, 1, ratio, d), kv[:, :-1, :, :d]), dim=1)
        prev_sc = torch.cat((sc.new_full((B, 1, ratio, d), -math.inf), sc[:, :-1, :, :d]), dim=1)
        kv = torch.cat((prev_kv, kv[..., d:]), dim=2)
        sc = torch.cat((prev_sc, sc[..., d:]), dim=2)
    pooled = (torch.softmax(sc, dim=2) * kv).sum(dim=2)                # softmax per feature
    e = rms_norm(pooled, p["norm.weight"], eps)
    cos, sin = rope_cos_sin(torch.arange(n) * ratio, inv_freq, x.dtype)
    e = apply_rope(e, cos, sin)
    return e if simulate is None else simulate(e)


def visible_entries(S, n_entries, ratio):
    """[S, N] bool: entry w visible to query t iff w < floor((t+1)/ratio)."""
    t = torch.arange(S)
    return torch.arange(n_entries)[None, :] < ((t + 1) // ratio)[:, None]


# --------------------------------------------------------------------------------------------------
# Lightning indexer (SPEC §6.6)
# --------------------------------------------------------------------------------------------------
def indexer_scores(x, qr, p, ratio, n_heads, head_dim, inv_freq, eps, simulate=None):
    """x [B,S,D], qr [B,S,q_lora] -> (I [B,S,N] (unmasked), qI [B,S,Hi,dI], kI [B,N,dI]).
    p: wq_b.weight [Hi·dI, q_lora], weights_proj.weight [Hi, D], compressor.* (d_c = dI).
    simulate (QuantSim.hadamard_fp4): applied to q per head after its RoPE and to the keys."""
    B, S, _ = x.shape
    kI = compressor(x, sub(p, "compressor."), ratio, head_dim, inv_freq, eps, simulate)
    q = (qr @ p["wq_b.weight"].t()).unflatten(-1, (n_heads, head_dim))
    cos, sin = rope_cos_sin(torch.arange(S), inv_freq, x.dtype)
    q = apply_rope(q, cos[:, None], sin[:, None])
    if simulate is not None:
        q = simulate(q)
    w = (x @ p["weights_proj.weight"].t()) * (head_dim ** -0.5 * n_heads ** -0.5)
    s = torch.einsum("bshd,bnd->bshn", q, kI).relu()
    return (s * w.unsqueeze(-1)).sum(2), q, kI


def indexer_picks(scores, ratio, topk):
    """scores [B,S,N] -> (picks [B,S,K] int64, ascending ids then −1; K = min(topk, N);
    margin [B,S]: the gap between the last kept and first dropped visible score, +inf where every
    visible entry is kept). Ties (never in the fixtures) go to the lower id."""
    B, S, N = scores.shape
    K = min(topk, N)
    if K == 0:
        return torch.zeros(B, S, 0, dtype=torch.long), torch.full((B, S), math.inf)
    vis = visible_entries(S, N, ratio)
    nvis = vis.sum(-1)                                                      # [S]
    masked = scores.detach().masked_fill(~vis, -math.inf)
    vals, order = torch.sort(masked, dim=-1, descending=True, stable=True)
    keep = torch.arange(K)[None, :] < nvis[:, None]                         # [S, K]
    top = torch.where(keep, order[..., :K], torch.full_like(order[..., :K], N))
    picks = torch.sort(top, dim=-1).values
    picks = torch.where(picks == N, torch.full_like(picks, -1), picks)
    margin = torch.full((B, S), math.inf, dtype=scores.dtype)
    if K < N:
        gap = vals[..., K - 1] - vals[..., K]
        margin = torch.where((nvis > K)[None, :], gap, margin)
    return picks, margin


# --------------------------------------------------------------------------------------------------
# Attention (SPEC §6.5)
# --------------------------------------------------------------------------------------------------
def attention(x, p, *, n_heads, head_dim, rope_dim, o_groups, o_lora_rank, eps, window, ratio,
              inv_freq, entries=None, picks=None, aux=None, simulate_kv=None):
    """x [B,S,D] (after attn_norm) -> y [B,S,D].
    p: wq_a.weight [q_lora, D], q_norm.weight, wq_b.weight [H·d, q_lora], wkv.weight [d, D],
    kv_norm.weight [d], wo_a.weight [g·r, H·d/g], wo_b.weight [D, g·r], attn_sink [H].
    entries [B,N,d]: compressed KV (ratio > 0), already normalised and rotated; picks [B,S,K]
    (CSA, −1 = unused): the entries each query attends; None with entries = all visible (HCA).
    aux (dict, optional) receives qr, q, kv, probs, sink_prob, o. simulate_kv
    (QuantSim.fp8_nope): applied to kv after its RoPE (the entries come simulated already)."""
    B, S, _ = x.shape
    H, d, g = n_heads, head_dim, o_groups
    assert 2 * inv_freq.shape[0] == rope_dim
    qr = rms_norm(x @ p["wq_a.weight"].t(), p["q_norm.weight"], eps)
    q = rms_norm((qr @ p["wq_b.weight"].t()).unflatten(-1, (H, d)), None, eps)
    kv = rms_norm(x @ p["wkv.weight"].t(), p["kv_norm.weight"], eps)
    cos, sin = rope_cos_sin(torch.arange(S), inv_freq, x.dtype)
    q = apply_rope(q, cos[:, None], sin[:, None])
    kv = apply_rope(kv, cos, sin)
    if simulate_kv is not None:
        kv = simulate_kv(kv)

    t = torch.arange(S)
    local = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)  # [S(query), S(key)]
    mask = local.expand(B, S, S)
    keys = kv
    if ratio > 0 and entries is not None and entries.shape[1] > 0:
        N = entries.shape[1]
        vis = visible_entries(S, N, ratio).expand(B, S, N)
        if picks is not None:
            chosen = torch.zeros(B, S, N + 1, dtype=torch.bool)
            chosen.scatter_(-1, torch.where(picks < 0, torch.full_like(picks, N), picks).long(), True)
            chosen = chosen[..., :N]
            if bool((chosen & ~vis).any()):
                raise ValueError("attention: a pick points at an entry the query cannot see")
            vis = chosen
        mask = torch.cat((mask, vis), dim=-1)
        keys = torch.cat((kv, entries), dim=1)
    logits = torch.einsum("bshd,bkd->bshk", q, keys) * d ** -0.5
    logits = logits.masked_fill(~mask[:, :, None, :], -math.inf)
    sink = p["attn_sink"].view(1, 1, H, 1).expand(B, S, H, 1)
    probs_all = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)
    probs = probs_all[..., :-1]
    o = torch.einsum("bshk,bkd->bshd", probs, keys)
    o = apply_rope(o, cos[:, None], sin[:, None], inverse=True)
    og = o.reshape(B, S, g, H * d // g)
    wo_a = p["wo_a.weight"].view(g, o_lora_rank, H * d // g)
    z = torch.einsum("bsgk,grk->bsgr", og, wo_a).flatten(2)
    y = z @ p["wo_b.weight"].t()
    if aux is not None:
        aux.update(qr=qr, q=q, kv=kv, probs=probs, sink_prob=probs_all[..., -1], o=o, mask=mask)
    return y


# --------------------------------------------------------------------------------------------------
# Router and experts (SPEC §6.7)
# --------------------------------------------------------------------------------------------------
def sqrtsoftplus(logits, floor=SQRTSOFTPLUS_FLOOR):
    return F.softplus(logits).clamp_min(floor).sqrt()


def route(x, weight, top_k, scale, bias=None, tid2eid=None, input_ids=None):
    """x [T,D], weight [E,D] -> (ids [T,k] int64, weights [T,k], margin [T]).
    Hash routing when tid2eid is given (ids = tid2eid[input_ids], margin +inf)."""
    s = sqrtsoftplus(x @ weight.t())
    T, E = s.shape
    if tid2eid is not None:
        ids = tid2eid[input_ids.reshape(-1).long()].long()
        margin = torch.full((T,), math.inf, dtype=s.dtype)
    else:
        sel = s.detach() + (bias if bias is not None else 0)
        vals, order = torch.sort(sel, dim=-1, descending=True, stable=True)
        ids = order[:, :top_k]
        margin = (vals[:, top_k - 1] - vals[:, top_k]) if top_k < E else torch.full((T,), math.inf)
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * scale
    return ids, w, margin


def swiglu_clamped(x, w1, w2, w3, limit, route_weight=None, trace=None):
    """y = w2 · (route_weight · silu(min(w1·x, limit)) · clamp(w3·x, −limit, limit))."""
    a = x @ w1.t()
    b = x @ w3.t()
    if limit > 0:
        if trace is not None:
            trace.clamp_margin = min(trace.clamp_margin, float((a.detach() - limit).abs().min()),
                                     float((b.detach().abs() - limit).abs().min()))
        a = a.clamp(max=limit)
        b = b.clamp(min=-limit, max=limit)
    h = F.silu(a) * b
    if route_weight is not None:
        h = h * route_weight.unsqueeze(-1)
    return h @ w2.t()


def moe(x, p, *, n_experts, top_k, scale, limit, is_hash, input_ids, has_shared, trace=None,
        name=None):
    """x [B,S,D] (after ffn_norm); p: gate.weight, gate.bias | gate.tid2eid, experts.E.w{1,2,3}.weight,
    shared_experts.w{1,2,3}.weight. Routed sum in ascending expert order, then the shared expert."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    if is_hash:
        ids, w, margin = route(xf, p["gate.weight"], top_k, scale, tid2eid=p["gate.tid2eid"],
                               input_ids=input_ids)
    else:
        ids, w, margin = route(xf, p["gate.weight"], top_k, scale, bias=p["gate.bias"])
    y = torch.zeros_like(xf)
    for e in range(n_experts):
        rows, slot = torch.where(ids == e)
        if rows.numel() == 0:
            continue
        pe = f"experts.{e}."
        ye = swiglu_clamped(xf[rows], p[pe + "w1.weight"], p[pe + "w2.weight"], p[pe + "w3.weight"],
                            limit, w[rows, slot], trace)
        y = y.index_add(0, rows, ye)
    if has_shared:
        y = y + swiglu_clamped(xf, p["shared_experts.w1.weight"], p["shared_experts.w2.weight"],
                               p["shared_experts.w3.weight"], limit, None, trace)
    if trace is not None and name is not None:
        trace.routing[name] = (ids.view(*shape[:-1], top_k), w.detach().view(*shape[:-1], top_k))
        trace.route_margin = min(trace.route_margin, float(margin.min()))
    return y.view(shape)


# --------------------------------------------------------------------------------------------------
# Blocks and the whole model
# --------------------------------------------------------------------------------------------------
class Trace:
    """What a forward records besides its outputs (routing, picks, margins, hidden states)."""

    def __init__(self):
        self.routing = {}
        self.picks = {}
        self.hidden = {}
        self.route_margin = math.inf
        self.index_margin = math.inf
        self.clamp_margin = math.inf
        self.qsim = QuantSim()  # quantization_simulation "reference": its decisions and margin


def attention_layer(x, p, cfg, ratio, trace=None, name=None):
    """The attention sublayer of a block, compressor and indexer included. p: the `attn.` dict."""
    kw = dict(n_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, rope_dim=cfg.qk_rope_head_dim,
              o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, eps=cfg.rms_norm_eps,
              window=cfg.sliding_window, ratio=ratio, inv_freq=cfg.inv_freq(ratio))
    fp8_nope, hadamard_fp4 = None, None
    if cfg.quantization_simulation == "reference":
        sim = trace.qsim if trace is not None else QuantSim()
        fp8_nope = lambda v: sim.fp8_nope(v, cfg.qk_rope_head_dim)  # noqa: E731
        hadamard_fp4 = sim.hadamard_fp4
    entries, picks = None, None
    if ratio > 0:
        entries = compressor(x, sub(p, "compressor."), ratio, cfg.head_dim, kw["inv_freq"],
                             cfg.rms_norm_eps, fp8_nope)
        if ratio == 4:
            with torch.no_grad():  # integer picks: no gradient reaches the indexer
                xd = x.detach()
                qr = rms_norm(xd @ p["wq_a.weight"].detach().t(), p["q_norm.weight"].detach(),
                              cfg.rms_norm_eps)
                pi = {k: v.detach() for k, v in sub(p, "indexer.").items()}
                scores, _, _ = indexer_scores(xd, qr, pi, ratio, cfg.index_n_heads,
                                              cfg.index_head_dim, kw["inv_freq"], cfg.rms_norm_eps,
                                              hadamard_fp4)
                picks, margin = indexer_picks(scores, ratio, cfg.index_topk)
            if trace is not None:
                trace.picks[name] = picks
                trace.index_margin = min(trace.index_margin, float(margin.min()))
    return attention(x, p, entries=entries, picks=picks, simulate_kv=fp8_nope, **kw)


def block(X, p, cfg, layer, input_ids, trace=None, name=None):
    """One V4 block over the 4-stream state X [B,S,n,D]; p: the block's dict (prefix removed)."""
    eps, hc_eps, iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
    u, post, comb = hc_pre(X, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], eps, hc_eps, iters)
    a = attention_layer(rms_norm(u, p["attn_norm.weight"], eps), sub(p, "attn."), cfg,
                        cfg.ratio(layer), trace, name)
    X = hc_post(a, X, post, comb)
    u, post, comb = hc_pre(X, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], eps, hc_eps, iters)
    f = moe(rms_norm(u, p["ffn_norm.weight"], eps), sub(p, "ffn."), n_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok, scale=cfg.routed_scaling_factor, limit=cfg.swiglu_limit,
            is_hash=cfg.is_hash(layer), input_ids=input_ids, has_shared=cfg.n_shared_experts > 0,
            trace=trace, name=name)
    return hc_post(f, X, post, comb)


def head_logits(X, p, prefix, cfg, norm_key):
    h = hc_head(X, p[prefix + "hc_head_fn"], p[prefix + "hc_head_base"], p[prefix + "hc_head_scale"],
                cfg.rms_norm_eps, cfg.hc_eps)
    return rms_norm(h, p[norm_key], cfg.rms_norm_eps) @ p["head.weight"].t()


def mtp_inputs(tokens, targets):
    """Depth-1 MTP ids / targets: rolled left by one, last slot 0 (ids) / −100 (targets)."""
    ids = torch.roll(tokens, -1, dims=-1)
    ids[..., -1] = 0
    tg = torch.roll(targets, -1, dims=-1)
    tg[..., -1] = -100
    return ids, tg


def forward(params, cfg, tokens, mtp=False, trace=None):
    """tokens [B,S] -> logits [B,S,V] (and mtp_logits [B,S,V] when mtp)."""
    X = params["embed.weight"][tokens]
    X = X.unsqueeze(2).expand(*X.shape[:2], cfg.hc_mult, X.shape[-1])
    for L in range(cfg.num_hidden_layers):
        X = block(X, sub(params, f"layers.{L}."), cfg, L, tokens, trace, f"layers.{L}")
        if trace is not None:
            trace.hidden[f"layers.{L}"] = X.detach()
    logits = head_logits(X, params, "", cfg, "norm.weight")
    if not mtp:
        return logits, None
    p = sub(params, "mtp.0.")
    ids, _ = mtp_inputs(tokens, tokens)
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed.weight"][ids], p["enorm.weight"], eps) @ p["e_proj.weight"].t()
    Xm = e.unsqueeze(2) + rms_norm(X, p["hnorm.weight"], eps) @ p["h_proj.weight"].t()
    Xm = block(Xm, p, cfg, cfg.num_hidden_layers, ids, trace, "mtp.0")
    if trace is not None:
        trace.hidden["mtp.0"] = Xm.detach()
    pm = dict(p)
    pm["head.weight"] = params["head.weight"]
    return logits, head_logits(Xm, pm, "", cfg, "norm.weight")


def cross_entropy(logits, targets):
    """Mean over targets != −100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def loss_fn(logits, mtp_logits, targets, mtp_loss_scale=0.1):
    """(total, ce, mtp_ce): total = ce + mtp_loss_scale · mtp_ce (mtp_ce = 0 without MTP)."""
    ce = cross_entropy(logits, targets)
    if mtp_logits is None:
        return ce, ce, torch.zeros((), dtype=ce.dtype)
    _, mtp_targets = mtp_inputs(targets, targets)
    mce = cross_entropy(mtp_logits, mtp_targets)
    return ce + mtp_loss_scale * mce, ce, mce


# --------------------------------------------------------------------------------------------------
# Parameter names (released layout, SPEC §6.10) and shapes
# --------------------------------------------------------------------------------------------------
def block_param_shapes(cfg, layer, prefix):
    D, n = cfg.hidden_size, cfg.hc_mult
    H, d, r, g, ql = cfg.num_attention_heads, cfg.head_dim, cfg.o_lora_rank, cfg.o_groups, cfg.q_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    mix = (2 + n) * n
    s = {}
    for site in ("attn", "ffn"):
        s[f"hc_{site}_fn"] = (mix, n * D)
        s[f"hc_{site}_base"] = (mix,)
        s[f"hc_{site}_scale"] = (3,)
    s["attn_norm.weight"] = (D,)
    s["ffn_norm.weight"] = (D,)
    a = "attn."
    s[a + "wq_a.weight"] = (ql, D)
    s[a + "q_norm.weight"] = (ql,)
    s[a + "wq_b.weight"] = (H * d, ql)
    s[a + "wkv.weight"] = (d, D)
    s[a + "kv_norm.weight"] = (d,)
    s[a + "wo_a.weight"] = (g * r, H * d // g)
    s[a + "wo_b.weight"] = (D, g * r)
    s[a + "attn_sink"] = (H,)
    ratio = cfg.ratio(layer)
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        c = a + "compressor."
        s[c + "wkv.weight"] = (coff * d, D)
        s[c + "wgate.weight"] = (coff * d, D)
        s[c + "ape"] = (ratio, coff * d)
        s[c + "norm.weight"] = (d,)
        if ratio == 4:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            x = a + "indexer."
            s[x + "wq_b.weight"] = (hi * di, ql)
            s[x + "weights_proj.weight"] = (hi, D)
            s[x + "compressor.wkv.weight"] = (2 * di, D)
            s[x + "compressor.wgate.weight"] = (2 * di, D)
            s[x + "compressor.ape"] = (4, 2 * di)
            s[x + "compressor.norm.weight"] = (di,)
    f = "ffn."
    s[f + "gate.weight"] = (E, D)
    if cfg.is_hash(layer):
        s[f + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        s[f + "gate.bias"] = (E,)
    for e in range(E):
        s[f + f"experts.{e}.w1.weight"] = (I, D)
        s[f + f"experts.{e}.w2.weight"] = (D, I)
        s[f + f"experts.{e}.w3.weight"] = (I, D)
    if cfg.n_shared_experts:
        s[f + "shared_experts.w1.weight"] = (I * cfg.n_shared_experts, D)
        s[f + "shared_experts.w2.weight"] = (D, I * cfg.n_shared_experts)
        s[f + "shared_experts.w3.weight"] = (I * cfg.n_shared_experts, D)
    return {prefix + k: v for k, v in s.items()}


def param_shapes(cfg):
    """{released key: shape} of every tensor of the model (parameters and the gate buffers)."""
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    s = {"embed.weight": (V, D), "head.weight": (V, D), "norm.weight": (D,),
         "hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,)}
    for L in range(cfg.num_hidden_layers):
        s.update(block_param_shapes(cfg, L, f"layers.{L}."))
    for dpt in range(cfg.num_nextn_predict_layers):
        if dpt > 0:
            raise ValueError("V4 reference: MTP depth 1 only")
        pre = f"mtp.{dpt}."
        s.update(block_param_shapes(cfg, cfg.num_hidden_layers + dpt, pre))
        s.update({pre + "e_proj.weight": (D, D), pre + "h_proj.weight": (D, D),
                  pre + "enorm.weight": (D,), pre + "hnorm.weight": (D,), pre + "norm.weight": (D,),
                  pre + "hc_head_fn": (n, n * D), pre + "hc_head_base": (n,), pre + "hc_head_scale": (1,)})
    return s


def is_buffer(name):
    """Tensors the loss has no gradient for by construction (selection-only bias, hash table)."""
    return name.endswith("gate.bias") or name.endswith("gate.tid2eid")
