"""How well an image classifier does on a split: loss, accuracy with its 95% interval, and the
confusion matrix. One function serves the trainer's validation (``train.task=classify``) and
``ember eval RUN --split test``, so the two cannot disagree.

    ember eval runs/digits-cnn --split test
    results = evaluate_classifier_run("runs/digits-cnn", splits=["test"])

The interval is Wilson's score interval for a binomial proportion (Wilson 1927): with n test
images and k right it stays inside [0, 1] and keeps close to its 95% coverage even at 98-100%
accuracy, where the plain normal interval p ± 1.96·sqrt(p(1-p)/n) collapses to nothing at 100%.
It is the noise of the test set's size; the spread between seeds is a sweep's (``ember sweep``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F

from ember.data.images import load_images
from ember.errors import EmberError
from ember.run import load_run, record_eval, run_config
from ember.stats import wilson_interval


@torch.no_grad()
def classify(model, images: torch.Tensor, labels: torch.Tensor, batch: int = 512, autocast=None) -> dict:
    """``model``'s mean cross-entropy, accuracy, and confusion matrix (rows: the true class,
    columns: the predicted) on ``images`` (N, C, H, W) in [0, 1] with ``labels`` (N,), in eval mode
    (BatchNorm's running statistics), ``batch`` images at a time on the model's device."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss, confusion = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for i in range(0, len(images), batch):
            x, y = images[i : i + batch].to(device), labels[i : i + batch].to(device)
            with autocast or contextlib.nullcontext():
                logits = model(x).float()
            k = logits.size(-1)  # classes
            loss += F.cross_entropy(logits, y, reduction="sum").double()
            confusion += torch.bincount(y * k + logits.argmax(-1), minlength=k * k).view(k, k)
    finally:
        model.train(was_training)
    n, correct = len(images), int(confusion.diag().sum())
    lo, hi = wilson_interval(correct, n)
    return {
        "loss": loss.item() / max(n, 1),
        "accuracy": correct / max(n, 1),
        "accuracy_ci95": [lo, hi],
        "error": 1 - correct / max(n, 1),
        "images": n,
        "confusion": confusion.tolist(),
    }


def evaluate_classifier_run(run_dir: str | Path, ckpt: str = "last", splits: list[str] | None = None) -> dict:
    """Each split's ``classify`` result for the run's weights (``ckpt``: last, best or a step),
    on the images its config names (the same fixed splits it trained on), recorded in eval.json."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    model, _ = load_run(run_dir, ckpt, images=True)
    data = load_images(cfg.data.sources[0], cfg.data.val_fraction, cfg.data.test_fraction)
    results = {}
    for split in splits or ["val", "test"]:
        if split not in ("train", "val", "test"):
            raise EmberError(f"--split {split}: an image run is evaluated on train, val or test")
        results[split] = {**classify(model, *data.split(split)), "ckpt": ckpt, "data": data.source}
    record_eval(run_dir, results)
    return results


def print_classification(results: dict) -> None:
    """Each split's accuracy with its interval, loss, and confusion matrix."""
    for split, r in results.items():
        lo, hi = r["accuracy_ci95"]
        print(f"{split}: accuracy {r['accuracy']:.2%} (95% CI {lo:.2%}–{hi:.2%}) on {r['images']:,} images, "
              f"loss {r['loss']:.4f}")  # fmt: skip
        matrix = r["confusion"]
        width = max(4, len(str(max(max(row) for row in matrix))) + 1)
        print("  confusion (rows: true class, columns: predicted)")
        print("  " + " " * 4 + "".join(f"{j:>{width}}" for j in range(len(matrix))))
        for i, row in enumerate(matrix):
            print(f"  {i:>4}" + "".join(f"{v:>{width}}" for v in row))
