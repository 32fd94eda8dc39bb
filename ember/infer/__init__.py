"""Inference: the engine (engine.py, sampling.py) and evaluation on any text (evaluate.py)."""
