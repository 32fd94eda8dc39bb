"""Inference: the generation engine (engine.py) and evaluation on any text (evaluate.py)."""
