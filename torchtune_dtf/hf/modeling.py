"""The deployed routed student as a Hugging Face ``transformers`` model (issue 49).

An exported folder (``python -m torchtune_dtf.export``) names these classes in its ``config.json`` ``auto_map``, so

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

builds :class:`RoutedQwen2ForCausalLM`: a thin ``PreTrainedModel`` around the very torchtune model our recipes train
(:func:`torchtune_dtf.models.qwen2_5.routed_qwen2`, rebuilt from the config section stored in ``config.json``), so
it runs the same student decisions, not a re-implementation of them. What the wrapper adds is the translation
between the two calling conventions:

* **masks and positions.** transformers passes a 2-D ``attention_mask`` ``[b, s_total]`` (0 on left pads);
  torchtune's ``generate`` derives a ``[b, s, max_len]`` boolean mask (causal, pads hidden, each token sees itself)
  and positions that restart after the pads (``(cumsum(mask) − 1) · mask``). The wrapper derives exactly those from
  the 2-D mask, so a left-padded batch decodes as torchtune decodes it.
* **the cache.** The selective KV cache lives inside the torchtune model (each routed layer's
  :class:`~torchtune_dtf.modules.SelectiveKVCache`, torchtune's ``KVCache`` in the dense layers).
  :class:`SelectiveCache` is the ``transformers.Cache`` that ``generate`` carries between steps: it sets the model's
  caches up on the prompt (``max_len`` = the generation's ``max_length``, as torchtune's ``generate`` sizes them) and
  counts the tokens they hold. One generation at a time per model, since the caches are the model's.
* **counters.** :meth:`RoutedQwen2ForCausalLM.executed_fractions` reads the routed layers' student counters, as on
  our torchtune model.

Not supported (each refused with a message): ``inputs_embeds``, ``position_ids`` (positions always come from the
mask), beam search and other cache reordering, and assisted decoding.
"""

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune.generation import get_position_ids_from_padding_mask
from torchtune.modules.common_utils import delete_kv_caches
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

#: ``model_type`` of an exported routed model's ``config.json``.
MODEL_TYPE = "torchtune_dtf_routed_qwen2"


class RoutedQwen2Config(PretrainedConfig):
    """``config.json`` of an exported routed model.

    Args:
        torchtune_model (Optional[Dict[str, Any]]): the torchtune ``model`` config section that builds the model
            (``_component_`` and every argument, as in our eval / generate configs; its routing keys included).
        **kwargs: ``PretrainedConfig`` fields. ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` and
            ``max_position_embeddings`` describe the model for tools that read them (lm-eval reads the last one as
            its context length); the export fills them in from the built model (:func:`torchtune_dtf.export.
            architecture_fields`). The model is built from ``torchtune_model`` alone.
            ``tie_word_embeddings`` is always False here: the torchtune model ties its own output head, and
            transformers must not tie anything on top.
    """

    model_type = MODEL_TYPE

    def __init__(self, torchtune_model: Optional[Dict[str, Any]] = None, **kwargs) -> None:
        self.torchtune_model = dict(torchtune_model or {})
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings"):
            setattr(self, name, kwargs.pop(name, None))
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)


class SelectiveCache(Cache):
    """The ``transformers.Cache`` of a routed model: a handle on the caches inside the torchtune model.

    ``generate`` makes one per call (:meth:`RoutedQwen2ForCausalLM._prepare_cache_for_generation`); for decoding by
    hand, pass ``SelectiveCache(max_cache_len=N)`` as ``past_key_values`` on the prompt and the returned one after.

    Args:
        max_cache_len (int): positions the caches hold per row (prompt, left pads included, plus new tokens).
    """

    def __init__(self, max_cache_len: int) -> None:
        super().__init__(layers=[])
        self.cache_length = int(max_cache_len)
        self.seen_tokens = 0
        self.model: Optional[torch.nn.Module] = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.cache_length

    @property
    def is_compileable(self) -> bool:
        # False keeps generate from building 4-D masks for us: the wrapper derives torchtune's masks itself.
        return False

    def bind(self, model: torch.nn.Module, batch_size: int, dtype: torch.dtype) -> None:
        """Set ``model``'s caches up (emptied) for ``batch_size`` rows of ``max_cache_len`` positions."""
        if model.caches_are_setup() and (model.decoder_max_cache_seq_len != self.cache_length
                                         or _cache_batch_size(model) != batch_size):
            delete_kv_caches(model)  # torchtune's setup_caches skips a model whose caches exist
        if model.caches_are_setup():
            model.reset_caches()
        else:
            model.setup_caches(batch_size=batch_size, dtype=dtype, decoder_max_seq_len=self.cache_length)
        self.model = model
        self.seen_tokens = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a routed model's selective KV cache cannot be reordered (beam search, "
                                  "contrastive search): generate greedily or by sampling")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a routed model's selective KV cache cannot be cropped (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a routed model's selective KV cache cannot be expanded "
                                  "(num_return_sequences > 1): repeat the prompts in the batch instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a routed model's selective KV cache cannot select rows")


def _cache_batch_size(model: torch.nn.Module) -> int:
    for module in model.modules():
        cache = getattr(module, "kv_cache", None)
        if cache is not None and hasattr(cache, "k_cache"):
            return int(cache.k_cache.shape[0])
        if cache is not None and hasattr(cache, "fill"):
            return int(cache.fill.shape[0])
    return -1


def torchtune_mask(padding: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """torchtune ``generate``'s boolean attention mask for the query positions ``rows``.

    Token t of row b sees key s iff s ≤ t and (s is a real token or s = t): pads are hidden from every other token
    but see themselves, so no row of the softmax is empty (``get_causal_mask_from_padding_mask``).
    torchtune's ``get_causal_mask_from_padding_mask`` builds every row of a prompt at once; a decode step needs only
    its own row, so this builds the rows asked for.

    Args:
        padding (torch.Tensor): ``[b, s_total]`` bool, True on real tokens, for every position so far.
        rows (torch.Tensor): ``[s]`` the absolute positions of this forward's tokens.
        width (int): key positions of the mask (the caches' ``max_len``, or ``s_total`` without a cache).

    Returns:
        torch.Tensor: ``[b, s, width]`` bool.
    """
    batch, total = padding.shape
    keys = torch.arange(width, device=padding.device)
    visible = F.pad(padding, (0, width - total), value=True)  # positions not reached yet are hidden by causality
    causal = keys[None, :] <= rows[:, None]
    own = keys[None, :] == rows[:, None]
    return causal[None] & (visible[:, None, :] | own[None])


class RoutedQwen2ForCausalLM(PreTrainedModel, GenerationMixin):
    """A routed Qwen2 student (MoD, SDT, STT, random, or layer dropping with skip biases or linear maps) for ``transformers``.

    ``self.model`` is the torchtune ``RoutedTransformerDecoder``; its state dict is this model's under ``model.``.
    """

    config_class = RoutedQwen2Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the caches are module state: transformers refuses assisted decoding and cache rollback
    _no_split_modules = ["RoutedSelfAttentionLayer", "TransformerSelfAttentionLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: RoutedQwen2Config) -> None:
        super().__init__(config)
        if not config.torchtune_model:
            raise ValueError("config.json has no `torchtune_model` section: this folder was not written by "
                             "`python -m torchtune_dtf.export`")
        self.model = tt_config.instantiate(OmegaConf.create(config.torchtune_model))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # Every weight comes from the exported safetensors (a folder that lacks one fails to load); torchtune's
        # modules initialise themselves when built, and the RoPE tables are rebuilt after loading.
        pass

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        model.rebuild_buffers()
        return model

    def rebuild_buffers(self) -> None:
        """Recompute the buffers no checkpoint holds (the RoPE tables): ``from_pretrained`` builds the model on
        the meta device and loads only the saved tensors."""
        for module in self.model.modules():
            if not hasattr(module, "rope_init"):
                continue
            if any(b.is_meta for b in module.buffers(recurse=False)):
                module.to_empty(device=next(p.device for p in self.parameters() if not p.is_meta), recurse=False)
            module.rope_init()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_embeddings

    def get_output_embeddings(self) -> None:
        return None  # tied (or not) inside the torchtune model; nothing for transformers to tie or resize

    # -- what the student executed ---------------------------------------------------------------------
    def executed_fractions(self) -> Dict[int, float]:
        """``{layer_idx: executed / seen}`` of the routed layers since the last reset (NaN: no token seen)."""
        return self.model.executed_fractions()

    def reset_routing_counters(self) -> None:
        self.model.reset_routing_counters()

    # -- generation ----------------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs) -> None:
        if generation_config.use_cache is False or model_kwargs.get("past_key_values") is not None:
            return
        # transformers counts max_length − 1 positions (the last token is never fed back); torchtune's generate
        # sizes its caches to prompt + new tokens. One more position keeps every mask and cache the same width.
        model_kwargs["past_key_values"] = SelectiveCache(max_cache_length + 1)

    # -- forward ---------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[SelectiveCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        cache_position: Optional[torch.LongTensor] = None,
        logits_to_keep: int = 0,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """
        Args:
            input_ids (torch.LongTensor): ``[b, s]`` the new tokens (with a cache: the ones it does not hold yet).
            attention_mask (Optional[torch.Tensor]): ``[b, s_total]``, 0 on left pads, for every position so far
                (the cache's and these); None: no padding.
            past_key_values (Optional[SelectiveCache]): None runs without a cache.
            labels (Optional[torch.LongTensor]): ``[b, s]``; the mean next-token cross-entropy is returned as
                ``loss`` (−100 ignored).
            logits_to_keep (int): 0 for every position's logits, else the last ``logits_to_keep``.

        Returns:
            CausalLMOutputWithPast: ``logits`` ``[b, s or logits_to_keep, v]`` and the cache.
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported: a routed model routes on its own token embeddings")
        if kwargs.get("position_ids") is not None:
            raise ValueError("position_ids is not supported: positions come from attention_mask, as torchtune's "
                             "generate derives them (counted from each row's first real token)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        batch, new = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        total = past + new
        if attention_mask is None:
            padding = torch.ones(batch, total, dtype=torch.bool, device=input_ids.device)
        else:
            if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, total):
                raise ValueError(f"attention_mask must be [batch, cached + new tokens] = [{batch}, {total}], "
                                 f"got {list(attention_mask.shape)}")
            padding = attention_mask.bool()
        if past_key_values is None:
            logits = self._forward_uncached(input_ids, padding)
        else:
            logits = self._forward_cached(input_ids, padding, past_key_values)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values)

    def _forward_uncached(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        if self.model.caches_are_setup():
            # A forward without a cache starts afresh, so the last generation's caches go. (Disabling them would
            # not do: torchtune's attention is causal by default only when it has no cache at all.)
            delete_kv_caches(self.model)
        if bool(padding.all()):
            return self.model(tokens)  # the model's own causal path, exactly what torchtune's evals run
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.model(tokens, mask=torchtune_mask(padding, positions, tokens.shape[1]),
                          input_pos=get_position_ids_from_padding_mask(padding))

    def _forward_cached(self, tokens: torch.Tensor, padding: torch.Tensor, cache: SelectiveCache) -> torch.Tensor:
        batch, new = tokens.shape
        past = cache.get_seq_length()
        if past == 0:
            cache.bind(self.model, batch, self.model.tok_embeddings.weight.dtype)
        elif cache.model is not self.model or _cache_batch_size(self.model) != batch:
            raise ValueError("this SelectiveCache does not hold this model's current caches (another generation "
                             "ran in between, or the batch changed): start again from the prompt")
        if past + new > cache.cache_length:
            raise ValueError(f"{past + new} positions do not fit the cache's max_cache_len {cache.cache_length}")
        rows = torch.arange(past, past + new, device=tokens.device)
        mask = torchtune_mask(padding, rows, cache.cache_length)
        positions = get_position_ids_from_padding_mask(padding)[:, past:]
        # The shapes torchtune's generate passes: [b] per decode step, [s] for an unbatched prompt, else [b, s].
        input_pos = positions[:, 0] if new == 1 and past > 0 else (positions[0] if batch == 1 else positions)
        logits = self.model(tokens, mask=mask, input_pos=input_pos)
        cache.seen_tokens = past + new
        return logits
