"""A torchtune ``TransformerDecoder`` that threads a :class:`RoutingContext` through routed layers.

It stays a drop-in ``TransformerDecoder`` for every torchtune caller (generation, eleuther_eval,
chunked-output losses, cache helpers): ``model(tokens, mask=..., input_pos=...)`` returns logits and runs
student (inference) routing. Trainers additionally pass ``routing=RoutingContext(mode="teacher",
beta_ce=..., beta_cu=...)`` and read each routed layer's :class:`LayerRouting` from it afterwards.

Stock callers cannot pass a context, so each routed layer also keeps on-device counters of the tokens
it saw and executed in student mode: :meth:`RoutedTransformerDecoder.executed_fractions` reads them
after ``generate`` or an eval (``torchtune_dtf/recipes/routed_generate.py`` and ``routed_eval.py``
print them), :meth:`RoutedTransformerDecoder.reset_routing_counters` starts a new measurement.
"""

import math
from typing import Dict, List, Optional, Tuple, Union

import torch
from torchtune.modules import TransformerDecoder

from torchtune_dtf.modules.layers import RoutedSelfAttentionLayer
from torchtune_dtf.modules.routing_context import RoutingContext


class RoutedTransformerDecoder(TransformerDecoder):
    """
    Args:
        variant (str): ``"dense"``, ``"mod"``, ``"sdt"`` or ``"stt"`` (informational; used by tooling).
        routing_layer_indices (List[int]): indices of layers whose forward takes ``routing=`` (routed
            layers and SDT Decision layers). Recorded at build time because wrappers applied later
            (activation checkpointing, FSDP, compile) hide the layer classes.
        **kwargs: :class:`torchtune.modules.TransformerDecoder` arguments.
    """

    def __init__(self, *, variant: str, routing_layer_indices: List[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.variant = variant
        self.routing_layer_indices = sorted(routing_layer_indices)
        self._routing_layers = set(self.routing_layer_indices)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        encoder_input: Optional[torch.Tensor] = None,
        encoder_mask: Optional[torch.Tensor] = None,
        input_pos: Optional[torch.Tensor] = None,
        routing: Optional[RoutingContext] = None,
    ) -> Union[torch.Tensor, List[torch.Tensor]]:
        """
        Args:
            tokens (torch.Tensor): ``[b, s]`` token ids.
            mask, encoder_input, encoder_mask, input_pos: as in ``TransformerDecoder.forward``.
            routing (Optional[RoutingContext]): routing mode and β for this forward, and where routed
                layers record their statistics. Student mode when None.

        Returns:
            Logits ``[b, s, v]`` (or a list of chunks / hidden states, as torchtune's decoder).
        """
        self._validate_inputs(
            tokens.shape[1], mask=mask, encoder_input=encoder_input, encoder_mask=encoder_mask, input_pos=input_pos
        )
        routing = routing if routing is not None else RoutingContext(mode="student")
        self._make_room_in_selective_caches(tokens.shape[1])
        token_layout = self._token_layout(*tokens.shape, mask, input_pos, tokens.device)
        h = self.tok_embeddings(tokens)
        hidden = []
        for i, layer in enumerate(self.layers):
            if i in self.output_hidden_states:
                hidden.append(h)
            if i in self._routing_layers:
                layer_routing = routing.for_layer(i, h.device, token_layout)
                h = layer(h, mask=mask, input_pos=input_pos, routing=layer_routing)
                routing.absorb(i, layer_routing)
            else:
                h = layer(h, mask=mask, encoder_input=encoder_input, encoder_mask=encoder_mask, input_pos=input_pos)
        output = self.unembed(h)
        return output if not hidden else [*hidden, output]

    def _token_layout(
        self, batch: int, seq_len: int, mask: Optional[torch.Tensor], input_pos: Optional[torch.Tensor],
        device: torch.device,
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Position ids and sequence starts ``[b, s]`` of this forward's tokens, computed once for every routed
        layer (a decode step spent about ten operators per routed layer on them): each forward moves every
        routed layer's cache on by the same s slots, so the layers agree on where the chunk sits. None (each layer
        computes its own, or reports a bad mask) without routed layers, for a mask that is not a tensor, or when
        the routed layers do not all have an active cache or all none."""
        layers = self.routed_layers()
        if not layers or not (mask is None or isinstance(mask, torch.Tensor)):
            return None
        if len({layer._active_cache() is None for layer in layers}) > 1:
            return None
        if mask is not None and mask.shape[0] != batch:
            mask = mask.expand(batch, -1, -1)
        return layers[0].token_layout(mask, input_pos, batch, seq_len, device)

    def use_static_kv_caches(self, enabled: bool = True) -> None:
        """Make the selective caches that :meth:`setup_caches` creates from now on static: ``max_seq_len``
        entries per row, no growth, no host-side bookkeeping (the gpt-fast pattern), so a compiled decode
        step keeps one graph of fixed shapes. Memory per routed layer is then the dense layer's; the
        default (growing) caches hold what runs. Call before ``setup_caches``."""
        for layer in self.routed_layers():
            layer.static_kv_cache = enabled

    def _make_room_in_selective_caches(self, seq_len: int) -> None:
        """Before a cached forward of ``seq_len`` tokens per row, let every routed layer's cache grow if a
        row might overflow it. Host-side decisions about allocation happen here, outside the layers, so a
        compiled layer never reads cache state back from the device (see ``SelectiveKVCache.make_room``).
        An eager layer's cache defers to its own writes, so it allocates what the layer stores, not ``seq_len``."""
        compiling = torch.compiler.is_compiling()
        for layer in self.routed_layers():
            cache = layer.attn.kv_cache
            if cache is not None and layer.attn.cache_enabled:
                # ``Module.compile`` (torchtune's per-layer compile) sets ``_compiled_call_impl``.
                eager = not compiling and getattr(layer, "_compiled_call_impl", None) is None
                cache.make_room(seq_len, deferred=eager)

    def chunked_output(self, last_hidden_state: torch.Tensor) -> List[torch.Tensor]:
        """The output projection as torchtune's chunks (``torch.chunk`` along the sequence, for
        ``CEWithChunkedOutputLoss``), computed by one projection over every position.

        torchtune projects each chunk separately. With n chunks the weight gradient is then n GEMMs
        whose reduction length is b·s/n, each writing a full ``[v, d]`` tensor that autograd adds to
        the others (n − 1 passes over 545 MB for Qwen2.5-0.5B's tied embedding in fp32). One projection
        has one weight-gradient GEMM over all b·s positions (the head is the same in dense and routed models).
        When s is a multiple of n the hidden states are laid out ``[n, b, s/n, d]`` first, so every
        chunk of logits is contiguous, as the loss reshapes it; otherwise the chunks are views of the
        ``[b, s, v]`` logits. Memory: the backward assembles the chunks' gradients into one
        ``[n, b, s/n, v]`` tensor (one more copy of the logits' size at the peak).

        Args:
            last_hidden_state (torch.Tensor): ``[b, s, d]`` after the final norm.

        Returns:
            List[torch.Tensor]: the chunks of ``torch.chunk(logits, num_output_chunks, dim=1)``, each
            ``[b, ≈s/n, v]``.
        """
        batch, seq_len, dim = last_hidden_state.shape
        num_chunks = self.num_output_chunks
        if seq_len % num_chunks:
            return list(self.output(last_hidden_state).chunk(num_chunks, dim=1))
        by_chunk = last_hidden_state.view(batch, num_chunks, seq_len // num_chunks, dim).transpose(0, 1)
        return list(self.output(by_chunk).unbind(0))

    # -- what the student executed, for callers that cannot pass a RoutingContext -----------------
    def routed_layers(self) -> List[RoutedSelfAttentionLayer]:
        """Routed layers in layer order, found through wrappers applied after the build (activation
        checkpointing, compile, FSDP keep the layer as a submodule or subclass it)."""
        # Found once: the layer objects never change after the build (wrappers only enclose them).
        if getattr(self, "_routed_layer_list", None) is None:
            layers = [module for module in self.modules() if isinstance(module, RoutedSelfAttentionLayer)]
            self._routed_layer_list = sorted(layers, key=lambda layer: layer.layer_idx)
        return self._routed_layer_list

    def routing_counters(self) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
        """Per routed layer, ``(executed, seen)`` token counts of student-mode forwards since the last
        reset, as 0-dim int64 tensors on the model's device (no host sync). What is counted (KV-cached
        decoding, padding, which routing modes) is documented in
        :meth:`~torchtune_dtf.modules.layers.RoutedSelfAttentionLayer.routing_counts`."""
        return {layer.layer_idx: layer.routing_counts() for layer in self.routed_layers()}

    def routing_token_counts(self) -> Dict[int, Tuple[int, int]]:
        """:meth:`routing_counters` as Python ints ``{layer_idx: (executed, seen)}``, one host transfer."""
        counters = self.routing_counters()
        if not counters:
            return {}
        host = torch.stack([torch.stack(pair) for pair in counters.values()]).tolist()
        return {idx: (executed, seen) for idx, (executed, seen) in zip(counters, host)}

    def executed_fractions(self) -> Dict[int, float]:
        """``{layer_idx: executed / seen}`` of student-mode forwards since the last reset; NaN for a layer
        that has seen no token; empty for a model without routed layers (dense, layer dropping)."""
        return {idx: executed / seen if seen else math.nan for idx, (executed, seen) in self.routing_token_counts().items()}

    def reset_routing_counters(self) -> None:
        """Zero every routed layer's counters (e.g. before the forwards to be measured)."""
        for layer in self.routed_layers():
            layer.reset_routing_counters()
