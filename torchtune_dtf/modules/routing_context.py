"""Per-forward routing inputs (mode, β) and outputs (per-layer statistics and auxiliary losses).

The trainer creates one :class:`RoutingContext` per forward and passes it as ``model(tokens,
routing=ctx)``; routed layers read β and the mode from it and leave a :class:`LayerRouting` record
keyed by their layer index. Stock torchtune callers pass nothing and get student (inference) routing.
"""

from dataclasses import dataclass, field, replace
from typing import Dict, Optional, Tuple, Union

import torch

ROUTING_MODES = ("teacher", "student", "dense")
EXECUTE_CHOICES = ("teacher", "student")


@dataclass
class LayerRouting:
    """What one routed layer decided and measured in one forward. Per-token tensors are ``[b, s]``.

    Attributes:
        selected_mask: tokens that ran the block in this forward.
        student_logits: causal router logits r̃.
        teacher_mask: teacher (non-causal) selection, teacher mode only.
        student_mask: what the student would have selected (teacher mode only, for agreement metrics).
        router_logits: MoD router logits r (MoD only).
        d_st, d_ch, ce, cu, s_ce, s_cu, g: surprise signals (SDT/STT teacher mode), fp32.
        score: the non-saturating rank score of g that the teacher selects by (SDT/STT teacher mode).
        o_ce, m_cu: current values of the learnable offsets (scalars).
        pred_loss: predictor (PriorFFN/TPN) MSE against the stop-gradient residual, averaged over tokens.
        causal_loss: BCE of the student logits against the teacher mask, averaged over tokens.
        g_mean: mean of g, the sparsity regulariser L_g_reg of the dynamic-capacity variant.
    """

    selected_mask: Optional[torch.Tensor] = None
    student_logits: Optional[torch.Tensor] = None
    teacher_mask: Optional[torch.Tensor] = None
    student_mask: Optional[torch.Tensor] = None
    router_logits: Optional[torch.Tensor] = None
    d_st: Optional[torch.Tensor] = None
    d_ch: Optional[torch.Tensor] = None
    ce: Optional[torch.Tensor] = None
    cu: Optional[torch.Tensor] = None
    s_ce: Optional[torch.Tensor] = None
    s_cu: Optional[torch.Tensor] = None
    g: Optional[torch.Tensor] = None
    score: Optional[torch.Tensor] = None
    o_ce: Optional[torch.Tensor] = None
    m_cu: Optional[torch.Tensor] = None
    pred_loss: Optional[torch.Tensor] = None
    causal_loss: Optional[torch.Tensor] = None
    g_mean: Optional[torch.Tensor] = None

    @property
    def selected_fraction(self) -> torch.Tensor:
        return self.selected_mask.float().mean()


@dataclass
class RoutingContext:
    """
    Args:
        mode (str): ``"teacher"`` (training: non-causal teacher selection, auxiliary losses),
            ``"student"`` (inference: causal router decides, configured threshold/top-k), or ``"dense"``
            (every routed layer runs its whole block on every token, as the pretrained model did: the
            distillation teacher and the dense reference of analyses).
        beta_ce (Optional[float]): inverse temperature of CE for this step (teacher mode, SDT/STT).
        beta_cu (Optional[float]): inverse temperature of CU for this step (teacher mode, SDT/STT).
        apply_gate (bool): scale selected tokens' updates by the gate. Turning it off is an analysis
            switch (dense-equivalence checks, ablations), not a training setting.
        execute (str): teacher mode only: whose mask the routed pass runs. ``"teacher"`` (the papers),
            or ``"student"``: the causal router's own selection, as inference will run it (scheduled
            sampling, docs/design.md R2); the teacher still decides the targets of the auxiliary losses.
        capacity_progress (float): teacher mode only, the capacity curriculum: a routed layer of capacity
            γ keeps γ' = 1 − p·(1 − γ) of each sequence, from every token (p = 0) to γ (p = 1).
    """

    mode: str
    beta_ce: Optional[float] = None
    beta_cu: Optional[float] = None
    apply_gate: bool = True
    execute: str = "teacher"
    capacity_progress: float = 1.0
    layers: Dict[int, LayerRouting] = field(default_factory=dict)
    # SDT: residuals a Decision layer hands to the Dynamic layer that follows, keyed by the Dynamic
    # layer's index (kept for the whole forward so activation-checkpoint recomputation sees them too).
    decision_states: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # A per-layer view (:meth:`for_layer`): what one layer reads and leaves, without layer indices.
    layer_view: bool = False
    incoming_states: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    outgoing_states: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    layer_record: Optional[LayerRouting] = None
    # Position ids and sequence starts ``[b, s]`` of this forward's tokens, the same for every routed layer:
    # computed once by the decoder (:meth:`RoutedTransformerDecoder.forward`) instead of once per layer.
    # None: each layer computes its own (a layer called on its own, or a forward without routed layers).
    token_layout: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"Unknown routing mode {self.mode!r}; expected one of {ROUTING_MODES}")
        if self.execute not in EXECUTE_CHOICES:
            raise ValueError(f"Unknown execute {self.execute!r}; expected one of {EXECUTE_CHOICES}")
        if not 0.0 <= self.capacity_progress <= 1.0:
            raise ValueError(f"capacity_progress must be in [0, 1], got {self.capacity_progress!r}")

    # -- per-layer views: what a compiled layer sees ------------------------------------------------
    def for_layer(
        self,
        layer_idx: int,
        device: Optional[torch.device] = None,
        token_layout: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> "RoutingContext":
        """The context the decoder hands layer ``layer_idx``: the same mode, with β as 0-dim fp32 tensors on
        ``device`` and the Decision-layer states meant for this layer, but no layer indices and no shared
        containers. A layer compiled with ``torch.compile`` guards on every Python value it reads: a dict
        keyed by layer index, or a β that the schedule moves every step, would make a new graph per layer
        or per step. With a view every routed layer of a kind, at every step, runs the same graph;
        :meth:`absorb` files what the layer left under its index. ``token_layout``: the forward's position ids
        and sequence starts, for the layer to use instead of computing them (see the field)."""
        betas = {}
        if self.beta_ce is not None and not isinstance(self.beta_ce, torch.Tensor):
            betas["beta_ce"] = torch.tensor(float(self.beta_ce), dtype=torch.float32, device=device)
        if self.beta_cu is not None and not isinstance(self.beta_cu, torch.Tensor):
            betas["beta_cu"] = torch.tensor(float(self.beta_cu), dtype=torch.float32, device=device)
        return replace(
            self, layers={}, decision_states={}, layer_view=True,
            incoming_states=self.decision_states.get(layer_idx), outgoing_states=None, layer_record=None,
            token_layout=token_layout, **betas,
        )

    def absorb(self, layer_idx: int, view: "RoutingContext") -> None:
        """File what the :meth:`for_layer` view of layer ``layer_idx`` collected."""
        if view.layer_record is not None:
            self.layers[layer_idx] = view.layer_record
        if view.outgoing_states is not None:
            self.decision_states[layer_idx + 1] = view.outgoing_states

    def record_of(self, layer_idx: int) -> LayerRouting:
        """Layer ``layer_idx``'s record of this forward: from ``layers``, or, in that layer's own
        :meth:`for_layer` view (e.g. in a forward hook, before the decoder files it), the view's record."""
        if self.layer_view:
            return self.layer_record
        return self.layers[layer_idx]

    def file_record(self, layer, record: LayerRouting) -> None:
        """A routed layer leaves its record of this forward (keyed by ``layer.layer_idx``)."""
        if self.layer_view:
            self.layer_record = record
        else:
            self.layers[layer.layer_idx] = record

    def hand_to_next_layer(self, layer, states: Tuple[torch.Tensor, torch.Tensor]) -> None:
        """An SDT Decision layer hands (Δx, Δx̂) to the Dynamic layer after it."""
        if self.layer_view:
            self.outgoing_states = states
        else:
            self.decision_states[layer.layer_idx + 1] = states

    def states_from_previous_layer(self, layer) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """What the Decision layer before ``layer`` handed over in this forward, or None."""
        if self.layer_view:
            return self.incoming_states
        return self.decision_states.get(layer.layer_idx)

    def capacity(self, configured: float) -> float:
        """The teacher's capacity this forward for a layer configured with ``configured`` (curriculum)."""
        return 1.0 - self.capacity_progress * (1.0 - configured)

    def betas(self) -> Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]]:
        if self.beta_ce is None or self.beta_cu is None:
            raise ValueError(
                "Teacher routing of SDT/STT needs beta_ce and beta_cu for this step; pass "
                "RoutingContext(mode='teacher', beta_ce=..., beta_cu=...)"
            )
        return self.beta_ce, self.beta_cu
