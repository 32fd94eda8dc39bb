"""The decoder-only transformer (gpt.py) and its mapping to HF transformers (hf.py)."""
