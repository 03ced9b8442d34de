"""Component builders for routed Qwen2 decoders (dense, MoD, SDT, STT, and the baselines) and their LoRA twins.

Blocks are built exactly as torchtune's ``qwen2`` builds them, so every pretrained weight keeps its
dense key name; routed layers add only their routing modules (see ``ROUTING_MODULE_NAMES``).

:func:`routed_qwen2` and :func:`lora_routed_qwen2` take the architecture as flat keyword arguments, like
torchtune's ``qwen2``, because YAML configs (``configs/quickstart/*_smollm2.yaml``) list them one by one.
Both gather them into one :class:`Qwen2Architecture` first, which is where they are defined and documented.
"""

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable, Dict, List, Optional

from torch import nn
from torchtune.models.qwen2._component_builders import lora_qwen2_mlp, lora_qwen2_self_attention, qwen2_mlp
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import MultiHeadAttention, RMSNorm, TiedLinear, TransformerSelfAttentionLayer
from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_dtf.models.routing_config import RoutingSpec, validate_routing
from torchtune_dtf.modules.decoder import RoutedTransformerDecoder
from torchtune_dtf.modules.layers import (
    DroppedLayer,
    MoDLayer,
    RandomRoutedLayer,
    SDTDecisionLayer,
    SDTDynamicLayer,
    STTLayer,
)
from torchtune_dtf.modules.predictors import ResidualPredictor, SkipBias, SkipLinear, predictor_width
from torchtune_dtf.modules.routers import CausalRouter, MoDRouter
from torchtune_dtf.modules.surprise import PredictiveRouter


@dataclass(frozen=True)
class BuilderIdentity:
    """What a model builder builds, declared where the builder is defined (never parsed from its name): each
    builder carries it as its ``identity`` attribute (:mod:`torchtune_dtf.models.model_config` reads it).

    Args:
        variant (Optional[str]): the variant the builder builds; None for the component builders
            (:func:`routed_qwen2`, :func:`lora_routed_qwen2`), whose config gives it as ``variant``.
        size (Optional[str]): a key of ``QWEN2_5_SHAPES``; None for the component builders, whose config gives
            the architecture key by key.
        lora (bool): the builder adds LoRA adapters.
    """

    variant: Optional[str]
    size: Optional[str]
    lora: bool


@dataclass(frozen=True)
class Qwen2Architecture:
    """The shape of a Qwen2 decoder: the architecture arguments of torchtune's ``qwen2`` builder.

    These are the architecture keyword arguments of :func:`routed_qwen2` and :func:`lora_routed_qwen2`
    (``tests/test_builders.py`` checks that their signatures list exactly these fields), and the keys of
    ``QWEN2_5_SHAPES`` in the model builders.

    Args:
        vocab_size (int): number of token embeddings (rows of the embedding and output matrices).
        num_layers (int): number of decoder layers.
        num_heads (int): query heads; the head dimension is ``embed_dim // num_heads``.
        num_kv_heads (int): key/value heads (grouped-query attention when fewer than ``num_heads``).
        embed_dim (int): model width d.
        intermediate_dim (int): hidden width of the SwiGLU MLP.
        max_seq_len (int): longest sequence the model takes (length of the RoPE table and of a full KV cache).
        attn_dropout (float): attention dropout probability.
        norm_eps (float): RMSNorm epsilon.
        rope_base (float): RoPE base frequency.
        tie_word_embeddings (bool): the output projection is the token embedding matrix (``TiedLinear``).
    """

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int
    attn_dropout: float
    norm_eps: float
    rope_base: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


#: Names of the architecture arguments, in signature order.
ARCHITECTURE_KEYS = tuple(f.name for f in fields(Qwen2Architecture))


def qwen2_self_attention(arch: Qwen2Architecture, rope: nn.Module) -> MultiHeadAttention:
    """Qwen2 attention block exactly as in ``torchtune.models.qwen2.qwen2`` (q/k/v biases, no o bias)."""
    head_dim = arch.head_dim
    return MultiHeadAttention(
        embed_dim=arch.embed_dim,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=head_dim,
        q_proj=nn.Linear(arch.embed_dim, arch.num_heads * head_dim, bias=True),
        k_proj=nn.Linear(arch.embed_dim, arch.num_kv_heads * head_dim, bias=True),
        v_proj=nn.Linear(arch.embed_dim, arch.num_kv_heads * head_dim, bias=True),
        output_proj=nn.Linear(arch.embed_dim, arch.embed_dim, bias=False),
        pos_embeddings=rope,
        kv_cache=None,
        max_seq_len=arch.max_seq_len,
        attn_dropout=arch.attn_dropout,
    )


def causal_router(spec: RoutingSpec, embed_dim: int, norm_eps: float) -> CausalRouter:
    """The student router of one routed layer."""
    return CausalRouter(
        embed_dim=embed_dim,
        hidden_dim=spec.causal_router_hidden_dim,
        use_previous_token=spec.causal_router_input == "current_previous",
        norm_eps=norm_eps,
        init_std=spec.routing_init_std,
    )


def residual_predictor(spec: RoutingSpec, embed_dim: int, norm_eps: float) -> ResidualPredictor:
    """PriorFFN (SDT) or TPN (STT) of width max(2, ceil(f·d)) rounded to even (docs/design.md §3.3)."""
    return ResidualPredictor(
        embed_dim=embed_dim,
        hidden_dim=predictor_width(spec.prior_factor, embed_dim),
        norm_eps=norm_eps,
        init_std=spec.routing_init_std,
    )


def predictive_router(spec: RoutingSpec) -> PredictiveRouter:
    return PredictiveRouter(o_ce_init=spec.o_ce_init, m_cu_init=spec.m_cu_init, ma_window=spec.ma_window)


def _routed_decoder(
    variant: str,
    arch: Qwen2Architecture,
    routing: Dict[str, Any],
    *,
    make_attn: Callable[[], MultiHeadAttention],
    make_mlp: Callable[[], nn.Module],
) -> RoutedTransformerDecoder:
    """Validate ``routing`` for ``variant`` and assemble the decoder; ``make_attn``/``make_mlp`` build one
    block's attention and MLP (plain or LoRA), the only difference between the two public builders."""
    spec = validate_routing(variant, arch.num_layers, **routing)
    embed_dim, norm_eps = arch.embed_dim, arch.norm_eps
    capacity_of = dict(zip(spec.routed_layers, spec.capacity))
    decision_layers = {i - 1 for i in spec.routed_layers} if spec.variant == "sdt" else set()
    layers = nn.ModuleList()
    for i in range(arch.num_layers):
        block = dict(
            attn=make_attn(),
            mlp=make_mlp(),
            sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
        )
        if i in spec.dropped_layers:
            # skip_update "bias" / "linear": the tokens a dropped layer never runs get its learned constant
            # update / affine map of their input, as the tokens a routed layer skips do (so layer dropping is
            # compared with the same help).
            layer = DroppedLayer(
                **block,
                skip_bias=SkipBias(embed_dim) if spec.skip_update == "bias" else None,
                skip_linear=SkipLinear(embed_dim, norm_eps) if spec.skip_update == "linear" else None,
            )
        elif i in capacity_of and spec.variant == "random":
            layer = RandomRoutedLayer(
                **block,
                layer_idx=i,
                capacity=capacity_of[i],
                always_run_first_token=spec.always_run_first_token,
                skipped_tokens_write_kv=spec.skipped_tokens_write_kv,
                skip_update=spec.skip_update,
            )
        elif i in capacity_of:
            routed = dict(
                layer_idx=i,
                capacity=capacity_of[i],
                causal_router=causal_router(spec, embed_dim, norm_eps),
                student_routing_mode=spec.student_routing_mode,
                student_threshold=spec.student_threshold,
                student_window=spec.student_window,
                gate=spec.gate,
                always_run_first_token=spec.always_run_first_token,
                allow_noncausal_student_topk=spec.allow_noncausal_student_topk,
                skipped_tokens_write_kv=spec.skipped_tokens_write_kv,
                skip_update=spec.skip_update,
            )
            if spec.variant == "mod":
                layer = MoDLayer(**block, **routed, mod_router=MoDRouter(embed_dim, spec.routing_init_std))
            else:
                surprise = dict(
                    predictive_router=predictive_router(spec),
                    teacher_selection=spec.teacher_selection,
                    gate_threshold=spec.gate_threshold,
                )
                if spec.variant == "stt":
                    layer = STTLayer(**block, **routed, **surprise, transition=residual_predictor(spec, embed_dim, norm_eps))
                else:
                    layer = SDTDynamicLayer(**block, **routed, **surprise)
        elif i in decision_layers:
            layer = SDTDecisionLayer(**block, layer_idx=i, prior_ffn=residual_predictor(spec, embed_dim, norm_eps))
        else:
            layer = TransformerSelfAttentionLayer(**block)
        layers.append(layer)

    tok_embeddings = nn.Embedding(arch.vocab_size, embed_dim)
    output = TiedLinear(tok_embeddings) if arch.tie_word_embeddings else nn.Linear(embed_dim, arch.vocab_size, bias=False)
    return RoutedTransformerDecoder(
        variant=spec.variant,
        routing_layer_indices=sorted(set(spec.routed_layers) | decision_layers),
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=arch.max_seq_len,
        num_heads=arch.num_heads,
        head_dim=arch.head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


def routed_qwen2(
    variant: str,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    tie_word_embeddings: bool,
    **routing: Any,
) -> RoutedTransformerDecoder:
    """Qwen2 decoder of the given variant (``dense``, ``layerdrop``, ``random``, ``mod``, ``sdt``, ``stt``).

    With ``variant="dense"`` and no routing arguments it is torchtune's ``qwen2`` (same modules, same
    keys), run through the same decoder class so every comparison shares one code path.

    This docstring is where the routing arguments are documented; the model builders
    (``stt_qwen2_5_0_5b``…) take the same ones and refer here. Every one the variant uses is required
    (no defaults in code; see :mod:`torchtune_dtf.models.routing_config`), and
    :mod:`torchtune_dtf.models.routing_presets` has the complete sets of the shipped configs.

    Args:
        variant (str): model family.
        vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, intermediate_dim, max_seq_len,
            attn_dropout, norm_eps, rope_base, tie_word_embeddings: the architecture, as torchtune's
            ``qwen2``; see :class:`Qwen2Architecture`.
        **routing: the routing arguments of ``variant``, listed below.

    Routing arguments of every routed variant (``mod``, ``sdt``, ``stt``):
        routed_layers (Union[str, List[int]]): the layers that route: ``"every_other"`` (1, 3, 5, …; the
            papers' placement, which routes the last layer when the number of layers is even),
            ``"every_other_inner"`` (the same without the last layer) or a list of layer indices. SDT needs
            a non-routed layer before each routed one (its Decision layer).
        capacity (Union[float, List[float]]): γ ∈ (0, 1], the share of each sequence a routed layer runs
            (the teacher's top-⌊γ·n⌋ of n tokens); one value, or one per routed layer in the order
            ``routed_layers`` lists them.
        student_routing_mode (str): how the causal router (the student) selects at inference:
            ``"threshold"`` (σ(r̃) > τ, token by token), ``"topk"`` (per-sequence top-k on a cached
            prefill, the top ⌊γ·b⌋ rows per decoding step) or ``"window_topk"`` (token by token: r̃ in
            the top γ of the sequence's last ``student_window`` scores; follows a shift of the scores, as on
            generated text).
        student_threshold (Optional[float]): τ ∈ [0, 1) for ``threshold`` mode (unused otherwise: ``None``).
        student_window (Optional[int]): w ≥ 2 tokens for ``window_topk`` mode (unused otherwise: ``None``).
        causal_router_input (str): ``"current"`` (the router reads RMSNorm(x_t), d features) or
            ``"current_previous"`` ([RMSNorm(x_t) ‖ RMSNorm(x_{t−1})], 2d features).
        causal_router_hidden_dim (int): hidden width of the causal router.
        routing_init_std (float): std of the normal initialisation of the routing modules' linear layers.
        gate (str): ``"scaled"`` (the papers: training scales a selected token's update by the gate, g for
            SDT/STT or σ(r) for MoD; SDT/STT apply 1 at inference) or ``"straight_through"`` (forward value 1
            in training and inference, gradient through the gate).
        always_run_first_token (bool): the first token of every sequence runs every routed layer (counted
            in the capacity).
        allow_noncausal_student_topk (bool): allow the student's whole-sequence top-k without a cache,
            which is not causal (for an explicit analysis; ``False`` in every shipped config).
        skipped_tokens_write_kv (bool): skipped tokens still write K/V, so selected tokens attend over the
            whole context (the layer then saves no KV cache).
        skip_update (str): what a skipped token receives: ``"none"`` (it passes unchanged),
            ``"predicted"`` (STT only: its transition network's forecast of the block's update), ``"bias"``
            (a learned constant update per layer, :class:`~torchtune_dtf.modules.SkipBias`) or ``"linear"``
            (a learned affine map of the token's input per layer, :class:`~torchtune_dtf.modules.SkipLinear`).
        dropped_layers (Union[str, List[int]]): layers that run on no token, as ``layerdrop``'s (``[]``: none);
            disjoint from ``routed_layers`` and, for SDT, from the Decision layers. A dropped layer costs no
            router and no K/V projection, so a budget can drop the layers no token needs and route the
            marginal ones. ``RoutingContext(mode="dense")`` runs the routed layers on every token; dropped
            layers stay dropped (the distillation teacher, built without routing keys, runs them).

    Routing arguments of SDT and STT only:
        prior_factor (float): f ∈ (0, 1]; the PriorFFN (SDT) or transition network (STT) has hidden width
            max(2, ⌈f·d⌉) rounded up to even.
        ma_window (int): tokens in the causal moving average of the static surprise D_st.
        o_ce_init (float): initial (learnable, > 0) o_ce of the expected-event criterion
            CE = D_st − (D_ch − log o_ce).
        m_cu_init (float): initial (learnable, > 0) m_cu of the unexpected-event criterion
            CU = D_st − m_cu·MA(D_st).
        teacher_selection (str): ``"topk"`` (the top-⌊γ·n⌋ of the gate g) or ``"threshold"`` (g ≥ g_th:
            dynamic capacity).
        gate_threshold (Optional[float]): g_th ∈ (0, 1) for ``threshold`` selection (unused by ``topk``: ``None``).

    Routing arguments of the baselines:
        ``layerdrop``: ``dropped_layers`` (Union[str, List[int]], a placement as ``routed_layers``): layers
            that run on no token (their weights stay); ``skip_update``: ``"none"``, ``"bias"`` or ``"linear"``
            (every token receives each dropped layer's learned constant update, or affine map of its input).
        ``random``: ``routed_layers``, ``capacity``, ``always_run_first_token``, ``skipped_tokens_write_kv``,
            ``skip_update`` (``"none"``, ``"bias"`` or ``"linear"``), ``dropped_layers`` as above; training runs a random
            per-sequence top-⌊γ·n⌋, inference a causal Bernoulli(γ).

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.

    Raises:
        ValueError: listing every missing, unknown or invalid routing argument.
    """
    arch = Qwen2Architecture(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len, attn_dropout=attn_dropout,
        norm_eps=norm_eps, rope_base=rope_base, tie_word_embeddings=tie_word_embeddings,
    )
    # One RoPE module shared by every layer, as torchtune's qwen2 does.
    rope = Qwen2RotaryPositionalEmbeddings(dim=arch.head_dim, max_seq_len=arch.max_seq_len, base=arch.rope_base)
    return _routed_decoder(
        variant,
        arch,
        routing,
        make_attn=partial(qwen2_self_attention, arch, rope),
        make_mlp=partial(qwen2_mlp, dim=arch.embed_dim, hidden_dim=arch.intermediate_dim),
    )


def lora_routed_qwen2(
    variant: str,
    lora_attn_modules: List[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool,
    *,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    tie_word_embeddings: bool,
    **routing: Any,
) -> RoutedTransformerDecoder:
    """LoRA twin of :func:`routed_qwen2`: the base is frozen by the recipe, LoRA sits on the chosen
    projections of every block (routed ones included), and every routing module reports all of its
    parameters through ``adapter_params()``, so torchtune's ``get_adapter_params`` trains them fully.

    Args:
        variant (str): model family.
        lora_attn_modules (List[str]): attention projections with LoRA (``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``).
        apply_lora_to_mlp (bool): LoRA on the MLP projections too.
        lora_rank (int): rank of each low-rank update.
        lora_alpha (float): LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``).
        lora_dropout (float): dropout on the LoRA input.
        vocab_size, …, tie_word_embeddings: the architecture; see :class:`Qwen2Architecture`.
        **routing: the routing arguments of ``variant``; see :func:`routed_qwen2`.

    Returns:
        RoutedTransformerDecoder: tokens ``[b, s]`` → logits ``[b, s, vocab_size]``.
    """
    arch = Qwen2Architecture(
        vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len, attn_dropout=attn_dropout,
        norm_eps=norm_eps, rope_base=rope_base, tie_word_embeddings=tie_word_embeddings,
    )
    lora = dict(lora_rank=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout)
    # torchtune's LoRA attention builds its own RoPE module per layer (lora_qwen2 does the same).
    make_attn = partial(
        lora_qwen2_self_attention,
        lora_attn_modules,
        embed_dim=arch.embed_dim,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        max_seq_len=arch.max_seq_len,
        attn_dropout=arch.attn_dropout,
        rope_base=arch.rope_base,
        **lora,
    )
    if apply_lora_to_mlp:
        make_mlp = partial(lora_qwen2_mlp, dim=arch.embed_dim, hidden_dim=arch.intermediate_dim, **lora)
    else:
        make_mlp = partial(qwen2_mlp, dim=arch.embed_dim, hidden_dim=arch.intermediate_dim)
    return _routed_decoder(variant, arch, routing, make_attn=make_attn, make_mlp=make_mlp)


routed_qwen2.identity = BuilderIdentity(variant=None, size=None, lora=False)
lora_routed_qwen2.identity = BuilderIdentity(variant=None, size=None, lora=True)
