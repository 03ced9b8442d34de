"""The base class of every module that holds routing parameters.

The routers (:class:`MoDRouter`, :class:`CausalRouter`), the residual predictors (PriorFFN, TPN), the
predictive router (o_ce, m_cu) and the skip bias are new weights that start from nothing, so in a LoRA model,
whose backbone is frozen, they train in full beside the LoRA matrices. torchtune finds them as it finds its
own adapters: ``get_adapter_params`` walks ``model.named_modules()`` and, for every module with a callable
``adapter_params()``, takes the parameter names it returns (relative to that module, searched recursively)
as adapter parameters; ``set_trainable_params`` then freezes everything else.
"""

from typing import List

from torch import nn


class RoutingModule(nn.Module):
    """An ``nn.Module`` all of whose parameters are adapter parameters in torchtune's sense."""

    def adapter_params(self) -> List[str]:
        """Names of every parameter of this module, relative to it (torchtune's ``get_adapter_params`` hook)."""
        # A new list on every call: get_adapter_params removes each name from it as it matches it.
        return [name for name, _ in self.named_parameters()]
