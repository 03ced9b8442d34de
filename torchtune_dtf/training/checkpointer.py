"""Checkpointer for routed Qwen2 models: base weights in HF layout, routing weights in a sidecar.

torchtune's :class:`~torchtune.training.FullModelHFCheckpointer` converts every key through the Qwen2
HF mapping and rejects keys it does not know, so it cannot carry the routing parameters of MoD, SDT
and STT models. :class:`RoutedHFCheckpointer` wraps it (composition, not a copy):

* **load** — the stock HF checkpoint goes through the base conversion; the routing parameters come
  from ``routing.safetensors`` beside the checkpoint files when present (a directory this
  checkpointer saved), otherwise they are initialised deterministically from ``routing_init_seed``.
  The result is validated key by key and shape by shape against the model built from the same
  config on the meta device, so it loads strictly into that model.
* **save** — the base weights go out through the base checkpointer (a stock HF directory that
  ``FullModelHFCheckpointer`` and ``transformers`` read), the routing weights into
  ``output_dir/epoch_{N}/routing.safetensors`` beside them. Adapter and recipe-state files are the
  base checkpointer's; adapter files hold LoRA weights only, and when a LoRA run resumes from
  ``epoch_{N}/adapter_model.pt`` the routing sidecar beside it is added to the ``"adapter"`` entry.

Config usage (the model component is shared with the recipe through interpolation)::

    checkpointer:
      _component_: torchtune_dtf.training.RoutedHFCheckpointer
      checkpoint_dir: /tmp/Qwen2.5-0.5B
      checkpoint_files: [model.safetensors]
      model_type: QWEN2
      output_dir: ${output_dir}
      model: ${model}
      routing_init_seed: 0

A directory written by :meth:`RoutedHFCheckpointer.save_checkpoint` can be used as ``checkpoint_dir``
of an eval or generate config as it is (``checkpoint_files: [model-00001-of-00001.safetensors]``, or
the shard names it holds); its routing sidecar is picked up automatically.
"""

from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file
from torch import nn
from torchtune import config, training
from torchtune.modules.peft import get_adapter_params, get_adapter_state_dict

from torchtune_dtf.modules import ROUTING_MODULE_NAMES, is_routing_key

#: Name of the routing-weights sidecar written beside the model (or adapter) files of each epoch.
ROUTING_WEIGHTS_FNAME = "routing.safetensors"

_Shapes = Dict[str, torch.Size]


def routed_adapter_state_dict(state_dict: Mapping[str, torch.Tensor], device: str = "cpu") -> Dict[str, torch.Tensor]:
    """The trainable part of a routed LoRA model: LoRA/DoRA weights plus every routing weight.

    torchtune's ``get_adapter_state_dict`` keeps only ``lora``/``magnitude`` keys, but routing
    modules are fully trainable adapter parameters in LoRA twins. Recipes that save with
    ``adapter_only=True`` pass this as the ``"adapter"`` entry so the routing weights are saved too.

    Args:
        state_dict (Mapping[str, torch.Tensor]): the model's state dict.
        device (str): device the returned tensors are moved to.

    Returns:
        Dict[str, torch.Tensor]: adapter and routing weights.
    """
    adapter = get_adapter_state_dict(dict(state_dict), device=device)
    adapter.update({k: v.to(device) for k, v in state_dict.items() if is_routing_key(k)})
    return adapter


def _plain_model_config(model: Union[Mapping[str, Any], DictConfig]) -> Dict[str, Any]:
    """The model component config as plain Python containers, interpolations resolved."""
    if isinstance(model, DictConfig):
        model = OmegaConf.to_container(model, resolve=True)
    if not isinstance(model, Mapping) or "_component_" not in model:
        raise ValueError(
            "RoutedHFCheckpointer needs the model component config (a mapping with '_component_' and the "
            f"builder's arguments, e.g. `model: ${{model}}` in the config), got {model!r}"
        )
    return dict(model)


def _key_problems(
    state_dict: Mapping[str, torch.Tensor], allowed: _Shapes, required: Iterable[str], source: str
) -> List[str]:
    """Describe every missing required key, unexpected key and shape mismatch of ``state_dict``."""
    problems = []
    missing = sorted(set(required) - set(state_dict))
    if missing:
        problems.append(f"{source}: missing key(s) {missing}")
    unexpected = sorted(set(state_dict) - set(allowed))
    if unexpected:
        problems.append(f"{source}: unexpected key(s) {unexpected}")
    for key in sorted(set(state_dict) & set(allowed)):
        if tuple(state_dict[key].shape) != tuple(allowed[key]):
            problems.append(
                f"{source}: shape mismatch for {key}: checkpoint {tuple(state_dict[key].shape)}, "
                f"model {tuple(allowed[key])}"
            )
    return problems


def _raise_if(problems: List[str], context: str) -> None:
    if problems:
        raise ValueError(f"{context}:\n  - " + "\n  - ".join(problems))


def _latest_epoch_weight_files(output_dir: Path) -> List[str]:
    """Weight files of the highest ``epoch_N`` folder under ``output_dir``, relative to it."""
    epochs = [p for p in output_dir.glob("epoch_*") if p.is_dir() and p.name.split("_", 1)[1].isdigit()]
    if not epochs:
        raise ValueError(f"Asked to resume, but {output_dir} holds no epoch_N checkpoint folder")
    latest = max(epochs, key=lambda p: int(p.name.split("_", 1)[1]))
    files = sorted(latest.glob("model-*.safetensors")) or sorted(latest.glob("model-*.bin"))
    if not files:
        raise ValueError(f"Asked to resume, but {latest} holds no model weight files")
    return [f"{latest.name}/{f.name}" for f in files]


class RoutedHFCheckpointer:
    """HF-format checkpointer for the dense/MoD/SDT/STT Qwen2 models of this package (and LoRA twins).

    Args:
        checkpoint_dir (str): directory of the HF checkpoint (``config.json`` + weights), e.g. what
            ``tune download Qwen/Qwen2.5-0.5B`` leaves, or an ``epoch_N`` folder saved by this class.
        checkpoint_files (Union[List[str], Dict[str, str]]): weight files, as for
            ``FullModelHFCheckpointer`` (a list, or ``filename_format``/``max_filename``).
        model_type (str): must be ``"QWEN2"`` (the key mapping of every model built here).
        output_dir (str): where ``epoch_{N}`` folders and ``recipe_state/`` are written.
        adapter_checkpoint (Optional[str]): adapter file to resume from (relative to ``output_dir``);
            found automatically when resuming, as in torchtune.
        recipe_checkpoint (Optional[str]): recipe-state file to resume from, as in torchtune.
        resume_from_checkpoint (bool): deprecated alias of ``should_load_recipe_state`` (torchtune's).
        safe_serialization (bool): save model/adapter weights as safetensors (else ``.bin``/``.pt``).
            The routing sidecar is always safetensors.
        should_load_recipe_state (bool): also load adapter weights and recipe state (recipes pass this
            when resuming).
        model (Mapping[str, Any]): the model component config (``_component_`` and its arguments), the
            same the recipe builds; used to build the model on the meta device for initialisation and
            validation.
        routing_init_seed (int): seed of the initialisation of routing parameters absent from the
            checkpoint.

    Raises:
        ValueError: for a model type other than QWEN2 or an invalid model config.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        checkpoint_files: Union[List[str], Dict[str, str]],
        model_type: str,
        output_dir: str,
        adapter_checkpoint: Optional[str] = None,
        recipe_checkpoint: Optional[str] = None,
        resume_from_checkpoint: bool = False,
        safe_serialization: bool = True,
        should_load_recipe_state: bool = False,
        *,
        model: Union[Mapping[str, Any], DictConfig],
        routing_init_seed: int,
    ) -> None:
        if model_type != "QWEN2":
            raise ValueError(f"RoutedHFCheckpointer supports model_type QWEN2 only (routed Qwen2), got {model_type!r}")
        self._model_config = _plain_model_config(model)
        self._routing_init_seed = routing_init_seed

        meta_model = self._build_meta_model()
        shapes = {key: value.shape for key, value in meta_model.state_dict().items()}
        adapter_keys = set(get_adapter_params(meta_model))
        self._routing_shapes: _Shapes = {k: s for k, s in shapes.items() if is_routing_key(k)}
        self._lora_shapes: _Shapes = {k: s for k, s in shapes.items() if k in adapter_keys and not is_routing_key(k)}
        self._base_shapes: _Shapes = {
            k: s for k, s in shapes.items() if k not in self._routing_shapes and k not in self._lora_shapes
        }

        if (should_load_recipe_state or resume_from_checkpoint) and not self._lora_shapes:
            # Resuming a full fine-tune: weights come from the newest epoch folder this run wrote (torchtune
            # itself would look for the original file names directly under output_dir).
            checkpoint_files = _latest_epoch_weight_files(Path(output_dir))
        self._base = training.FullModelHFCheckpointer(
            checkpoint_dir=checkpoint_dir,
            checkpoint_files=checkpoint_files,
            model_type=model_type,
            output_dir=output_dir,
            adapter_checkpoint=adapter_checkpoint,
            recipe_checkpoint=recipe_checkpoint,
            resume_from_checkpoint=resume_from_checkpoint,
            safe_serialization=safe_serialization,
            should_load_recipe_state=should_load_recipe_state,
        )
        # torchtune's CheckpointClient reads these two attributes (asynchronous/distributed checkpoints).
        self._checkpoint_dir = self._base._checkpoint_dir
        self._output_dir = self._base._output_dir

    # -- model structure -----------------------------------------------------------------------
    def _build_meta_model(self) -> nn.Module:
        """The configured model on the meta device, float32 (no memory, no real initialisation)."""
        with torch.device("meta"), training.set_default_dtype(torch.float32):
            return config.instantiate(OmegaConf.create(self._model_config))

    def _initial_routing(self, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """Fresh routing parameters: each routing module materialised on CPU and ``reset_parameters()``
        called under ``routing_init_seed`` (global RNG state untouched), cast to ``dtype``."""
        model = self._build_meta_model()
        routing = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._routing_init_seed)
            for name, module in model.named_modules():
                if name.rsplit(".", 1)[-1] not in ROUTING_MODULE_NAMES:
                    continue
                module.to_empty(device="cpu")
                for param in module.parameters():
                    param.data.fill_(float("nan"))
                module.reset_parameters()
                for key, value in module.state_dict().items():
                    if torch.isnan(value).any():
                        raise RuntimeError(f"{type(module).__name__}.reset_parameters() left {name}.{key} unset")
                    routing[f"{name}.{key}"] = value.detach().to(dtype)
        return routing

    # -- load ----------------------------------------------------------------------------------
    def load_checkpoint(self) -> Dict[str, Any]:
        """Load the HF checkpoint and the routing weights.

        Returns:
            Dict[str, Any]: ``"model"``: base weights (torchtune names) plus every routing weight, i.e.
            the model's full state dict except LoRA weights, loadable with ``strict=True`` into non-LoRA
            models; ``"adapter"`` when resuming a LoRA run: the adapter file's weights plus the routing
            sidecar beside it; recipe-state entries when ``should_load_recipe_state``.

        Raises:
            ValueError: naming every missing base key, unexpected key and shape mismatch, in the HF
                checkpoint, the routing sidecar or the adapter checkpoint.
        """
        state = self._base.load_checkpoint()
        base = state[training.MODEL_KEY]
        weights_dir = Path(self._base._checkpoint_paths[0]).parent
        sidecar = weights_dir / ROUTING_WEIGHTS_FNAME
        if sidecar.is_file():
            routing, routing_source = load_file(sidecar), str(sidecar)
        else:
            routing_source = f"routing initialised with seed {self._routing_init_seed}"
            dtype = next((v.dtype for v in base.values() if v.is_floating_point()), torch.float32)
            routing = self._initial_routing(dtype)
        problems = _key_problems(base, self._base_shapes, self._base_shapes, f"HF checkpoint in {weights_dir}")
        problems += _key_problems(routing, self._routing_shapes, self._routing_shapes, routing_source)
        _raise_if(problems, "Checkpoint does not match the configured model")
        state[training.MODEL_KEY] = {**base, **routing}

        if training.ADAPTER_KEY in state:
            adapter = state[training.ADAPTER_KEY]
            adapter_sidecar = Path(self._base._adapter_checkpoint).parent / ROUTING_WEIGHTS_FNAME
            if adapter_sidecar.is_file():
                adapter.update(load_file(adapter_sidecar))
            allowed = {**self._lora_shapes, **self._routing_shapes}
            source = f"adapter checkpoint {self._base._adapter_checkpoint}"
            _raise_if(_key_problems(adapter, allowed, (), source), "Adapter does not match the configured model")
        return state

    # -- save ----------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        state_dict: Dict[str, Any],
        epoch: int,
        intermediate_checkpoint: bool = False,
        adapter_only: bool = False,
    ) -> None:
        """Save base weights in HF layout and routing weights in ``epoch_{epoch}/routing.safetensors``.

        Routing keys are taken from ``state_dict["model"]`` and ``state_dict["adapter"]`` (whichever
        hold them) and removed from what the base checkpointer receives, which then writes, as
        ``FullModelHFCheckpointer`` does: model shards + index (unless ``adapter_only``),
        ``adapter_model.pt``/``.safetensors`` and ``adapter_config.json`` when given, the non-weight
        files of ``checkpoint_dir`` (``config.json``, tokenizer files…), and
        ``recipe_state/recipe_state.pt`` when ``intermediate_checkpoint``. ``load_checkpoint`` must
        have been called first (as for the base checkpointer). ``state_dict`` itself is not modified.

        Args:
            state_dict (Dict[str, Any]): ``"model"`` (full state dict, LoRA merged), ``"adapter"``,
                ``"adapter_config"`` and recipe-state entries, as torchtune recipes build it.
            epoch (int): epoch number (folder ``epoch_{epoch}``).
            intermediate_checkpoint (bool): also save the recipe state.
            adapter_only (bool): save adapter (and routing) weights but no model weights.

        Raises:
            ValueError: if model or adapter weights do not match the configured model, or if a routed
                model's routing weights are in neither entry (e.g. an ``adapter_only`` save whose adapter
                dict came from torchtune's ``get_adapter_state_dict``; use
                :func:`routed_adapter_state_dict`).
        """
        to_save = dict(state_dict)
        routing: Dict[str, torch.Tensor] = {}
        problems: List[str] = []
        if training.MODEL_KEY in state_dict:
            model_sd = state_dict[training.MODEL_KEY]
            routing.update({k: v for k, v in model_sd.items() if is_routing_key(k)})
            to_save[training.MODEL_KEY] = {k: v for k, v in model_sd.items() if not is_routing_key(k)}
            if not adapter_only:
                problems += _key_problems(
                    to_save[training.MODEL_KEY], self._base_shapes, self._base_shapes, "model state dict"
                )
        if training.ADAPTER_KEY in state_dict:
            adapter_sd = state_dict[training.ADAPTER_KEY]
            routing.update({k: v for k, v in adapter_sd.items() if is_routing_key(k)})
            to_save[training.ADAPTER_KEY] = {k: v for k, v in adapter_sd.items() if not is_routing_key(k)}
            problems += _key_problems(to_save[training.ADAPTER_KEY], self._lora_shapes, (), "adapter state dict")
        if self._routing_shapes and not routing:
            problems.append(
                "no routing weights in 'model' or 'adapter' (an adapter dict from torchtune's "
                "get_adapter_state_dict lacks them; build it with routed_adapter_state_dict)"
            )
        else:
            problems += _key_problems(routing, self._routing_shapes, self._routing_shapes, "routing weights")
        _raise_if(problems, f"Cannot save epoch {epoch}: state dict does not match the configured model")

        self._base.save_checkpoint(
            to_save, epoch=epoch, intermediate_checkpoint=intermediate_checkpoint, adapter_only=adapter_only
        )
        if routing:
            path = self._output_dir / f"epoch_{epoch}" / ROUTING_WEIGHTS_FNAME
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in routing.items()}, path, metadata={"format": "pt"})
