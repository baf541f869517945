"""Plain PyTorch reference of the DeepSeek-V3 model family (V2, V2-Lite, V3, Moonlight-style configs).

Written to be read: nn.Module classes named after the Hugging Face implementation, parameter names
equal to the HF checkpoint keys, autograd for the backward. It is the numerical ground truth the C++
engine is checked against (tests/fixtures/*, produced by gen_fixtures.py) and a PyTorch baseline.

Conventions the C++ engine matches exactly (details: tests/fixtures/README.md):
  * RoPE rotates adjacent pairs (2i, 2i+1) (DeepSeek's complex view); positions restart at 0 in every
    sequence; cos/sin are computed in float64 and rounded to the model dtype.
  * Router: fp32 logits, sigmoid|softmax scores, selection = scores + e_score_correction_bias,
    stable top-k (ties -> lower expert id, groups: ties -> lower group id), weights from the
    unbiased scores. Expert ids per token are ordered by descending selection score, and the
    combine sums the k contributions in that order, then adds the shared experts.
  * Counts for the aux-loss-free bias update and the sequence-wise aux loss exist only in training
    mode (module.train()).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------
class DeepseekV3Config:
    """HF config.json fields with HF defaults. Build with DeepseekV3Config.from_dict(json_dict)."""

    defaults = dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
        norm_topk_prob=True, scoring_func="sigmoid", aux_loss_alpha=0.0, seq_aux=True,
        first_k_dense_replace=3, moe_layer_freq=1, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
    )

    def __init__(self, **kwargs):
        for k, v in self.defaults.items():
            setattr(self, k, kwargs.pop(k, v))
        for k, v in kwargs.items():  # keep unknown HF fields around (architectures, torch_dtype, ...)
            setattr(self, k, v)
        self.q_lora_rank = self.q_lora_rank or 0          # null -> 0: a single q_proj
        self.n_shared_experts = self.n_shared_experts or 0
        self.n_routed_experts = self.n_routed_experts or 0
        if self.moe_layer_freq != 1:
            raise ValueError("moe_layer_freq must be 1")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be false")

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    @property
    def qk_head_dim(self):
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx):
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    def yarn(self):
        """The rope_scaling dict with defaults filled in, or None when YaRN is off."""
        rs = self.rope_scaling
        if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
            return None
        return dict(factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                    beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)),
                    mscale=float(rs.get("mscale", 1)), mscale_all_dim=float(rs.get("mscale_all_dim", 0)))


# --------------------------------------------------------------------------------------------------
# Rotary embedding (YaRN), HF semantics, adjacent-pair rotation
# --------------------------------------------------------------------------------------------------
def yarn_get_mscale(scale=1.0, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_find_correction_dim(num_rotations, dim, base, max_position_embeddings):
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings):
    low = math.floor(_yarn_find_correction_dim(beta_fast, dim, base, original_max_position_embeddings))
    high = math.ceil(_yarn_find_correction_dim(beta_slow, dim, base, original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(config):
    """inv_freq [d/2] in float64 and the cos/sin multiplier m (1 without YaRN)."""
    d, base = config.qk_rope_head_dim, float(config.rope_theta)
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    yarn = config.yarn()
    if yarn is None:
        return inv_freq, 1.0
    factor = yarn["factor"]
    low, high = yarn_correction_range(yarn["beta_fast"], yarn["beta_slow"], d, base,
                                      yarn["original_max_position_embeddings"])
    if low == high:
        high += 0.001  # avoid a division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = 1.0 - ramp  # 1: keep the original frequency (extrapolation), 0: interpolate (/factor)
    inv_freq = (inv_freq / factor) * (1.0 - mask) + inv_freq * mask
    m = yarn_get_mscale(factor, yarn["mscale"]) / yarn_get_mscale(factor, yarn["mscale_all_dim"])
    return inv_freq, m


def softmax_scale(config):
    scale = config.qk_head_dim ** -0.5
    yarn = config.yarn()
    if yarn is not None and yarn["mscale_all_dim"]:
        mscale = yarn_get_mscale(yarn["factor"], yarn["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class DeepseekV3RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        inv_freq, self.mscale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # float64 on purpose

    def forward(self, seq_len, dtype, device):
        t = torch.arange(seq_len, dtype=torch.float64, device=device)
        freqs = torch.outer(t, self.inv_freq.to(device=device, dtype=torch.float64))  # [S, d/2]
        return (freqs.cos() * self.mscale).to(dtype), (freqs.sin() * self.mscale).to(dtype)


def apply_rotary_emb(x, cos, sin):
    """x [B, S, H, d]; cos/sin [S, d/2]. Rotates the adjacent pairs (x[2i], x[2i+1])."""
    x_pairs = x.view(*x.shape[:-1], x.shape[-1] // 2, 2)
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------
class DeepseekV3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.variance_epsilon) * self.weight


class DeepseekV3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def select_experts(selection, top_k, n_group=1, topk_group=1, topk_method="greedy"):
    """Deterministic group-limited top-k over selection scores [T, E].

    Returns (ids [T, k] ordered by descending score, ties -> lower id; margin [T]: the smallest gap
    at a routing decision: k-th vs (k+1)-th selection score and kept vs dropped group score).
    """
    T, E = selection.shape
    margin = torch.full((T,), math.inf, dtype=selection.dtype, device=selection.device)
    if n_group > 1 and topk_method in ("noaux_tc", "group_limited_greedy"):
        grouped = selection.view(T, n_group, E // n_group)
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # sum of the best two
        else:
            group_scores = grouped.max(dim=-1).values
        g_sorted, g_order = torch.sort(group_scores, dim=-1, descending=True, stable=True)
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=selection.device)
        keep.scatter_(1, g_order[:, :topk_group], True)
        selection = selection.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), -math.inf)
        if topk_group < n_group:
            margin = torch.minimum(margin, g_sorted[:, topk_group - 1] - g_sorted[:, topk_group])
    s_sorted, order = torch.sort(selection, dim=-1, descending=True, stable=True)
    if top_k < E:
        gap = s_sorted[:, top_k - 1] - s_sorted[:, top_k]  # +inf when the next one is masked
        margin = torch.minimum(margin, gap)
    return order[:, :top_k].contiguous(), margin


class MoEGate(nn.Module):
    """Router: weight [E, dim] (trained), e_score_correction_bias [E] (a buffer, selection only)."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.scoring_func = config.scoring_func
        self.alpha = config.aux_loss_alpha
        self.topk_method = config.topk_method
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))
        self.tokens_per_expert = None  # [E] counts of the last training forward (each (t, k) pair)
        self.last_margin = None        # smallest routing gap of the last forward (diagnostics)

    def forward(self, hidden_states):
        B, S, D = hidden_states.shape
        x = hidden_states.reshape(-1, D)
        router_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 in self-tests)
        logits = F.linear(x.to(router_dtype), self.weight.to(router_dtype))
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        elif self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise NotImplementedError(f"scoring_func {self.scoring_func}")

        with torch.no_grad():  # no gradient through the selection
            selection = scores + self.e_score_correction_bias.to(scores.dtype)
            topk_idx, self.last_margin = select_experts(selection, self.top_k, self.n_group,
                                                        self.topk_group, self.topk_method)
        topk_weight = scores.gather(1, topk_idx)  # unbiased scores
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor

        aux_loss = None
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert = torch.bincount(topk_idx.flatten(),
                                                        minlength=self.n_routed_experts)
            if self.alpha > 0.0:  # sequence-wise auxiliary loss
                E, K = self.n_routed_experts, self.top_k
                s = scores.view(B, S, E)
                if self.scoring_func != "softmax":
                    s = s / s.sum(dim=-1, keepdim=True)  # per-token normalisation (identity for softmax)
                with torch.no_grad():
                    ce = torch.zeros(B, E, dtype=s.dtype, device=s.device)
                    ce.scatter_add_(1, topk_idx.view(B, S * K), torch.ones(B, S * K, dtype=s.dtype,
                                                                           device=s.device))
                    f = ce * (E / (K * S))
                aux_loss = (f * s.mean(dim=1)).sum(dim=1).mean() * self.alpha
        return topk_idx, topk_weight, aux_loss


class DeepseekV3MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts_per_tok = config.num_experts_per_tok
        self.experts = nn.ModuleList([DeepseekV3MLP(config.hidden_size, config.moe_intermediate_size)
                                      for _ in range(config.n_routed_experts)])
        self.gate = MoEGate(config)
        self.shared_experts = None
        if config.n_shared_experts > 0:
            self.shared_experts = DeepseekV3MLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden_states):
        B, S, D = hidden_states.shape
        x = hidden_states.reshape(-1, D)
        topk_idx, topk_weight, aux_loss = self.gate(hidden_states)
        # Dispatch: run every expert on the rows routed to it (experts with no rows are skipped and
        # get no gradient), place the outputs at their (token, slot) positions.
        expert_out = x.new_zeros(x.shape[0], self.num_experts_per_tok, D)
        for e, expert in enumerate(self.experts):
            rows, slots = (topk_idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            expert_out[rows, slots] = expert(x[rows])
        # Combine in a fixed order: slot 0 (best expert) first, then the shared experts.
        y = torch.zeros_like(x)
        for k in range(self.num_experts_per_tok):
            y = y + topk_weight[:, k:k + 1].to(x.dtype) * expert_out[:, k]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(B, S, D), aux_loss


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention (MLA)."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = config.qk_head_dim
        H, D = self.num_heads, config.hidden_size
        if self.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=False)
            self.q_a_layernorm = DeepseekV3RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.q_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, D, bias=False)
        self.softmax_scale = softmax_scale(config)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        H = self.num_heads
        if self.q_lora_rank > 0:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, S, H, self.q_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = compressed_kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, S, H,
                                                            self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        q_pe = apply_rotary_emb(q_pe, cos, sin)
        k_pe = apply_rotary_emb(k_pe.view(B, S, 1, self.qk_rope_head_dim), cos, sin)  # one shared head

        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)                            # [B,H,S,qk]
        k = torch.cat([k_nope, k_pe.expand(B, S, H, self.qk_rope_head_dim)], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)                                                            # [B,H,S,v]

        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, -math.inf)
        probs = scores.softmax(dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(B, S, H * self.v_head_dim)
        return self.o_proj(out)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepseekV3Attention(config)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp = (DeepseekV3MoE(config) if self.is_moe
                    else DeepseekV3MLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        aux_loss = None
        if self.is_moe:
            ffn, aux_loss = self.mlp(self.post_attention_layernorm(h))
        else:
            ffn = self.mlp(self.post_attention_layernorm(h))
        return h + ffn, aux_loss


class DeepseekV3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DeepseekV3DecoderLayer(config, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DeepseekV3RotaryEmbedding(config)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(input_ids.shape[1], h.dtype, h.device)
        aux_total = None
        for layer in self.layers:
            h, aux = layer(h, cos, sin)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        return self.norm(h), aux_total


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        """input_ids [B, S] -> (logits [B, S, V], summed sequence-wise aux loss or None)."""
        h, aux_loss = self.model(input_ids)
        return self.lm_head(h), aux_loss

    def gates(self):
        return [m for m in self.modules() if isinstance(m, MoEGate)]


# --------------------------------------------------------------------------------------------------
# Loss, load balancing, optimizer
# --------------------------------------------------------------------------------------------------
def causal_lm_loss(logits, targets, aux_loss=None, z_loss=0.0):
    """total = CE + z_loss * mean(logsumexp^2) + aux, both means over targets != -100.

    Returns (total, ce, z_term)."""
    V = logits.shape[-1]
    flat_logits, flat_targets = logits.reshape(-1, V), targets.reshape(-1)
    ce = F.cross_entropy(flat_logits, flat_targets, ignore_index=-100)
    total = ce
    z_term = torch.zeros((), dtype=logits.dtype, device=logits.device)
    if z_loss > 0:
        valid = flat_targets != -100
        z_term = z_loss * torch.logsumexp(flat_logits[valid], dim=-1).pow(2).mean()
        total = total + z_term
    if aux_loss is not None:
        total = total + aux_loss
    return total, ce, z_term


@torch.no_grad()
def update_correction_bias(model, rate):
    """Aux-loss-free balancing: bias += delta - mean(delta), delta = rate * sign(mean(c) - c)."""
    for gate in model.gates():
        if gate.tokens_per_expert is None:
            continue
        counts = gate.tokens_per_expert.to(gate.e_score_correction_bias.dtype)
        delta = rate * torch.sign(counts.mean() - counts)
        gate.e_score_correction_bias += delta - delta.mean()
        gate.tokens_per_expert = None


def make_optimizer(model, lr, betas, eps, weight_decay):
    """torch AdamW; weight decay on parameters with ndim >= 2 only (norm weights excluded)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(betas), eps=eps, foreach=False)


def train_step(model, optimizer, input_ids, targets, z_loss, max_grad_norm, bias_update_rate):
    """forward (train mode) -> backward -> clip -> bias update -> AdamW -> zero grads.

    Gradients are kept as zero tensors (never None), so every parameter, including an expert that
    received no token, is stepped (weight decay, moment decay). Returns the loss before the update.
    """
    model.train()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    logits, aux = model(input_ids)
    loss, _, _ = causal_lm_loss(logits, targets, aux, z_loss)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
    update_correction_bias(model, bias_update_rate)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss.detach()
