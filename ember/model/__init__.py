"""The decoder-only transformer (gpt.py) and its mapping to HF transformers (hf.py)."""

# before any model module's torch imports pull in triton (torch.utils.flop_counter does): on a
# machine without CUDA, ember.kernels sets TRITON_INTERPRET=1, which triton reads when imported
import ember.kernels  # noqa: F401
