"""Export and import: a run directory to and from other formats (hf.py: HF transformers)."""
