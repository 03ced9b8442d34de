"""torchtune_dtf: routed (MoD, SDT, STT) Qwen2.5 models for torchtune."""

# First, before anything imports torchtune (and torchao): drop the dependency messages that say nothing to a
# user of this package (each named, with its reason, in torchtune_dtf/_quiet.py).
from torchtune_dtf import _quiet

_quiet.install()
