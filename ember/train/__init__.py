"""Training: the loop (trainer.py), optimizer and schedule (optim.py), checkpoints, metrics."""
