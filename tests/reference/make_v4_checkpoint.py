"""A tiny DeepSeek-V4 checkpoint in the layout DeepSeek releases, with reference logits.

  /usr/bin/python3 tests/reference/make_v4_checkpoint.py          # write tests/fixtures/v4_released/
  /usr/bin/python3 tests/reference/make_v4_checkpoint.py --check  # regenerate in memory, compare bytes

Writes config.json (model_type deepseek_v4 with the released quantization_config and
expert_dtype "fp4") and model.safetensors with the released dtypes (SPEC §6.3, §6.10):

  F8_E4M3 `X.weight` + F8_E8M0 `X.scale` [ceil(out/128), ceil(in/128)]
      attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b, ffn.shared_experts.w{1,2,3},
      mtp.0.{e_proj,h_proj};
  I8 `X.weight` [out, in/2] + F8_E8M0 `X.scale` [out, in/32]   the routed experts (MXFP4);
  F32   hc_*, attn.attn_sink, the compressors' ape, ffn.gate.bias;
  I64   ffn.gate.tid2eid (hash layers);
  BF16  everything else.

plus expected.safetensors: `tokens` I32 [B, S], `logits` and `mtp_logits` F32 [B, S, V] of the
PyTorch reference (deepseek_v4_ref.py) run in float64 on the weights the file defines (FP8:
e4m3(byte) · 2^(scale-127); MXFP4: e2m1(nibble) · 2^(scale-127); BF16 widened: all exact in
float32), and `dequant.<name>` F32 for a few tensors as the file defines them.

The file is written exactly as the engine's save_v4_released writes it (io/v4_checkpoint.h), so
the C++ test can check save(load(file)) == file byte for byte: tensors in name order, header
{"__metadata__":{"format":"pt"}, name: {"dtype", "shape", "data_offsets"}, ...} as compact JSON
padded with spaces to a multiple of 8; FP8 tile scales = the smallest power of two s with
amax / s <= 464 (io/fp8.h fp8_tile_scale_e8m0: re-quantizing the decoded tile gives the same
bytes). MXFP4 blocks follow SPEC §5 (shared_exp = floor(log2 amax) - 2, nearest E2M1, ties to
the even code, saturating at 6); the engine copies those bytes and never re-encodes them.

Seeds are searched until every routing decision, indexer pick and SwiGLU clamp has a clear
margin in the float64 forward and the float32 replay decides the same way (gen_v4_fixtures.py).
"""
import argparse
import json
import math
import os
import struct
import sys
import tempfile

os.environ.setdefault("OPENBLAS_CORETYPE", "Prescott")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_v4_ref as ref  # noqa: E402
import gen_v4_fixtures as v4fx  # noqa: E402
from gen_released_layouts import E4M3, bf16_round, e4m3_encode  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "tests", "fixtures", "v4_released")
TILE = 128
BATCH, SEQ, FIRST_SEED = 2, 40, 500

# The released config.json's quantization fields (SPEC §6.1).
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "scale_fmt": "ue8m0", "weight_block_size": [TILE, TILE]}

# q_lora_rank 144 and 8 index heads x 32 give FP8 matrices of two tiles along each axis
# (wq_a [144, 32], wq_b [128, 144], indexer.wq_b [256, 144]) with partial last tiles; hidden 32
# keeps the file small (the hc_*_fn tensors are [24, 4 * hidden] F32).
CONFIG = v4fx.hf_v4_config(
    vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=32,
    qk_rope_head_dim=16, q_lora_rank=144, o_lora_rank=16, o_groups=2, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, index_n_heads=8,
    index_head_dim=32, index_topk=3, sliding_window=8, compress_ratios=[0, 4, 16, 0],
    torch_dtype="bfloat16")
CONFIG.update(expert_dtype="fp4", quantization_config=QUANTIZATION_CONFIG)

# Tensors whose decoded values expected.safetensors also holds (dequant.<name>).
DEQUANT = ["layers.0.attn.wq_a.weight", "layers.2.ffn.experts.5.w2.weight",
           "mtp.0.ffn.experts.0.w1.weight", "embed.weight"]

# ------------------------------------------------------------------------------------------------
# Released dtypes per key (mirrors io/v4_checkpoint.cpp v4_released_format)
# ------------------------------------------------------------------------------------------------
FP8_SUFFIXES = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
                ".attn.wo_b.weight", ".attn.indexer.wq_b.weight", ".ffn.shared_experts.w1.weight",
                ".ffn.shared_experts.w2.weight", ".ffn.shared_experts.w3.weight")


def released_format(name):
    if name.endswith(".gate.tid2eid"):
        return "I64"
    if ".ffn.experts." in name:
        return "MXFP4"
    if name.endswith(FP8_SUFFIXES) or (name.startswith("mtp.") and
                                       name.endswith((".e_proj.weight", ".h_proj.weight"))):
        return "FP8"
    last = name.rsplit(".", 1)[-1]
    if last.startswith("hc_") or name.endswith((".attn_sink", ".ape", ".ffn.gate.bias")):
        return "F32"
    return "BF16"


# ------------------------------------------------------------------------------------------------
# FP8 with power-of-two (E8M0) tile scales
# ------------------------------------------------------------------------------------------------
LARGEST_BEFORE_OVERFLOW = 464.0  # 448 + half a step: still rounds to 448


def fp8_scale_exponent(amax):
    """The smallest e with amax <= 464 · 2^e, clamped to E8M0's [-127, 127]; 0 for a zero tile."""
    amax = float(amax)
    if amax == 0.0:
        return 0
    e = math.frexp(amax / LARGEST_BEFORE_OVERFLOW)[1]
    while e > -127 and math.ldexp(LARGEST_BEFORE_OVERFLOW, e - 1) >= amax:
        e -= 1
    while math.ldexp(LARGEST_BEFORE_OVERFLOW, e) < amax:
        e += 1
    return max(-127, min(127, e))


def quantize_fp8(w):
    """w float32 [out, in] -> (E4M3 bytes uint8 [out, in], E8M0 bytes uint8 [tiles_out, tiles_in],
    decoded float32 [out, in])."""
    out, inn = w.shape
    to, ti = -(-out // TILE), -(-inn // TILE)
    q = np.zeros(w.shape, np.uint8)
    scales = np.zeros((to, ti), np.uint8)
    deq = np.zeros(w.shape, np.float32)
    for a in range(to):
        for b in range(ti):
            rows, cols = slice(a * TILE, (a + 1) * TILE), slice(b * TILE, (b + 1) * TILE)
            tile = w[rows, cols]
            e = fp8_scale_exponent(np.abs(tile).max())
            scales[a, b] = e + 127
            s = np.float32(math.ldexp(1.0, e))
            q[rows, cols] = e4m3_encode(tile / s)  # exact division by a power of two
            deq[rows, cols] = E4M3[q[rows, cols]] * s
            # The layout's promise: quantizing the decoded tile again gives the same bytes.
            assert fp8_scale_exponent(np.abs(deq[rows, cols]).max()) == e
            assert np.array_equal(e4m3_encode(deq[rows, cols] / s), q[rows, cols])
    return q, scales, deq


# ------------------------------------------------------------------------------------------------
# MXFP4 (SPEC §5)
# ------------------------------------------------------------------------------------------------
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
BLOCK = 32


def e2m1_encode(x):
    """float32 (already divided by the block scale) -> 4-bit codes: nearest, ties to the even
    code, magnitudes above 6 saturate; bit 3 = sign."""
    a = np.abs(x)
    d = np.abs(a[..., None] - E2M1)
    code = np.argmin(d, axis=-1)  # the lower code on a tie
    nxt = np.minimum(code + 1, 7)
    tie = (code < 7) & (np.take_along_axis(d, nxt[..., None], -1)[..., 0] ==
                        np.take_along_axis(d, code[..., None], -1)[..., 0])
    code = np.where(tie & (code % 2 == 1), code + 1, code)
    return (code | (np.signbit(x).astype(np.int64) << 3)).astype(np.uint8)


def quantize_mxfp4(w):
    """w float32 [out, in] -> (packed uint8 [out, in/2], E8M0 bytes uint8 [out, in/32],
    decoded float32 [out, in])."""
    out, inn = w.shape
    blocks = w.reshape(out, inn // BLOCK, BLOCK)
    amax = np.abs(blocks).max(-1)
    assert (amax > 0).all(), "random weights: no all-zero block"
    shared = np.frexp(amax)[1].astype(np.int64) - 1 - 2  # floor(log2 amax) - 2
    shared = np.clip(shared, -127, 127)
    scale = np.ldexp(np.float32(1), shared).astype(np.float32)[..., None]
    codes = e2m1_encode(blocks / scale).reshape(out, inn)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    sign = np.where(codes & 8, np.float32(-1), np.float32(1))
    deq = (E2M1[codes & 7] * sign).reshape(out, inn // BLOCK, BLOCK) * scale
    return packed, (shared + 127).astype(np.uint8), deq.reshape(out, inn).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# safetensors, byte for byte as the engine writes it
# ------------------------------------------------------------------------------------------------
def safetensors_blob(tensors):
    """tensors: {name: (dtype, shape, bytes)} -> file bytes: names sorted, metadata first."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": [int(x) for x in shape],
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def f32_bytes(a):
    return np.ascontiguousarray(a, np.float32).astype("<f4").tobytes()


def bf16_bytes(a):
    u = bf16_round(a).view(np.uint32) >> 16
    return u.astype("<u2").tobytes()


# ------------------------------------------------------------------------------------------------
# The checkpoint
# ------------------------------------------------------------------------------------------------
def encode(state):
    """{name: torch tensor} -> (file tensors {name: (dtype, shape, bytes)}, the weights they
    define {name: torch float32 / int64})."""
    files, weights = {}, {}
    for name, t in state.items():
        fmt = released_format(name)
        if fmt == "I64":
            v = t.numpy().astype(np.int64)
            files[name] = ("I64", v.shape, v.astype("<i8").tobytes())
            weights[name] = t
            continue
        w = t.numpy().astype(np.float32)
        scale_name = name[:-len(".weight")] + ".scale"
        if fmt == "FP8":
            q, s, deq = quantize_fp8(w)
            files[name] = ("F8_E4M3", q.shape, q.tobytes())
            files[scale_name] = ("F8_E8M0", s.shape, s.tobytes())
        elif fmt == "MXFP4":
            q, s, deq = quantize_mxfp4(w)
            files[name] = ("I8", q.shape, q.tobytes())
            files[scale_name] = ("F8_E8M0", s.shape, s.tobytes())
        elif fmt == "F32":
            deq = w
            files[name] = ("F32", w.shape, f32_bytes(w))
        else:
            deq = bf16_round(w)
            files[name] = ("BF16", w.shape, bf16_bytes(w))
        weights[name] = torch.from_numpy(np.array(deq, np.float32))
    return files, weights


def build():
    cfg = ref.V4Config.from_dict(CONFIG)
    tokens, targets = v4fx.make_batch(cfg.vocab_size, BATCH, SEQ, FIRST_SEED, [])
    for attempt in range(v4fx.MAX_ATTEMPTS):
        seed = FIRST_SEED + attempt
        files, weights = encode(v4fx.init_params(cfg, seed))
        with torch.no_grad():
            res, tr = v4fx.run_model(cfg, weights, tokens, targets, v4fx.F64, grads=False)
        if not (tr.route_margin > v4fx.MIN_ROUTE_GAP and tr.index_margin > v4fx.MIN_INDEX_GAP
                and tr.clamp_margin > v4fx.MIN_CLAMP_GAP):
            continue
        with torch.no_grad():
            _, t32 = v4fx.run_model(cfg, weights, tokens, targets, torch.float32, grads=False)
        if v4fx.same_decisions(tr, t32):
            break
    else:
        raise RuntimeError("no seed with clear routing / index / clamp margins")
    logits, mtp_logits = res["logits"].float().numpy(), res["mtp_logits"].float().numpy()
    expected = {"tokens": ("I32", tokens.shape, tokens.numpy().astype("<i4").tobytes()),
                "logits": ("F32", logits.shape, f32_bytes(logits)),
                "mtp_logits": ("F32", mtp_logits.shape, f32_bytes(mtp_logits))}
    for name in DEQUANT:
        w = weights[name].numpy()
        expected["dequant." + name] = ("F32", w.shape, f32_bytes(w))
    out = {"config.json": (json.dumps(CONFIG, indent=2, sort_keys=True) + "\n").encode(),
           "model.safetensors": safetensors_blob(files),
           "expected.safetensors": safetensors_blob(expected)}
    margins = dict(route=tr.route_margin, index=tr.index_margin, clamp=tr.clamp_margin)
    return out, seed, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="regenerate in memory, compare bytes")
    args = ap.parse_args()
    v4fx.setup_determinism()
    files, seed, margins = build()
    print(f"make_v4_checkpoint: seed {seed}, margins " +
          ", ".join(f"{k} {v:.2e}" for k, v in margins.items()) +
          f", {sum(len(b) for b in files.values())} bytes")
    if args.check:
        bad = [f for f, b in files.items() if not os.path.exists(os.path.join(OUT, f))
               or open(os.path.join(OUT, f), "rb").read() != b]
        if bad:
            raise SystemExit(f"make_v4_checkpoint --check: {bad} differ from the regenerated bytes")
        print(f"make_v4_checkpoint --check: all {len(files)} files identical")
        return
    os.makedirs(OUT, exist_ok=True)
    for f, b in files.items():
        with tempfile.NamedTemporaryFile(dir=OUT, delete=False) as tmp:
            tmp.write(b)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, os.path.join(OUT, f))
    print(f"make_v4_checkpoint: wrote {len(files)} files under {OUT}")


if __name__ == "__main__":
    main()
