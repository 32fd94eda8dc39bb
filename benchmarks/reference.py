"""The speedrun's peer: a plain nanoGPT-style script, as a user would write it in ~90 lines.

    .venv/bin/python benchmarks/reference.py --data data/python --seconds 300 --seed 0

RMSNorm, RoPE, GELU MLP, tied head; AdamW (lr 3e-3, betas 0.9/0.95, wd 0.1) with 20 warmup
steps then cosine to 10%; d_model 192, 4 layers, 8 heads, seq 256, batch 16; random windows
of ember's train shards (64-byte header, then uint16 tokens), the same BPE-4096 tokenizer.
It imports nothing from ember: the speedrun scores its model with ember's ``score`` on the
test split, the same function and tokens as ember's own model.
"""

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).transpose(1, 3).unbind(2)

        def rope(t):  # rotate-half RoPE
            a, b = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-b, a], dim=-1) * sin

        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d=192, n_layer=4, n_head=8, max_len=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln = nn.RMSNorm(d)
        hd = d // n_head
        freqs = 1.0 / 10000 ** (torch.arange(0, hd, 2) / hd)
        angles = torch.outer(torch.arange(max_len).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        T = idx.size(1)
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        return F.linear(self.ln(x), self.emb.weight)  # tied head


def train(data, seconds, seed, seq=256, batch=16, lr=3e-3, warmup=20, log=print):
    """Train for ``seconds`` of wall clock; returns (model, {steps, tokens, loss})."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    manifest = json.loads((Path(data) / "manifest.json").read_text())
    shards = [
        np.memmap(Path(data) / s["name"], np.uint16, "r", offset=64)
        for s in manifest["splits"]["train"]["shards"]
    ]
    tokens = np.concatenate(shards) if len(shards) > 1 else shards[0]
    vocab = manifest["tokenizer"]["vocab_size"]
    model = GPT(vocab)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=True)
    start, step, loss = time.perf_counter(), 0, float("nan")
    while (elapsed := time.perf_counter() - start) < seconds:
        progress = elapsed / seconds
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        xy = torch.from_numpy(np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int64))
        logits = model(xy[:, :-1])
        loss_t = F.cross_entropy(logits.reshape(-1, vocab), xy[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, loss = step + 1, loss_t.item()
        if step % 50 == 0:
            log(f"reference step {step} | loss {loss:.4f} | {elapsed:.0f}s")
    return model.eval(), {"steps": step, "tokens": step * batch * seq, "loss": loss}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/python")
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    _, info = train(args.data, args.seconds, args.seed)
    print(json.dumps(info))
