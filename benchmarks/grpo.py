"""GRPO rollout speed: ember's engine sampling a step's completions against transformers'
``generate`` on the same weights and the same batch.

    .venv/bin/python benchmarks/grpo.py [--run RUN] [--model NAME] [--prompts 8 32] [--group 8]
                                        [--new-tokens 16] [--reps 5] [--threads N] [--device cpu|cuda]

A GRPO step (ember/train/tasks/grpo.py) renders P prompts of an embedded task (add-3) in the chat
format and samples G completions of each at temperature 1: P × G rows, each prompt repeated G
times in one batch. This script times exactly that call, ``Engine.generate`` with the row
seeds the trainer uses, against ``model.generate(do_sample=True, temperature=1, top_k=0)`` on
the transformers copy of the same weights (``to_hf``), left-padded with an attention mask, in
``torch.inference_mode``, fp32. Every row makes ``--new-tokens`` tokens on both sides (ember
``ignore_eos``, HF ``min_new_tokens``), so the work is equal; tokens/s = rows × new tokens /
median seconds. ember's time includes its per-step text decode and stop bookkeeping, which the
trainer needs to score completions; HF's ids are not decoded, which only favours HF.

The model is ``--run``'s final weights and tokenizer (e.g. runs/add3-sft, the demo's start), or
else a freshly initialised ``--model`` of benchmarks/decode.py (default cpu-quick, the demo's
shape) with a BPE trained in-process, whose reserved chat tokens render the prompts. Calls
alternate (ember, HF, ember, ...) after one warm-up each, so machine noise falls on both.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from decode import MODELS, model_config, timed, train_tokenizer
from printing import cpu_model, print_table

from ember.data.chat import render
from ember.data.tasks import TASKS
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.model.gpt import GPT
from ember.model.hf import to_hf
from ember.run import load_run


def time_step(model, hf, tokenizer, prompts: int, args, device: torch.device) -> list[str]:
    """One table row: ``prompts`` add-3 prompts × ``args.group`` samples, ember against HF."""
    problems = TASKS["add-3"].generate("train", prompts)
    ids = [render(tokenizer, p.messages()[:-1], add_generation_prompt=True)[0] for p in problems]
    batch = [p for p in ids for _ in range(args.group)]
    n, width, pad = len(batch), max(map(len, batch)), tokenizer.pad_id
    sampling = Sampling(args.new_tokens, temperature=1.0, seed=1 << 16, ignore_eos=True)
    engine = Engine(model, tokenizer)
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch], device=device)

    def ours():
        with torch.inference_mode():
            out = engine.generate(batch, sampling)
        assert all(len(c.token_ids) == args.new_tokens for c in out)

    def theirs():
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              pad_token_id=pad)  # fmt: skip
        assert out.size(1) == width + args.new_tokens

    ours(), theirs()  # warm-up
    times = {"ember": [], "hf": []}
    for _ in range(args.reps):
        times["ember"].append(timed(ours, device))
        times["hf"].append(timed(theirs, device))
    tokens = n * args.new_tokens
    e, h = (tokens / statistics.median(times[k]) for k in ("ember", "hf"))
    return [f"{prompts} × {args.group}", str(n), f"{e:,.0f}", f"{h:,.0f}", f"{e / h:.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="a run directory whose model and tokenizer to use")
    parser.add_argument("--model", default="cpu-quick", choices=sorted(MODELS), help="shape without --run")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 32], help="prompts per step (P)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.run:
        model, tokenizer = load_run(args.run, device=device)
        label = args.run
    else:
        tokenizer, _ = train_tokenizer()
        model = GPT.build(model_config(args.model, tokenizer.vocab_size), seed=0)
        label = f"{args.model} (random weights)"
    model = model.to(device).eval()
    hf = to_hf(model).to(device).eval()
    print(f"{label}: {model.num_params() / 1e6:.2f}M parameters, {device} "
          f"({cpu_model() if device.type == 'cpu' else torch.cuda.get_device_name(device)}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")  # fmt: skip

    rows_out = [time_step(model, hf, tokenizer, prompts, args, device) for prompts in args.prompts]
    print(f"sampling {args.new_tokens} tokens per row at temperature 1, median of {args.reps}")
    print_table(["prompts × group", "rows", "ember tok/s", "HF generate tok/s", "ember / HF"], rows_out)


if __name__ == "__main__":
    main()
