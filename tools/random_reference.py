#!/usr/bin/env python3
"""PyTorch reference for disagg's random-weight models (`--model random:NAME[:SEED]`).

Builds the same weights from the seed as engine/src/random.rs (every element a function
of the seed, the tensor's GGUF name and its index: splitmix64(seed ^ xxh3_64(name) +
index·φ), top 24 bits → uniform [−0.02·√3, 0.02·√3), rounded to bf16; norms 1), runs a
plain Llama forward over a prompt in float32 (K and V rounded to f16 as the engine's
default KV cache stores them, unless --kv-f32), and compares the logits at the last
prompt position with the file `disagg generate --logits-out FILE` wrote.

  disagg generate --model random:smollm2-135m --prompt-ids 1,2,3 --max-tokens 1 --logits-out ours.f32
  python3 tools/random_reference.py --model smollm2-135m --prompt-ids 1,2,3 --compare ours.f32

Needs only torch (CPU or CUDA: --device cuda).
"""
import argparse
import json
import math
import struct
import sys

import torch

# XXH3's default secret (the first 192 bytes of the reference kSecret).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
M64 = (1 << 64) - 1


def _r64(b, i):
    return int.from_bytes(b[i : i + 8], "little")


def _fold(a, b):
    p = a * b
    return (p & M64) ^ (p >> 64)


def _avalanche(h):
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & M64
    return h ^ (h >> 32)


def _mix16(data, io, so):
    return _fold(_r64(data, io) ^ _r64(SECRET, so), _r64(data, io + 8) ^ _r64(SECRET, so + 8))


def xxh3_64(data: bytes) -> int:
    """XXH3-64 with seed 0, for inputs of 9..128 bytes (every tensor name is)."""
    n = len(data)
    if 9 <= n <= 16:
        lo = _r64(data, 0) ^ (_r64(SECRET, 24) ^ _r64(SECRET, 32))
        hi = _r64(data, n - 8) ^ (_r64(SECRET, 40) ^ _r64(SECRET, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche((n + swapped + hi + _fold(lo, hi)) & M64)
    if 17 <= n <= 128:
        acc = (n * 0x9E3779B185EBCA87) & M64
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(data, 48, 96) + _mix16(data, n - 64, 112)
                acc += _mix16(data, 32, 64) + _mix16(data, n - 48, 80)
            acc += _mix16(data, 16, 32) + _mix16(data, n - 32, 48)
        acc += _mix16(data, 0, 0) + _mix16(data, n - 16, 16)
        return _avalanche(acc & M64)
    raise ValueError(f"{data!r}: only names of 9..128 bytes are supported")


def _i64(c):
    c &= M64
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(x, k):
    """Logical right shift of int64 tensors holding u64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(z):
    z = z + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


SHAPES = {
    "llama3-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                      eps=1e-5, theta=500000.0, tied=False,
                      llama3=dict(factor=8.0, low=1.0, high=4.0, orig=8192.0)),
    "smollm2-135m": dict(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                         eps=1e-5, theta=100000.0, tied=True, llama3=None),
}


def matrix(name, rows, cols, seed, device, chunk=1 << 26):
    """The bf16 weight `name` (rows × cols), as engine/src/random.rs makes it."""
    base = _i64(seed ^ xxh3_64(name.encode()))
    a = torch.tensor(0.02, dtype=torch.float32) * torch.sqrt(torch.tensor(3.0, dtype=torch.float32))
    a = a.to(device)
    n = rows * cols
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    phi = _i64(0x9E3779B97F4A7C15)
    for s in range(0, n, chunk):
        i = torch.arange(s, min(n, s + chunk), dtype=torch.int64, device=device)
        u = _splitmix64(base + i * phi)
        x = (_srl(u, 40).to(torch.float32) / float(1 << 24) * 2.0 - 1.0) * a
        out[s : s + len(i)] = x.to(torch.bfloat16)
    return out.view(rows, cols)


def inv_freq(c):
    d = c["head_dim"]
    f = torch.tensor([1.0 / (c["theta"] ** (2 * i / d)) for i in range(d // 2)], dtype=torch.float64).to(torch.float32)
    s = c["llama3"]
    if s is None:
        return f
    out = []
    for x in f.tolist():
        x = torch.tensor(x, dtype=torch.float32)
        low_w, high_w = s["orig"] / s["low"], s["orig"] / s["high"]
        wavelen = 2.0 * torch.tensor(math.pi, dtype=torch.float32) / x
        if wavelen < high_w:
            y = x
        elif wavelen > low_w:
            y = x / s["factor"]
        else:
            smooth = (s["orig"] / wavelen - s["low"]) / (s["high"] - s["low"])
            y = (1.0 - smooth) * x / s["factor"] + smooth * x
        out.append(float(y))
    return torch.tensor(out, dtype=torch.float32)


def forward(c, seed, ids, device, kv_f16):
    W = lambda name, r, k: matrix(name, r, k, seed, device).to(torch.float32)
    H, D, nh, nkv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
    T = len(ids)
    emb = W("token_embd.weight", c["vocab"], H)
    x = emb[torch.tensor(ids, device=device)]
    f = inv_freq(c).to(device)
    ang = (torch.arange(T, dtype=torch.float32, device=device)[:, None] * f[None, :]).to(torch.float64)
    cos, sin = ang.cos().to(torch.float32), ang.sin().to(torch.float32)

    def rms(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c["eps"])

    def rope(v):  # [T, heads, D], pairs (i, i + D/2)
        a, b = v[..., : D // 2], v[..., D // 2 :]
        return torch.cat([a * cos[:, None] - b * sin[:, None], a * sin[:, None] + b * cos[:, None]], -1)

    mask = torch.full((T, T), float("-inf"), device=device).triu(1)
    for l in range(c["layers"]):
        p = f"blk.{l}."
        h = rms(x)
        q = rope((h @ W(p + "attn_q.weight", nh * D, H).T).view(T, nh, D))
        k = rope((h @ W(p + "attn_k.weight", nkv * D, H).T).view(T, nkv, D))
        v = (h @ W(p + "attn_v.weight", nkv * D, H).T).view(T, nkv, D)
        if kv_f16:
            k, v = k.half().float(), v.half().float()
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D) + mask
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nh * D)
        x = x + o @ W(p + "attn_output.weight", H, nh * D).T
        h = rms(x)
        g = h @ W(p + "ffn_gate.weight", c["ffn"], H).T
        u = h @ W(p + "ffn_up.weight", c["ffn"], H).T
        x = x + (torch.nn.functional.silu(g) * u) @ W(p + "ffn_down.weight", H, c["ffn"]).T
    h = rms(x[-1:])
    out = emb if c["tied"] else W("output.weight", c["vocab"], H)
    return (h @ out.T)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-f32", action="store_true", help="keep K and V in f32 (engine --kv-dtype f32)")
    ap.add_argument("--compare", help="logits file from `disagg generate --logits-out`")
    ap.add_argument("--out", help="write the reference logits here (f32 little-endian)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = [int(t) for t in a.prompt_ids.split(",")]
    with torch.no_grad():
        ref = forward(SHAPES[a.model], a.seed, ids, a.device, not a.kv_f32).cpu()
    if a.out:
        with open(a.out, "wb") as f:
            f.write(struct.pack(f"<{ref.numel()}f", *ref.tolist()))
    report = {"model": a.model, "seed": a.seed, "prompt_tokens": len(ids), "ref_argmax": int(ref.argmax())}
    if a.compare:
        raw = open(a.compare, "rb").read()
        ours = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        if ours.numel() != ref.numel():
            sys.exit(f"{a.compare}: {ours.numel()} logits, the reference has {ref.numel()}")
        rng = float(ref.max() - ref.min())
        lp_r, lp_o = ref.log_softmax(-1), ours.log_softmax(-1)
        report.update(
            ours_argmax=int(ours.argmax()),
            max_abs_diff=float((ours - ref).abs().max()),
            max_abs_diff_over_range=float((ours - ref).abs().max()) / rng,
            logit_range=rng,
            kl_ref_ours=float((lp_r.exp() * (lp_r - lp_o)).sum()),
            top5_ref=ref.topk(5).indices.tolist(),
            top5_ours=ours.topk(5).indices.tolist(),
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
