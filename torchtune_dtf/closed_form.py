"""Closed-form FLOP and byte counts of dense and routed Qwen2 decoders (no torch needed).

Conventions (the same ones ``torch.utils.flop_counter.FlopCounterMode`` uses, so measured and closed-form
numbers are comparable term by term):

* FLOPs are matmul FLOPs only, 2 per multiply-add. Biases, norms, RoPE, softmax, gathers and scatters count 0.
* Linear work of one block per token: q and o are d × (n_h·h_d), k and v are d × (n_kv·h_d), the SwiGLU MLP is
  three d × d_ff matrices: ``2·d·(2·n_h·h_d + 2·n_kv·h_d) + 6·d·d_ff``.
* Attention of n_q queries over n_k keys: ``4·n_h·h_d·n_q·n_k`` (scores and weighted values, every query head).
  This is the full rectangle, which is what FlopCounterMode counts for SDPA even with ``is_causal`` (and what
  the CPU kernel computes when an explicit mask is passed; routed layers attend through a mask in chunks of
  queries, each over the prefix of keys it can see, so they compute less than this: ``attention_work.py``). With ``is_causal`` the CPU flash kernel
  skips the blocks above the diagonal, so the work it *does* is about half; the routed/dense attention ratio
  is the same either way, (1 + γ²)/2 with half the layers routed, because both sides halve.
* LM head: ``2·d·V`` per token (tied embedding in the 0.5B–3B shapes; the embedding lookup itself is free).
* Routers: the causal (student) router is RMSNorm → Linear(c·d → h) → SiLU → Linear(h → 1), c = 2 with the
  previous-token input; the MoD router is Linear(d → 1) and, in student mode, also gives the gate σ(r), so it
  runs on every token at inference too; PriorFFN/TPN are SwiGLU d → d_p → d (teacher/training only).
* Training (forward + backward): every matmul that carries gradient costs 3× its forward (dgrad + wgrad),
  except the causal router's first layer, 2× (wgrad only: it reads detached layer inputs, with the RMSNorm
  scale folded into its weight, so no input gradient exists);
  attention costs 3.5× (torch's SDPA backward formula counts 5 bmm-equivalents against the forward's 2: the
  flash backward recomputes the scores); STT's dense teacher pass of each routed block runs without
  gradient and costs 1× a dense block forward.
* Bytes (decode): a step reads the weights of every block that runs (once per batch, whatever the number of
  rows that run it), the LM head (= the tied embedding matrix), the routers of every routed layer, and every
  KV entry each running row attends to. Activations are ignored (tiny at decode).

Variants and technique options (model config keys; an absent key means the behaviour of today's configs):

* ``dense``: every layer runs every token. ``layerdrop`` with ``dropped_layers: [i, ...]``: those layers run
  on no token (0 FLOPs, no K/V, no weights read). ``random``: routed layers like MoD but no router of any kind
  (0 router FLOPs).
* ``skipped_tokens_write_kv: True`` (mod, sdt, stt, random): a skipped token still computes its k and v
  projections (``2·d·(2·n_kv·h_d)``, counted in ``block_linear``) and writes K/V; the selected queries attend
  over all n tokens (``f·n × n``) instead of the selected ones only (``f·n × f·n``); the layer's KV bytes are
  then the dense layer's.
* ``skip_update: predicted`` (stt: the TPN's forecast; sdt: the PriorFFN's prior): at inference each skipped
  token also runs the predictor, ``6·d·d_p`` FLOPs, counted in ``routers`` (where FlopCounterMode's split puts
  the predictor modules). In training (teacher mode) the predictor already runs on every token.
* ``skip_update: bias``: each skipped token adds the layer's learned d-vector, an elementwise add like the
  residual adds (not counted as FLOPs); its d parameters per layer are read at inference.
* ``skip_update: linear``: each skipped token (every token, at a dropped layer) runs the layer's affine map of its
  normalised input, ``2·d²`` FLOPs (the matmul; normalisation and bias add are elementwise), counted in
  ``routers``; its ``d² + d`` parameters per layer are read at inference.
* The causal (student) router runs on every token of every routed layer of mod/sdt/stt; MoD's linear router
  runs at inference only when its gate is ``scaled`` (it gives σ(r)); in training it always runs.
* Recipe key ``distillation: {weight, temperature}`` with weight > 0 adds a frozen dense teacher forward per
  training token (:func:`distillation_teacher_flops_per_token`), reported apart from the deployed forward.
"""

from dataclasses import dataclass, field, fields
from typing import Dict, Mapping, Optional, Tuple

@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Qwen2 decoder that FLOPs and KV bytes depend on: a subset of
    ``torchtune_dtf.models.qwen2_5.Qwen2Architecture`` (build one with :meth:`from_architecture`); this module
    does not import torch."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    tie_word_embeddings: bool = True

    @classmethod
    def from_architecture(cls, architecture: Mapping) -> "ModelShape":
        """The numbers FLOPs depend on, read from any mapping with ``Qwen2Architecture``'s keys (a model
        config section, ``QWEN2_5_SHAPES[size]``); extra keys are ignored."""
        tied = architecture.get("tie_word_embeddings", True)
        counts = {f.name: int(architecture[f.name]) for f in fields(cls) if f.name != "tie_word_embeddings"}
        return cls(**counts, tie_word_embeddings=bool(tied))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    # ---- FLOPs -------------------------------------------------------------------------------
    @property
    def block_linear_flops_per_token(self) -> int:
        d, hd = self.embed_dim, self.head_dim
        return 2 * d * (2 * self.num_heads * hd + 2 * self.num_kv_heads * hd) + 6 * d * self.intermediate_dim

    def attention_flops(self, n_queries: int, n_keys: int) -> int:
        return 4 * self.num_heads * self.head_dim * n_queries * n_keys

    @property
    def lm_head_flops_per_token(self) -> int:
        return 2 * self.embed_dim * self.vocab_size

    # ---- parameters / bytes --------------------------------------------------------------------
    @property
    def block_params(self) -> int:
        d, hd = self.embed_dim, self.head_dim
        q = d * self.num_heads * hd + self.num_heads * hd
        kv = 2 * (d * self.num_kv_heads * hd + self.num_kv_heads * hd)
        o = self.num_heads * hd * d
        mlp = 3 * d * self.intermediate_dim
        return q + kv + o + mlp + 2 * d

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.embed_dim

    @property
    def lm_head_params(self) -> int:
        """Parameters read by the LM head at each decode step (the tied embedding, or the output matrix)."""
        return self.vocab_size * self.embed_dim

    @property
    def total_params(self) -> int:
        untied = 0 if self.tie_word_embeddings else self.vocab_size * self.embed_dim
        return self.num_layers * self.block_params + self.embedding_params + untied + self.embed_dim

    @property
    def kv_values_per_token(self) -> int:
        """K and V values stored per token per layer (all KV heads)."""
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class RoutingShape:
    """What a routed variant adds: which layers are routed, at which capacity, and the routers' sizes."""

    variant: str  # dense | mod | sdt | stt | random | layerdrop
    routed_layers: Tuple[int, ...] = ()
    capacity: Tuple[float, ...] = ()
    router_hidden: int = 0  # 0: no causal router (dense, layerdrop, random)
    router_inputs: int = 1  # 2 with causal_router_input="current_previous"
    predictor_width: int = 0  # PriorFFN/TPN width d_p (SDT/STT)
    dropped_layers: Tuple[int, ...] = ()  # layerdrop: layers that run on no token
    skipped_tokens_write_kv: bool = False  # skipped tokens still project and write K/V; queries see every token
    # "none" | "predicted" (the TPN/PriorFFN forecast) | "bias" (a learned d-vector) | "linear" (W·rms(x) + b)
    skip_update: str = "none"
    mod_router_at_inference: bool = True  # MoD: the router runs in student mode (gate "scaled")

    @classmethod
    def dense(cls) -> "RoutingShape":
        return cls(variant="dense")

    @property
    def has_causal_router(self) -> bool:
        return self.variant in ("mod", "sdt", "stt") and self.router_hidden > 0

    def gamma_of(self) -> Dict[int, float]:
        return dict(zip(self.routed_layers, self.capacity))

    def decision_layers(self) -> Tuple[int, ...]:
        return tuple(i - 1 for i in self.routed_layers) if self.variant == "sdt" else ()

    # ---- router sizes ----------------------------------------------------------------------------
    def causal_router_input_flops_per_token(self, shape: ModelShape) -> int:
        """The causal router's first layer, Linear(c·d → h)."""
        if not self.has_causal_router:
            return 0
        return 2 * self.router_inputs * shape.embed_dim * self.router_hidden

    def causal_router_flops_per_token(self, shape: ModelShape) -> int:
        if not self.has_causal_router:
            return 0
        return self.causal_router_input_flops_per_token(shape) + 2 * self.router_hidden

    def mod_router_flops_per_token(self, shape: ModelShape, mode: str = "student") -> int:
        """MoD's Linear(d → 1): always in training; at inference only when it gives the gate (``scaled``)."""
        if self.variant != "mod" or (mode == "student" and not self.mod_router_at_inference):
            return 0
        return 2 * shape.embed_dim

    def predictor_flops_per_token(self, shape: ModelShape) -> int:
        return 6 * shape.embed_dim * self.predictor_width

    def router_params_per_layer(self, shape: ModelShape) -> int:
        """Parameters of the routers a routed layer reads at inference (causal router, MoD router, and the
        TPN/PriorFFN with ``skip_update: predicted``, the skip bias or linear map with ``skip_update: bias`` /
        ``linear``)."""
        d, h = shape.embed_dim, self.router_hidden
        causal = d + self.router_inputs * d * h + h + h + 1 if self.has_causal_router else 0
        mod = d if self.variant == "mod" and self.mod_router_at_inference else 0
        predictor = self.predictor_params(shape) if self.predicts_skipped else 0
        return causal + mod + self.skip_update_params(shape) + predictor

    def skip_update_params(self, shape: ModelShape) -> int:
        """Parameters of one layer's skip bias (d) or skip linear map (d² + d); 0 for the other skip updates."""
        d = shape.embed_dim
        return {"bias": d, "linear": d * d + d}.get(self.skip_update, 0)

    def skip_map_flops_per_token(self, shape: ModelShape) -> int:
        """The skip linear map's matmul per token it serves (``skip_update: linear``): 2·d²; else 0."""
        return 2 * shape.embed_dim * shape.embed_dim if self.skip_update == "linear" else 0

    @property
    def predicts_skipped(self) -> bool:
        """Skipped tokens receive the predictor's forecast at inference (``skip_update: predicted``)."""
        return self.skip_update == "predicted" and self.variant in ("sdt", "stt") and self.predictor_width > 0

    def predictor_params(self, shape: ModelShape) -> int:
        return shape.embed_dim + 3 * shape.embed_dim * self.predictor_width  # RMSNorm + SwiGLU (no biases)

    def kv_projection_flops_per_token(self, shape: ModelShape) -> int:
        """k and v projections of one token: 2·d·(2·n_kv·h_d)."""
        return 2 * shape.embed_dim * 2 * shape.num_kv_heads * shape.head_dim


def num_selected(gamma: float, seq_len: int) -> int:
    """k = floor(γ·T), as the routed layers compute it."""
    import math

    return int(math.floor(gamma * seq_len))


def forward_flops(
    shape: ModelShape,
    routing: RoutingShape,
    seq_len: int,
    *,
    batch: int = 1,
    mode: str = "student",
    selected: Optional[Dict[int, int]] = None,
) -> Dict[str, int]:
    """FLOPs of one forward over ``batch`` rows of ``seq_len`` tokens, by category.

    Args:
        shape: architecture.
        routing: routed layers and routers (``RoutingShape.dense()`` for the dense model).
        seq_len: T.
        batch: b.
        mode: ``"student"`` (inference: causal router, top-k/threshold) or ``"teacher"`` (training forward;
            adds MoD router / PriorFFN / TPN, and STT's dense teacher pass in ``teacher_pass``).
        selected: tokens per row that run each routed layer (default floor(γ·T)); for a ragged threshold
            selection pass the padded count (the executor pads rows to the largest count), or the measured
            executed fraction × T (a float) for the ideal count of a measured selection.

    Returns:
        Dict with ``block_linear``, ``attention``, ``lm_head``, ``routers``, ``teacher_pass`` (no-grad FLOPs,
        STT teacher only) and ``total``; each already multiplied by ``batch``.
    """
    T = seq_len
    gammas = routing.gamma_of()
    selected = dict(selected or {})
    dropped = set(routing.dropped_layers)
    out = dict(block_linear=0, attention=0, lm_head=0, routers=0, teacher_pass=0)
    for layer in range(shape.num_layers):
        if layer in dropped:  # the layer runs on no token; its skip linear map (if any) on every token
            out["routers"] += T * routing.skip_map_flops_per_token(shape)
            continue
        if layer in gammas:
            k = selected.get(layer, num_selected(gammas[layer], T))
            out["routers"] += (T - k) * routing.skip_map_flops_per_token(shape)
            out["block_linear"] += k * shape.block_linear_flops_per_token
            if routing.skipped_tokens_write_kv:
                # Skipped tokens still project k, v (and write them); selected queries attend over every token.
                out["block_linear"] += (T - k) * routing.kv_projection_flops_per_token(shape)
                out["attention"] += shape.attention_flops(k, T)
            else:
                out["attention"] += shape.attention_flops(k, k)
            out["routers"] += T * routing.causal_router_flops_per_token(shape)
            out["routers"] += T * routing.mod_router_flops_per_token(shape, mode)
            if mode == "student" and routing.predicts_skipped:
                out["routers"] += (T - k) * routing.predictor_flops_per_token(shape)
            if mode == "teacher" and routing.variant == "stt":
                out["teacher_pass"] += T * shape.block_linear_flops_per_token + shape.attention_flops(T, T)
                out["routers"] += T * routing.predictor_flops_per_token(shape)
        else:
            out["block_linear"] += T * shape.block_linear_flops_per_token
            out["attention"] += shape.attention_flops(T, T)
            if mode == "teacher" and layer in routing.decision_layers():
                out["routers"] += T * routing.predictor_flops_per_token(shape)
    out["lm_head"] = T * shape.lm_head_flops_per_token
    out = {key: value * batch for key, value in out.items()}
    out["total"] = sum(out.values())
    return out


def train_flops(shape: ModelShape, routing: RoutingShape, seq_len: int, *, batch: int = 1) -> Dict[str, int]:
    """Forward + backward FLOPs of one training micro-step (teacher mode for routed variants).

    Matmuls with gradient cost 3× their forward (the causal router's first layer 2×: no input gradient),
    attention 3.5× (SDPA backward = 2.5× forward in torch's count); STT's no-grad dense teacher pass costs 1×.
    """
    fwd = forward_flops(shape, routing, seq_len, batch=batch, mode="teacher" if routing.variant != "dense" else "student")
    out = {key: 3 * value for key, value in fwd.items() if key not in ("total", "teacher_pass", "attention")}
    # The causal router's first layer has no input gradient (detached inputs): 2× instead of 3×.
    out["routers"] -= batch * seq_len * len(routing.gamma_of()) * routing.causal_router_input_flops_per_token(shape)
    out["attention"] = int(3.5 * fwd["attention"])
    out["teacher_pass"] = fwd["teacher_pass"]
    out["total"] = sum(out.values())
    return out


def flop_ratio(
    shape: ModelShape, routing: RoutingShape, seq_len: int, *, training: bool = False, include_routers: bool = True
) -> float:
    fn = train_flops if training else forward_flops
    routed = fn(shape, routing, seq_len)
    dense = fn(shape, RoutingShape.dense(), seq_len)
    num = routed["total"] - (0 if include_routers else routed["routers"])
    return num / dense["total"]


def category_ratios(shape: ModelShape, routing: RoutingShape, seq_len: int) -> Dict[str, float]:
    """Routed/dense ratio of each forward category (decoder linear, attention, whole model, whole model with
    routers) and the routers' share of the dense total."""
    r = forward_flops(shape, routing, seq_len)
    d = forward_flops(shape, RoutingShape.dense(), seq_len)
    return {
        "block_linear": r["block_linear"] / d["block_linear"],
        "attention": r["attention"] / d["attention"],
        "total_ideal": (r["total"] - r["routers"]) / d["total"],
        "total": r["total"] / d["total"],
        "routers_share": r["routers"] / d["total"],
    }


# ---- decode bytes ----------------------------------------------------------------------------------


@dataclass
class DecodeStepTraffic:
    """Bytes one decode step reads, split by source (see :func:`decode_step_bytes`)."""

    block_weights: float = 0.0
    kv: float = 0.0
    lm_head: float = 0.0
    routers: float = 0.0
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.block_weights + self.kv + self.lm_head + self.routers


def decode_step_bytes(
    shape: ModelShape,
    routing: RoutingShape,
    *,
    bytes_per_value: int,
    batch: int,
    context: float,
    runs: Optional[Dict[int, float]] = None,
    kv_entries: Optional[Dict[int, float]] = None,
) -> DecodeStepTraffic:
    """Bytes read by one decode step.

    Args:
        shape, routing: the model.
        bytes_per_value: 4 for fp32, 2 for bf16.
        batch: rows decoded together.
        context: entries attended per row in a standard layer (cache length).
        runs: per routed layer, the probability (or measured fraction of steps) that at least one row runs
            the block, i.e. that its weights are read. Default: 1 − (1 − γ)^b.
        kv_entries: per routed layer, KV entries read per step summed over rows. Default: b·γ·(γ·context)
            (each running row reads its own cache of about γ·context entries).
    """
    gammas = routing.gamma_of()
    runs = dict(runs or {})
    kv_entries = dict(kv_entries or {})
    bpv = bytes_per_value
    traffic = DecodeStepTraffic()
    for layer in range(shape.num_layers):
        if layer in routing.dropped_layers:
            traffic.routers += routing.skip_update_params(shape) * bpv  # its skip bias or linear map, if any
            continue
        if layer in gammas:
            g = gammas[layer]
            p_run = runs.get(layer, 1.0 - (1.0 - g) ** batch)
            # With skipped_tokens_write_kv the cache holds every token: a running row reads all of them.
            held = context if routing.skipped_tokens_write_kv else g * context
            entries = kv_entries.get(layer, batch * g * held)
            traffic.block_weights += p_run * shape.block_params * bpv
            traffic.kv += entries * shape.kv_values_per_token * bpv
            traffic.routers += routing.router_params_per_layer(shape) * bpv
        else:
            traffic.block_weights += shape.block_params * bpv
            traffic.kv += batch * context * shape.kv_values_per_token * bpv
    traffic.lm_head = (shape.lm_head_params + shape.embed_dim) * bpv
    return traffic


def decode_bytes_ratio(
    shape: ModelShape, routing: RoutingShape, *, bytes_per_value: int, batch: int, context: float, **measured
) -> Dict[str, float]:
    """Routed/dense ratio of decode-step bytes, with and without the routers' own weights."""
    dense = decode_step_bytes(shape, RoutingShape.dense(), bytes_per_value=bytes_per_value, batch=batch, context=context)
    routed = decode_step_bytes(shape, routing, bytes_per_value=bytes_per_value, batch=batch, context=context, **measured)
    return {
        "ratio": routed.total / dense.total,
        "ratio_ideal": (routed.total - routed.routers) / dense.total,
        "routers_share": routed.routers / dense.total,
        "dense_bytes": dense.total,
        "routed_bytes": routed.total,
    }


def decode_step_flops(
    shape: ModelShape,
    routing: RoutingShape,
    *,
    batch: int,
    context: float,
    rows: Optional[Dict[int, float]] = None,
    kv_entries: Optional[Dict[int, float]] = None,
) -> float:
    """Matmul FLOPs of one decode step: standard layers run every row over ``context`` keys; routed layer l
    runs ``rows[l]`` rows (default b·γ) over ``kv_entries[l]`` keys in total (default b·γ·γ·context); the
    LM head and the routers run every row."""
    gammas = routing.gamma_of()
    rows = dict(rows or {})
    kv_entries = dict(kv_entries or {})
    attn_per_key = 4 * shape.num_heads * shape.head_dim
    total = 0.0
    for layer in range(shape.num_layers):
        if layer in routing.dropped_layers:
            total += batch * routing.skip_map_flops_per_token(shape)
            continue
        if layer in gammas:
            g = gammas[layer]
            running = rows.get(layer, batch * g)
            held = context if routing.skipped_tokens_write_kv else g * context
            total += running * shape.block_linear_flops_per_token
            total += attn_per_key * kv_entries.get(layer, batch * g * held)
            total += batch * (routing.causal_router_flops_per_token(shape) + routing.mod_router_flops_per_token(shape))
            if routing.skipped_tokens_write_kv:
                total += (batch - running) * routing.kv_projection_flops_per_token(shape)
            if routing.predicts_skipped:
                total += (batch - running) * routing.predictor_flops_per_token(shape)
            total += (batch - running) * routing.skip_map_flops_per_token(shape)
        else:
            total += batch * (shape.block_linear_flops_per_token + attn_per_key * context)
    return total + batch * shape.lm_head_flops_per_token


def kv_stored_fraction(shape: ModelShape, routing: RoutingShape, executed_fraction: Dict[int, float]) -> Dict[int, float]:
    """Share of the tokens whose K/V each layer keeps: 1 for a standard layer, 0 for a dropped one, γ̄_l for a
    routed one (1 with ``skipped_tokens_write_kv``)."""
    stored = {}
    for layer in range(shape.num_layers):
        if layer in routing.dropped_layers:
            stored[layer] = 0.0
        elif layer in routing.routed_layers and not routing.skipped_tokens_write_kv:
            stored[layer] = float(executed_fraction.get(layer, 1.0))
        else:
            stored[layer] = 1.0
    return stored


def kv_cache_ratio(shape: ModelShape, routing: RoutingShape, executed_fraction: Dict[int, float]) -> float:
    """Whole-model KV bytes routed/dense when routed layer l holds γ̄_l of the tokens: with half the layers
    routed at a common γ̄ this is (1 + γ̄)/2."""
    return sum(kv_stored_fraction(shape, routing, executed_fraction).values()) / shape.num_layers


def kv_bytes_per_token(shape: ModelShape, routing: RoutingShape, executed_fraction: Dict[int, float], *,
                       bytes_per_value: int) -> float:
    """KV-cache bytes per token of context, all layers (K and V of every KV head)."""
    stored = sum(kv_stored_fraction(shape, routing, executed_fraction).values())
    return stored * shape.kv_values_per_token * bytes_per_value


def distillation_teacher_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """A frozen dense teacher's forward per training token (recipe ``distillation`` with weight > 0)."""
    return forward_flops(shape, RoutingShape.dense(), seq_len)["total"] / seq_len


def per_token_compute(
    shape: ModelShape,
    routing: RoutingShape,
    seq_len: int,
    executed_fraction: Optional[Dict[int, float]] = None,
    *,
    bytes_per_value: int = 4,
    distillation_weight: float = 0.0,
    distillation_seq_len: Optional[int] = None,
) -> Dict[str, object]:
    """Deployed (student) forward FLOPs and KV bytes per token at ``seq_len``, with the measured executed
    fraction of each routed layer (default: its capacity γ), against the dense model of the same shape.

    The executed count of routed layer l is f_l·T (a real number: the ideal cost of the measured selection,
    without the padding that ragged threshold selections add in a batched executor).
    """
    fractions = {layer: float(f) for layer, f in (executed_fraction or {}).items()}
    gammas = routing.gamma_of()
    missing = sorted(set(gammas) - set(fractions))
    fractions.update({layer: gammas[layer] for layer in missing})
    selected = {layer: fractions[layer] * seq_len for layer in gammas}
    fwd = forward_flops(shape, routing, seq_len, selected=selected)
    dense = forward_flops(shape, RoutingShape.dense(), seq_len)
    kv = kv_bytes_per_token(shape, routing, fractions, bytes_per_value=bytes_per_value)
    dense_kv = kv_bytes_per_token(shape, RoutingShape.dense(), {}, bytes_per_value=bytes_per_value)
    out: Dict[str, object] = {
        "seq_len": seq_len,
        "forward_flops_per_token": fwd["total"] / seq_len,
        "dense_forward_flops_per_token": dense["total"] / seq_len,
        "forward_flops_ratio": fwd["total"] / dense["total"],
        "forward_flops_by_category_per_token": {k: v / seq_len for k, v in fwd.items() if k not in ("total", "teacher_pass")},
        "kv_bytes_per_token": kv,
        "dense_kv_bytes_per_token": dense_kv,
        "kv_bytes_ratio": kv / dense_kv,
        "bytes_per_value": bytes_per_value,
        "executed_fraction_used": {str(layer): fractions[layer] for layer in sorted(gammas)},
        "executed_fraction_nominal_layers": missing,
        "routed_layers": list(routing.routed_layers),
        "dropped_layers": list(routing.dropped_layers),
        "skipped_tokens_write_kv": routing.skipped_tokens_write_kv,
        "skip_update": routing.skip_update,
        "distillation_teacher_flops_per_token": (
            distillation_teacher_flops_per_token(shape, distillation_seq_len or seq_len) if distillation_weight > 0 else 0.0
        ),
    }
    return out


# ---- shapes of the package's builders ------------------------------------------------------------

#: What the benchmarks give the tiny builders, which require both: a small vocabulary, so the LM head does
#: not dominate a 4-layer model, and the tiny test checkpoints' 256 positions.
TINY_ARGS = {"vocab_size": 512, "max_seq_len": 256}


def model_shape(size: str, vocab_size: Optional[int] = None) -> ModelShape:
    """:class:`ModelShape` of ``torchtune_dtf.models.qwen2_5.QWEN2_5_SHAPES[size]`` (``tiny``: with
    ``TINY_ARGS`` unless ``vocab_size`` is given)."""
    from torchtune_dtf.models.qwen2_5 import QWEN2_5_SHAPES

    s = QWEN2_5_SHAPES[size]
    if vocab_size is None:
        vocab_size = TINY_ARGS["vocab_size"] if size == "tiny" else s["vocab_size"]
    return ModelShape.from_architecture({**s, "vocab_size": vocab_size})


def variant_of_model_config(model: Mapping) -> str:
    """The variant a recipe's ``model`` section builds (:func:`torchtune_dtf.models.model_config.model_variant`)."""
    from torchtune_dtf.models.model_config import model_variant

    return model_variant(model)


def model_shape_from_config(model: Mapping) -> ModelShape:
    """:class:`ModelShape` of a recipe's ``model`` section: the architecture keys of ``routed_qwen2`` configs,
    else the size of its ``{variant}_qwen2_5_{size}`` builder (``vocab_size`` as the config gives it;
    :data:`TINY_ARGS`'s for a tiny section without one)."""
    from torchtune_dtf.models.model_config import architecture

    arch = architecture(model)
    arch.setdefault("vocab_size", TINY_ARGS["vocab_size"])  # only the tiny shape has none of its own
    return ModelShape.from_architecture(arch)


def routing_shape_from_model_config(model: Mapping, num_layers: int, embed_dim: int) -> RoutingShape:
    """:class:`RoutingShape` of a recipe's ``model`` section, for every variant and technique option the closed
    form knows (module docstring).

    The routing arguments are read as the model builder reads them (``routing_config.validate_routing`` resolves
    placements and capacities and checks every value given), with the keys saved configs predate completed as
    the builder completes them (``KEYS_ADDED_LATER``). Unlike the builder (``for_builder=False``), the closed form
    takes a partial section, where keys the cost does not depend on may be absent and an absent technique key (K/V
    kept, skip update) counts as off, and costs shapes the builder refuses (a planner candidate routing no layer,
    ``skip_update: predicted`` on SDT, whose PriorFFN would give the forecast; on MoD and random it costs nothing).
    """
    from torchtune_dtf.models.model_config import model_variant, routing_arguments
    from torchtune_dtf.models.routing_config import validate_routing, with_keys_added_later

    variant = model_variant(model)
    routing = with_keys_added_later({"variant": variant, **routing_arguments(model)})
    del routing["variant"]
    if variant not in ("dense", "layerdrop") and "routed_layers" not in routing:
        raise ValueError(f"model config of variant {variant!r} has no routed_layers")
    return _routing_shape_of(validate_routing(variant, num_layers, for_builder=False, **routing), embed_dim)


def _routing_shape_of(spec, embed_dim: int) -> RoutingShape:
    """:class:`RoutingShape` of a resolved ``routing_config.RoutingSpec``."""
    from torchtune_dtf.modules.predictors import predictor_width

    variant = spec.variant
    common = dict(dropped_layers=tuple(spec.dropped_layers), skipped_tokens_write_kv=bool(spec.skipped_tokens_write_kv),
                  skip_update=spec.skip_update or "none")
    if variant in ("dense", "layerdrop"):
        return RoutingShape(variant=variant, **common)
    has_router = variant in ("mod", "sdt", "stt")
    return RoutingShape(
        variant=variant,
        routed_layers=tuple(spec.routed_layers),
        capacity=tuple(spec.capacity),
        router_hidden=int(spec.causal_router_hidden_dim) if has_router else 0,
        router_inputs=2 if spec.causal_router_input == "current_previous" else 1,
        predictor_width=predictor_width(spec.prior_factor, embed_dim) if variant in ("sdt", "stt") else 0,
        mod_router_at_inference=spec.gate != "straight_through",
        **common,
    )


def model_config_flop_ratio(model: Mapping, seq_len: int) -> float:
    """Routed/dense forward FLOP ratio (routers included) of a recipe's ``model`` section at ``seq_len`` tokens."""
    shape = model_shape_from_config(model)
    return flop_ratio(shape, routing_shape_from_model_config(model, shape.num_layers, shape.embed_dim), seq_len)


def routing_shape(variant: str, num_layers: int, embed_dim: int, routing: Dict) -> RoutingShape:
    """:class:`RoutingShape` from a builder's routing kwargs, checked by the package's own validator (every key
    required, as the builder requires them)."""
    if variant == "dense":
        return RoutingShape.dense()
    from torchtune_dtf.models.routing_config import validate_routing

    return _routing_shape_of(validate_routing(variant, num_layers, **routing), embed_dim)


def every_other(shape: ModelShape, variant: str, gamma: float, *, router_hidden: int = 256, router_inputs: int = 1,
                predictor_width: int = 0) -> RoutingShape:
    """Routing on every other layer (1, 3, 5, …) at capacity γ — the papers' setting."""
    layers = tuple(range(1, shape.num_layers, 2))
    return RoutingShape(variant=variant, routed_layers=layers, capacity=(gamma,) * len(layers),
                        router_hidden=router_hidden, router_inputs=router_inputs, predictor_width=predictor_width)


def fmt_flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3f} {unit}FLOP"
    return f"{value:.0f} FLOP"

