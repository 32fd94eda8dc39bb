"""Training: the loop (trainer.py), optimizer and schedule (optim.py), checkpoints, metrics, and
the post-training tasks it runs (sft.py, dpo.py, grpo.py, reward.py)."""
