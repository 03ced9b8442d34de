"""Collation of packed batches for routed models (docs/design.md R3).

torchtune's ``padded_collate_packed`` returns a flex-attention ``BlockMask`` where flex attention is
available. Routed layers gather the selected tokens of each row and look their mask entries up, which
needs the dense boolean block-causal mask; this collate builds that one everywhere, with the same
tokens, labels and per-document positions.
"""

from typing import Dict, List

import torch
from torchtune.modules.attention_utils import create_block_causal_mask


def padded_collate_packed_dense(batch: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack packs of a torchtune ``PackedDataset``.

    Args:
        batch: packs with ``tokens``, ``labels``, ``input_pos`` (positions restarting at 0 in every
            document) and ``seq_lens`` (document lengths; a final entry covers the pack's padding).

    Returns:
        ``tokens``, ``labels``, ``input_pos``: ``[b, s]``; ``mask``: ``[b, s, s]`` bool, block-causal
        (a token sees the earlier tokens of its own document only).
    """
    return {
        "tokens": torch.stack([pack["tokens"] for pack in batch]),
        "labels": torch.stack([pack["labels"] for pack in batch]),
        "input_pos": torch.stack([pack["input_pos"] for pack in batch]),
        "mask": create_block_causal_mask([pack["seq_lens"] for pack in batch]),
    }
