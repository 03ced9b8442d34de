from torchtune_dtf.modules.decoder import RoutedTransformerDecoder
from torchtune_dtf.modules.layers import (
    ROUTING_MODULE_GROUPS,
    ROUTING_MODULE_NAMES,
    DroppedLayer,
    MoDLayer,
    RandomRoutedLayer,
    RoutedSelfAttentionLayer,
    SDTDecisionLayer,
    SDTDynamicLayer,
    STTLayer,
)
from torchtune_dtf.modules.predictors import PriorFFN, ResidualPredictor, SkipBias, SkipLinear, predictor_width
from torchtune_dtf.modules.routed_block import routed_block_forward
from torchtune_dtf.modules.routers import CausalRouter, MoDRouter, previous_token_states
from torchtune_dtf.modules.routing_context import LayerRouting, RoutingContext
from torchtune_dtf.modules.selection import Selection, mask_selection, topk_selection
from torchtune_dtf.modules.selective_kv_cache import SelectiveKVCache
from torchtune_dtf.modules.surprise import PredictiveRouter, causal_moving_average


def is_routing_key(key: str) -> bool:
    """True for state-dict keys of routing parameters (not part of a stock Qwen2 checkpoint)."""
    return routing_group_of(key) is not None


def routing_group_of(key: str):
    """The optimizer group (``ROUTING_MODULE_GROUPS``) of a parameter or state-dict key, None for the backbone."""
    for part in key.split("."):
        if part in ROUTING_MODULE_GROUPS:
            return ROUTING_MODULE_GROUPS[part]
    return None
