"""``ember eval``: loss, perplexity and bits per byte of a run's model on any text, saying
exactly what was measured.

    results = evaluate_run(Path("runs/tiny"), splits=["val", "test"])
    results["test"]["bpb"], results["test"]["tokens"], results["test"]["strata"]

The model comes from the run directory alone (``last``, ``best`` or a checkpoint ``STEP``); text
is a split of the run's prepared data or any source string, tokenized with the run's tokenizer.
docs/eval.md ("What ``ember eval`` scores") has the rules at length.

Design choices:

- **Every** target token is scored, once: windows of ``seq_len`` step by ``stride``, each
  scoring only the tokens not scored yet with those before as context (the sliding-window
  perplexity of the transformers guide: ``seq_len / stride`` times the compute). ``max_windows``
  subsamples only when asked, and the result says how many of how many.
- Bits per byte divide the loss on text tokens by their UTF-8 bytes, so tokenizers compare.
- A masked LM (``model.causal=false``) is scored by ``score_masked``: the training corruption
  (ember/data/masking.py) with fixed seeds on side-by-side windows, reporting the masked tokens'
  accuracy, loss and bits per byte: their nats over the UTF-8 bytes of the original tokens.
- Each figure comes per stratum too, with a 95% bootstrap interval over documents: how far it
  could move on another sample of documents like these (what decides whether a val/train gap
  is noise). ``eval.json`` keeps one entry per dataset label; evaluating again replaces it only.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ember.data.chat import chat_ids, render
from ember.data.loader import TokenDataset
from ember.data.manifest import read_manifest
from ember.data.masking import IGNORE, mask_id, mask_tokens, seeded
from ember.data.sources import open_source
from ember.data.tokenizer import Tokenizer
from ember.errors import EmberError
from ember.infer.classify import evaluate_classifier_run, print_classification
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.run import load_run, model_kind, record_eval, saved_config
from ember.stats import wilson_interval

SPLITS = ("train", "val", "test")  # train: to compare like with like (use --max-windows)


# ---------------------------------------------------------------- text to score


def split_text(data_dir: str | Path, split: str) -> tuple[np.ndarray, list[dict]]:
    """All tokens of one split of a prepared directory, and its strata (name, offset, tokens,
    documents, bytes) from the manifest."""
    manifest = read_manifest(data_dir)
    info = manifest["splits"].get(split)
    if not info or not info.get("documents"):
        rule = manifest.get("split_rules", {}).get(split, "")
        raise EmberError(
            f"{data_dir} has no {split} split{f' ({rule})' if rule else ''}; prepare it with "
            f"data.{'test_sources or data.test_fraction' if split == 'test' else 'val_fraction'} set, "
            "or evaluate other text with --data"
        )
    tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in TokenDataset(data_dir, split).shards])
    whole = {"name": split, "offset": 0, "documents": info["documents"], "bytes": info["bytes"]}
    return tokens, info.get("strata") or [{**whole, "tokens": len(tokens)}]


def source_text(specs: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, list[dict]]:
    """Every document of the sources, tokenized, one stratum per source string."""
    ids: list[int] = []
    strata = []
    for spec in specs:
        start, docs, nbytes = len(ids), 0, 0
        for doc in open_source(spec).documents():
            ids.extend(tokenizer.encode(doc.text))
            ids.append(tokenizer.eos_id)
            docs += 1
            nbytes += len(doc.text.encode("utf-8"))
        strata.append(
            {"name": spec, "offset": start, "documents": docs, "bytes": nbytes, "tokens": len(ids) - start}
        )
    return np.asarray(ids, dtype=np.int64), strata


def windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, length, first scored position) of each window so that targets 1..n-1 are
    scored exactly once; window inputs are ``[start, start+length)``, its targets one later."""
    if n_tokens < 2:
        return []
    length = min(seq_len, n_tokens - 1)
    out, nxt = [], 1  # nxt: the first target index not yet scored
    while nxt < n_tokens:
        end = min(nxt + (length if nxt == 1 else stride), n_tokens)  # score targets [nxt, end)
        start = max(0, end - 1 - length)
        out.append((start, length, nxt - start - 1))
        nxt = end
    return out


@torch.no_grad()
def score(
    model,
    tokens: np.ndarray,
    token_bytes: torch.Tensor,
    strata: list[dict],
    seq_len: int,
    stride: int | None = None,
    batch_size: int = 8,
    max_windows: int | None = None,
    eos_id: int | None = None,
) -> dict:
    """Loss, perplexity and bits per byte of ``model`` on ``tokens`` (see module docstring),
    overall and per stratum, with the documents, tokens and bytes scored."""
    stride = stride or seq_len
    if not 1 <= stride <= seq_len:
        raise EmberError(f"--stride {stride} must be between 1 and the window length {seq_len}")
    plan = windows(len(tokens), seq_len, stride)
    if not plan:
        raise EmberError(f"only {len(tokens)} token(s): nothing to score; give more text")
    total = len(plan)
    if max_windows is not None and max_windows < total:
        plan = [plan[i] for i in np.arange(max_windows) * total // max_windows]  # evenly spaced
    offsets = np.array([s["offset"] for s in strata], dtype=np.int64)
    names = sorted({s["name"] for s in strata})
    slot = np.array([names.index(s["name"]) for s in strata])
    sums = np.zeros((len(names), 5))  # nats, tokens, text nats, bytes, documents (eos scored)
    ends = np.flatnonzero(tokens == eos_id) if eos_id is not None else np.zeros(0, dtype=np.int64)
    per_doc = np.zeros((len(ends) + 1, 4))  # nats, tokens, text nats, bytes of each document
    was_training = model.training
    model.eval()
    arange = np.arange(plan[0][1])
    for lo in range(0, len(plan), batch_size):
        chunk = plan[lo : lo + batch_size]
        starts = np.array([s for s, _, _ in chunk])[:, None]
        idx = starts + arange  # (B, T) input positions
        x, y = torch.from_numpy(tokens[idx]), torch.from_numpy(tokens[idx + 1])
        nats = F.cross_entropy(model(x).float().flatten(0, 1), y.reshape(-1), reduction="none").view(y.shape)
        scored = arange[None, :] >= np.array([f for _, _, f in chunk])[:, None]  # (B, T)
        target = (idx + 1)[scored]
        which = slot[np.searchsorted(offsets, target, side="right") - 1]
        nb = token_bytes[y].numpy()[scored]
        n = nats.double().numpy()[scored]
        text = nb > 0
        eos = (y.numpy()[scored] == eos_id) if eos_id is not None else np.zeros_like(text)
        for col, values in enumerate((n, np.ones_like(n), n * text, nb, eos)):
            sums[:, col] += np.bincount(which, weights=values.astype(np.float64), minlength=len(names))
        doc = np.searchsorted(ends, target, side="left")  # a document's <|eos|> is its own
        for col, values in enumerate((n, np.ones_like(n), n * text, nb)):
            per_doc[:, col] += np.bincount(doc, weights=values.astype(np.float64), minlength=len(per_doc))
    model.train(was_training)

    def metrics(row) -> dict:
        nats, count, text_nats, nbytes, docs = row
        counts = {"documents": int(docs), "tokens": int(count), "bytes": int(nbytes)}
        return {**language_metrics(nats, count, text_nats, nbytes), **counts}

    result = metrics(sums.sum(0))
    result.update(document_ci95(per_doc[per_doc[:, 1] > 0]))
    result.update(windows=len(plan), windows_total=total, seq_len=seq_len, stride=stride)
    if len(names) > 1:
        result["strata"] = {name: metrics(sums[i]) for i, name in enumerate(names)}
    return result


def language_metrics(nats: float, tokens: float, text_nats: float, nbytes: float) -> dict:
    """Loss (nats per token), perplexity, and bits per UTF-8 byte of the text (the nats of the
    tokens that stand for text, over its bytes: special tokens excluded, so tokenizers compare
    fairly): the one formula behind ``ember eval`` and the trainer's validation."""
    loss = nats / max(tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50)), "bpb": text_nats / math.log(2) / max(nbytes, 1)}


def masked_metrics(nats: float, correct: float, masked: float, nbytes: float) -> dict:
    """A masked LM's loss (nats per masked token), perplexity, accuracy and bits per byte: the nats
    of the masked tokens over the UTF-8 bytes those tokens stand for (every masked token is text)."""
    loss = nats / max(masked, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50)), "masked_accuracy": correct / max(masked, 1),
            "bpb": nats / math.log(2) / max(nbytes, 1)}  # fmt: skip


@torch.no_grad()
def masked_sums(model, x: torch.Tensor, generator: torch.Generator, rate: float, mask: int,
                token_bytes: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(nats, correct, masked tokens, their bytes), float64 on x's device, of ``model`` on windows
    ``x`` (B, T) corrupted by the masked-LM rule with ``generator``: the one sum behind the MLM
    task's validation and ``ember eval``."""
    inputs, targets = mask_tokens(x, generator, rate, mask, token_bytes > 0)
    keep = targets != IGNORE
    logits = model(inputs, keep=keep).float()  # (N, V)
    target = targets[keep]
    nats = F.cross_entropy(logits, target, reduction="sum")
    sums = [nats, (logits.argmax(-1) == target).sum(), keep.sum(), token_bytes[target].sum()]
    return torch.stack([v.double() for v in sums])


@torch.no_grad()
def score_masked(model, tokens: np.ndarray, token_bytes: torch.Tensor, seq_len: int, rate: float, mask: int,
                 batch_size: int = 8, max_windows: int | None = None, documents: int = 0) -> dict:  # fmt: skip # noqa: E501
    """A masked LM on ``tokens``: side-by-side windows of ``seq_len`` (the tail shorter than one is
    left out), window batch ``i`` corrupted with ``seeded(0, i, 0, "eval")``, so every model is
    scored on the same masks. Accuracy comes with its 95% Wilson interval over masked tokens
    (tokens of a document are not independent, so it is on the narrow side)."""
    total = len(tokens) // seq_len
    if total == 0:
        raise EmberError(f"only {len(tokens)} token(s): not one window of {seq_len}; give more text")
    starts = np.arange(total) * seq_len
    if max_windows is not None and max_windows < total:
        starts = starts[np.arange(max_windows) * total // max_windows]  # evenly spaced
    sums = torch.zeros(4, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for i, lo in enumerate(range(0, len(starts), batch_size)):
        x = torch.from_numpy(tokens[starts[lo : lo + batch_size, None] + np.arange(seq_len)])
        sums += masked_sums(model, x, seeded(0, i, 0, "eval"), rate, mask, token_bytes)
    model.train(was_training)
    nats, correct, masked, nbytes = sums.tolist()
    ci95 = list(wilson_interval(int(correct), int(masked)))
    return {**masked_metrics(nats, correct, masked, nbytes), "accuracy_ci95": ci95, "tokens": int(masked),
            "bytes": int(nbytes), "documents": documents, "windows": len(starts), "windows_total": total,
            "seq_len": seq_len, "stride": seq_len}  # fmt: skip


def document_ci95(per_doc: np.ndarray, resamples: int = 2000, seed: int = 0) -> dict:
    """95% bootstrap intervals of loss and bits per byte over documents: how much the figure
    would move on another sample of documents like these (rows: nats, tokens, text nats,
    bytes of each document). A Poisson bootstrap (each document weighted Poisson(1) times),
    seeded, in chunks, so memory stays small for any number of documents."""
    if len(per_doc) < 2:
        return {"loss_ci95": None, "bpb_ci95": None}
    rng = np.random.default_rng(seed)
    losses, bpbs = [], []
    for lo in range(0, resamples, 100):
        w = rng.poisson(1.0, size=(min(100, resamples - lo), len(per_doc)))
        nats, count, text, nbytes = (w @ per_doc).T
        losses.append(nats / np.maximum(count, 1))
        bpbs.append(text / math.log(2) / np.maximum(nbytes, 1))
    losses, bpbs = np.concatenate(losses), np.concatenate(bpbs)
    return {
        "loss_ci95": [float(np.quantile(losses, 0.025)), float(np.quantile(losses, 0.975))],
        "bpb_ci95": [float(np.quantile(bpbs, 0.025)), float(np.quantile(bpbs, 0.975))],
    }


def evaluate_run(
    run_dir: Path,
    sources: list[str] | None = None,
    ckpt: str = "last",
    seq_len: int | None = None,
    batch_size: int = 8,
    max_windows: int | None = None,
    splits: list[str] | None = None,
    stride: int | None = None,
) -> dict:
    """Evaluate on ``splits`` of the run's data (default ``val`` unless ``sources`` are given)
    and on each source; update ``RUN/eval.json``; returns {dataset label: metrics}. An image
    classifier's run is scored on its image splits (``ember.infer.classify``)."""
    run_dir = Path(run_dir)
    if model_kind(run_dir) != "gpt":
        if sources:
            raise EmberError(f"{run_dir} is an image classifier: evaluate it on --split train, val or test")
        return evaluate_classifier_run(run_dir, ckpt, splits or ["val"])
    model, tokenizer = load_run(run_dir, ckpt)
    config = saved_config(run_dir / "config.yaml")
    seq_len = seq_len or config["train"]["seq_len"]
    if seq_len > model.cfg.max_seq_len:
        raise EmberError(f"--seq-len {seq_len} is beyond the model's max_seq_len {model.cfg.max_seq_len}")
    for split in splits or []:
        if split not in SPLITS:
            raise EmberError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    splits = splits if splits is not None else ([] if sources else ["val"])
    token_bytes = torch.tensor(tokenizer.token_byte_lengths(model.cfg.vocab_size))
    if not model.cfg.causal and stride is not None:
        raise EmberError("--stride is for causal models; a masked LM is scored on side-by-side windows")
    datasets = [(split, lambda s=split: split_text(config["data"]["dir"], s)) for split in splits]
    datasets += [(spec, lambda s=spec: source_text([s], tokenizer)) for spec in sources or []]
    results = {}
    for label, text in datasets:
        tokens, strata = text()
        if model.cfg.causal:
            r = score(
                model, tokens, token_bytes, strata, seq_len, stride, batch_size, max_windows, tokenizer.eos_id
            )
        else:  # a masked LM (module docstring)
            rate, docs = config["train"]["mlm_mask"], sum(s["documents"] for s in strata)
            r = score_masked(model, tokens, token_bytes, seq_len, rate, mask_id(tokenizer), batch_size,
                             max_windows, docs)  # fmt: skip
        results[label] = {**r, "ckpt": ckpt, "data": config["data"]["dir"] if label in SPLITS else label}
    record_eval(run_dir, results)
    return results


# ---------------------------------------------------------------- task accuracy


def choose(model, tokenizer, problem) -> str:
    """The option of ``problem.meta["options"]`` the model finds likeliest as the reply: the sum of
    log-probabilities of its tokens and the closing ``<|end_turn|>`` (so "13" does not win as a
    prefix of "132") after the chat-format prompt."""
    prompt = render(tokenizer, problem.messages()[:-1], add_generation_prompt=True)[0]
    end = chat_ids(tokenizer)["end"]
    best, best_score = None, -math.inf
    for option in problem.meta["options"]:
        reply = [*tokenizer.encode(option), end]
        logits = model(torch.tensor([prompt + reply[:-1]]))[0, len(prompt) - 1 :]  # predicts each reply token
        score = logits.float().log_softmax(-1).gather(1, torch.tensor(reply)[:, None]).sum().item()
        if score > best_score:
            best, best_score = option, score
    return best


def answer_problems(engine, task, problems: list, max_new_tokens: int = 32, batch: int = 16) -> list[tuple]:
    """(problem, the model's answer, its reward) for each problem: greedy replies in the chat
    format scored by the task's verifier, or for multiple-choice problems the likeliest option."""
    model, tokenizer = engine.model, engine.tokenizer
    outputs = []
    if problems and "options" in problems[0].meta:  # multiple choice: by log-likelihood
        with torch.no_grad():
            for problem in problems:
                choice = choose(model, tokenizer, problem)
                outputs.append((problem, choice, float(choice == problem.answer)))
        return outputs
    greedy = Sampling(max_new_tokens=max_new_tokens, temperature=0.0)
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        prompts = [render(tokenizer, p.messages()[:-1], add_generation_prompt=True)[0] for p in chunk]
        for problem, completion in zip(chunk, engine.generate(prompts, greedy, truncate=True), strict=True):
            outputs.append((problem, completion.text, float(task.score(problem, completion.text))))
    return outputs


def evaluate_task(
    run_dir: Path,
    task_name: str,
    n: int = 200,
    ckpt: str = "last",
    max_new_tokens: int = 32,
    batch: int = 16,
    skip: int = 0,
) -> dict:
    """Greedy answers of the run's model to ``n`` problems of ``task_name``'s **test** split, each
    prompt in the chat format (ember/data/chat.py), scored by the task's verifier: the mean reward
    (exact-match accuracy for the exact tasks; multiple-choice tasks are scored by ``choose``, no
    generation), its 95% Wilson interval (over problems, taking rewards of 1 as successes), and a
    few examples. Recorded in ``RUN/eval.json`` as ``task:NAME``.
    ``skip``: answer test problems ``skip .. skip + n - 1``, so the first ``skip`` (those a
    training run evaluated on, and that picked its settings) are left out."""
    from ember.data.tasks import TASKS

    if task_name not in TASKS:
        raise EmberError(f"--task {task_name!r}: unknown task; choose one of {', '.join(TASKS)}")
    task, run_dir = TASKS[task_name], Path(run_dir)
    engine = Engine(*load_run(run_dir, ckpt))
    if skip < 0 or n < 1:
        raise EmberError(f"--n {n} --skip {skip}: answer at least one problem, skipping none or more")
    problems = task.generate("test", skip + n)[skip:]
    if not problems:
        raise EmberError(f"--skip {skip}: {task_name}'s test split has no more problems than that")
    outputs = answer_problems(engine, task, problems, max_new_tokens, batch)
    rewards = [reward for _, _, reward in outputs]
    examples = [
        {"prompt": p.prompt, "answer": p.answer, "output": text, "reward": reward}
        for p, text, reward in outputs[:5]
    ]
    exact = sum(r == 1.0 for r in rewards)
    result = {
        "task": task_name,
        "problems": len(rewards),
        "split": "test",
        "skipped": skip,
        "mean_reward": sum(rewards) / len(rewards),
        "accuracy": exact / len(rewards),
        "accuracy_ci95": list(wilson_interval(exact, len(rewards))),
        "ckpt": ckpt,
        "examples": examples,
    }
    record_eval(run_dir, {f"task:{task_name}": result})
    return result


# ---------------------------------------------------------------- what `ember eval` prints


def print_task(r: dict, run_dir: Path) -> None:
    """A few examples, then the accuracy with its interval, of ``evaluate_task``'s result ``r``."""
    lo, hi = r["accuracy_ci95"]
    for ex in r["examples"]:
        print(f"  {ex['prompt']!r} -> {ex['output']!r} (want {ex['answer']!r}, reward {ex['reward']:.2f})")
    skipped = f" after the first {r['skipped']}" if r["skipped"] else ""
    print(f"{r['task']}: accuracy {r['accuracy']:.1%} (95% interval {lo:.1%} … {hi:.1%}), mean reward "
          f"{r['mean_reward']:.3f}, over {r['problems']} problems of its test split{skipped}, greedy, "
          f"chat format; written {run_dir / 'eval.json'}")  # fmt: skip


def print_results(results: dict, title: str, run_dir: Path) -> None:
    """``evaluate_run``'s results as a table, a row per dataset and per stratum, with the notes."""
    if "masked_accuracy" in next(iter(results.values())):
        return print_masked(results, title, run_dir)
    if "confusion" in next(iter(results.values())):
        return print_classification(results)
    from rich.console import Console
    from rich.table import Column, Table
    from rich.text import Text

    table = Table(Column("data", no_wrap=True), "documents", "tokens", "bytes", "loss", "perplexity",
                  "bits/byte", title=Text(title), title_justify="left")  # fmt: skip
    for name, r in results.items():
        for label, m in [(name, r)] + [(f"  {k}", v) for k, v in r.get("strata", {}).items()]:
            table.add_row(Text(label),  # literally: a glob like test_[a-c]*.py is not markup
                          f"{m['documents']:,}", f"{m['tokens']:,}", f"{m['bytes']:,}",
                          f"{m['loss']:.4f}", f"{m['ppl']:.2f}", f"{m['bpb']:.4f}")  # fmt: skip
        if r.get("bpb_ci95"):
            lo, hi = r["bpb_ci95"]
            print(f"{name}: bits/byte 95% interval over its {r['documents']:,} documents: {lo:.4f} … {hi:.4f}")  # fmt: skip # noqa: E501
        if r["windows"] < r["windows_total"]:
            print(f"note: {name}: {r['windows']} of {r['windows_total']} windows scored (--max-windows)")
    Console(width=max(Console().width, max(map(len, results)) + 100)).print(table)
    first = next(iter(results.values()))
    print(f"windows of {first['seq_len']} tokens, stride {first['stride']}; written {run_dir / 'eval.json'}")


def print_masked(results: dict, title: str, run_dir: Path) -> None:
    """A masked LM's ``evaluate_run`` results: a line per dataset."""
    print(title)
    for name, r in results.items():
        lo, hi = r["accuracy_ci95"]
        print(f"{name}: masked-token accuracy {r['masked_accuracy']:.2%} (95% interval {lo:.2%} … {hi:.2%}), "
              f"loss {r['loss']:.4f}, bits/byte {r['bpb']:.4f} over {r['tokens']:,} masked tokens "
              f"({r['bytes']:,} bytes) in {r['windows']:,} of {r['windows_total']:,} windows")  # fmt: skip
    first = next(iter(results.values()))
    print(f"windows of {first['seq_len']} tokens side by side, the training masking with fixed seeds; "
          f"bits/byte: the masked tokens' nats over their bytes; written {run_dir / 'eval.json'}")  # fmt: skip # noqa: E501
