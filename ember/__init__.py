"""ember: a hackable, PyTorch-native lab for the whole life of a small GPT-style language model.

Start with ``ember --help``; the map of the code is in DESIGN.md.
"""

__version__ = "0.1.0"
