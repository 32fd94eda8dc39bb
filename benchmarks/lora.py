"""LoRA fine-tuning speed and memory: ember's adapters against transformers + PEFT.

    python benchmarks/lora.py                      # CPU, llama-mini, r=8 on q/k/v/o/gate/up/down
    python benchmarks/lora.py --compile            # ember's blocks compiled, as train.compile=true
    python benchmarks/lora.py --data add-2          # SFT rows: packed add-2 conversations
    python benchmarks/lora.py --device cuda --model llama-small --batch 16

The same base weights (ember's model, exported with ``ember.model.hf.to_hf``), the same
batches of token ids, the same rank, alpha and targets, AdamW over the adapters only, fp32 on
the CPU (bf16 autocast with ``--device cuda``). Each side runs in its own child process, so
its peak memory is its own: the child's peak resident set (CPU) or
``torch.cuda.max_memory_allocated`` (CUDA), minus what the process held before building the
model. Tokens/s is the median over the timed steps, after warm-up steps. ember's step is
``model(x)`` + cross-entropy; PEFT's is ``model(input_ids=x).logits`` + cross-entropy, what
``labels=y`` computes inside transformers. The first step's losses are printed: they agree
(same weights, same batch), which is the check that both sides train the same thing.

``--data random`` (default): uniform random ids, every position trained (pretraining-style).
``--data add-2``: what SFT trains on: rows of add-2 conversations packed back to back (ember's
``SFTLoader``; a BPE of 512 fitted to them), the loss on the assistant tokens only (about a
fifth of the positions), the prompts' labels -100 for transformers. Attention is plainly causal
on both sides here (same numbers to compare). ember's loss asks the model for the trained
positions' logits only (``GPT.forward(keep=...)``, as ``train.task=sft`` does); transformers
computes every position's, as TRL's SFTTrainer does (its ``logits_to_keep`` takes positions
shared by every row, which packed rows do not have).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

MODELS = {
    "llama-mini": dict(n_layer=6, n_head=6, n_kv_head=2, d_model=384),
    "llama-small": dict(n_layer=12, n_head=12, n_kv_head=4, d_model=768),
}
LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w3": "up_proj",
           "w2": "down_proj"}  # fmt: skip


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_batches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four (inputs, targets) batches, the same in both children (see the module docstring)."""
    if args.data == "random":
        g = torch.Generator().manual_seed(1)
        rows = [torch.randint(0, 4096, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
        return [(r[:, :-1], r[:, 1:]) for r in rows]
    from ember.data.tasks import TASKS
    from ember.data.tokenizer import Tokenizer
    from ember.train.tasks.sft import SFTLoader, encode_conversations

    conversations = [p.messages() for p in TASKS[args.data].generate("train", 4000)]
    tokenizer = Tokenizer.train_bpe([m["content"] for c in conversations for m in c], 512)
    examples = encode_conversations(tokenizer, conversations, args.seq_len)
    loader = SFTLoader(examples, args.seq_len, args.batch, seed=0)
    return [loader.next_batch()[:2] for _ in range(4)]  # (x, y): y is -100 off the answers


def timed(fn, repeats: int = 7) -> float:
    fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def floor(args, trained: int) -> dict:
    """Seconds a step cannot go below on this machine (CPU): the matrix products it must do,
    each timed alone with torch.mm at its shape (the frozen base's linears forward and their
    input gradients; the adapters' forward, gradients and input gradients; the head forward and
    its input gradient on ``trained`` rows) and attention forward and backward
    (F.scaled_dot_product_attention). Norms, activations, RoPE, the loss and the optimizer are
    left out, so the floor is below any real step."""
    from ember.config import ModelConfig
    from ember.model.gpt import GPT, block_linears

    cfg = ModelConfig(vocab_size=4096, max_seq_len=args.seq_len, dropout=0.0, **MODELS[args.model], **LLAMA)
    with torch.device("meta"):
        model = GPT(cfg)
    M, r = args.batch * args.seq_len, args.rank
    shapes: list[tuple[int, int, int]] = []  # (m, k, n): an (m, k) @ (k, n) product
    for _, _, linear in block_linears(model):
        i, o = linear.in_features, linear.out_features
        shapes += [(M, i, o), (M, o, i)]  # frozen weight: forward, input gradient
        shapes += [(M, i, r), (M, r, o), (o, M, r), (r, M, i), (M, o, r), (M, r, i)]  # the adapter
    shapes += [(trained, cfg.d_model, cfg.vocab_size), (trained, cfg.vocab_size, cfg.d_model)]
    gemm = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        gemm += timed(lambda a=a, b=b: a @ b)
    hd = cfg.d_model // cfg.n_head
    q = torch.randn(args.batch, cfg.n_head, args.seq_len, hd, requires_grad=True)
    kv = [torch.randn(args.batch, cfg.n_kv_head, args.seq_len, hd, requires_grad=True) for _ in range(2)]

    def attention():
        out = F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    return {"gemm_s": gemm, "attention_s": cfg.n_layer * timed(attention)}


def child(args) -> dict:
    from ember.config import ModelConfig
    from ember.model.gpt import GPT
    from ember.model.lora import apply_lora

    torch.manual_seed(0)
    device = torch.device(args.device)
    before = rss_mb()
    cfg = ModelConfig(vocab_size=4096, max_seq_len=args.seq_len, dropout=0.0, **MODELS[args.model], **LLAMA)
    base = GPT.build(cfg, seed=0)
    if args.peer == "ember":
        model = apply_lora(base, args.rank, 2 * args.rank, targets=tuple(TARGETS)).to(device)
        if args.compile:  # what train.compile=true does: each block under torch.compile
            from ember.parallel.parallelize import apply_compile

            apply_compile(model)

        def loss_of(x, y):
            if args.data == "random":
                return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            keep = y != -100
            return F.cross_entropy(model(x, keep=keep), y[keep])
    else:
        import peft

        from ember.model.hf import to_hf

        hf = to_hf(base)
        config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                 target_modules=list(TARGETS.values()))  # fmt: skip
        model = peft.get_peft_model(hf, config).to(device)

        def loss_of(x, y):
            logits = model(input_ids=x).logits  # labels= would shift; our y is already the next token
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    batches = make_batches(args)
    autocast = (
        torch.autocast("cuda", torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, first_loss = [], None
    for step in range(args.warmup + args.steps):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = loss_of(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if first_loss is None:
            first_loss = loss.item()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else rss_mb() - before
    tokens = args.batch * args.seq_len
    return {"tok_s": tokens / statistics.median(seconds), "peak_mb": peak, "first_loss": first_loss,
            "trainable": trainable, "seconds": seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama-mini")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--data", choices=["random", "add-2"], default="random",
        help="random: every position trained; add-2: packed SFT conversations, answers trained",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="ember's blocks under torch.compile, as train.compile=true runs them",
    )
    parser.add_argument("--peer", choices=["ember", "peft", "floor"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer == "floor":
        batches = make_batches(args)
        trained = round(statistics.mean(int((y != -100).sum()) for _, y in batches))
        print(json.dumps({**floor(args, trained), "trained": trained}))
        return
    if args.peer:
        print(json.dumps(child(args)))
        return
    import peft
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}")  # fmt: skip
    print(
        f"{args.model}{' (ember compiled: train.compile=true)' if args.compile else ''}, LoRA r={args.rank} "
        f"alpha={2 * args.rank} on {', '.join(TARGETS.values())}; {args.data} data, batch "
        f"{args.batch} x {args.seq_len} tokens, AdamW on the adapters; {args.steps} timed steps after "
        f"{args.warmup}"
    )
    results = {}
    for _ in range(2):  # each peer twice, in turns, so drift in the machine falls on both
        for peer in ("ember", "peft"):
            argv = [sys.executable, __file__, *sys.argv[1:], "--peer", peer]
            out = (
                subprocess.run(argv, capture_output=True, text=True, check=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            results.setdefault(peer, []).append(json.loads(out))
    rows = {}
    for peer, runs in results.items():
        rows[peer] = {
            "tok_s": statistics.median([r["tok_s"] for r in runs]),
            "peak_mb": max(r["peak_mb"] for r in runs),
            "first_loss": runs[0]["first_loss"],
            "trainable": runs[0]["trainable"],
        }
        r = rows[peer]
        each = ", ".join(f"{x['tok_s']:,.0f}" for x in runs)
        print(
            f"{peer:6s} {r['tok_s']:9,.0f} tok/s  peak {r['peak_mb']:8,.0f} MiB  "
            f"trainable {r['trainable']:,}  first loss {r['first_loss']:.6f}  (runs: {each})"
        )
    tokens = args.batch * args.seq_len
    if args.device == "cpu":  # the GEMM floor: see floor()
        argv = [sys.executable, __file__, *sys.argv[1:], "--peer", "floor"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        f = json.loads(out.splitlines()[-1])
        floor_s = f["gemm_s"] + f["attention_s"]
        peft_s = tokens / rows["peft"]["tok_s"]
        print(
            f"floor  {tokens / floor_s:9,.0f} tok/s  (matrix products {1e3 * f['gemm_s']:.1f} ms + attention "
            f"{1e3 * f['attention_s']:.1f} ms a step, the head on {f['trained']:,} of {tokens:,} positions): "
            f"PEFT's step is {peft_s / floor_s:.2f}x the floor, ember's "
            f"{tokens / rows['ember']['tok_s'] / floor_s:.2f}x"
        )
    ratio = rows["ember"]["tok_s"] / rows["peft"]["tok_s"]
    memory = rows["ember"]["peak_mb"] / rows["peft"]["peak_mb"]
    print(
        f"ember / PEFT: {ratio:.2f}x tokens/s, {memory:.2f}x peak memory "
        f"(target >= 1.3x at <= 1.0x: {'met' if ratio >= 1.3 and memory <= 1.0 else 'not met'})"
    )


if __name__ == "__main__":
    main()
