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
  ``FullModelHFCheckpointer`` and ``transformers`` read), the routing weights into ``routing.safetensors``
  beside them, the recipe state into ``recipe_state.pt`` in the same folder. Adapter files hold LoRA
  weights only, and when a LoRA run resumes from ``epoch_{N}/adapter_model.pt`` the routing sidecar beside
  it is added to the ``"adapter"`` entry.
* **atomic** — a save is written into ``output_dir/.saving/epoch_{N}``, closed with ``checkpoint.json``
  (run id, step, size of every file) and only then renamed to ``epoch_{N}`` (the previous one is moved
  aside first and deleted after), so a kill at any moment leaves the last complete checkpoint loadable.
  Loading checks every listed file's size, and that the recipe state and routing sidecar carry the
  manifest's run id and step; resume takes the newest checkpoint only if it belongs to the run named in
  ``output_dir/run.json`` (see :meth:`RoutedHFCheckpointer.begin_run`).
* **never invents weights** — a folder saved from a routed model without its ``routing.safetensors`` is an
  error; fresh routing (logged) is only for a stock dense checkpoint.

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

import copy
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torchtune import config, training, utils
from torchtune.modules.peft import get_adapter_params, get_adapter_state_dict
from torchtune.training.checkpointing._utils import RECIPE_STATE_DIRNAME, SAFETENSOR_INDEX_FNAME, TORCH_INDEX_FNAME

from torchtune_dtf.atomic_write import atomic_write_text
from torchtune_dtf.modules import ROUTING_MODULE_NAMES, is_routing_key

#: Name of the routing-weights sidecar written beside the model (or adapter) files of each epoch.
ROUTING_WEIGHTS_FNAME = "routing.safetensors"
#: Written last into every checkpoint folder: the run and step it holds and the size of each of its files.
MANIFEST_FNAME = "checkpoint.json"
#: The recipe state (optimizer, step, data position) lives inside the checkpoint folder it belongs to.
RECIPE_STATE_FNAME = "recipe_state.pt"
#: ``output_dir/run.json`` names the run that owns ``output_dir``; resume only takes that run's checkpoints.
RUN_FNAME = "run.json"
#: Recipe-state entries that identify a checkpoint.
RUN_ID_KEY, STEP_KEY = "run_id", "global_step"
_STAGING = ".saving"  # a save is written here, then renamed into place
_REPLACED = ".replaced_"  # the previous epoch_N while the new one is renamed into place

log = utils.get_logger("INFO")

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


def _epoch_of(name: str, prefix: str = "epoch_") -> Optional[int]:
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def checkpoint_folders(output_dir: Path) -> Dict[int, Path]:
    """Complete checkpoint folders under ``output_dir`` by epoch number.

    A save renames the finished folder into place (see :meth:`RoutedHFCheckpointer.save_checkpoint`), so an
    ``epoch_N`` folder is complete. A kill between moving the previous ``epoch_N`` aside and renaming the new
    one in leaves only ``.replaced_epoch_N``: that one is then the last complete checkpoint of epoch N.
    """
    folders: Dict[int, Path] = {}
    for path in output_dir.glob(f"{_REPLACED}epoch_*"):
        if path.is_dir() and _epoch_of(path.name, f"{_REPLACED}epoch_") is not None:
            folders[_epoch_of(path.name, f"{_REPLACED}epoch_")] = path
    for path in output_dir.glob("epoch_*"):
        if path.is_dir() and _epoch_of(path.name) is not None:
            folders[_epoch_of(path.name)] = path
    return folders


def read_manifest(folder: Path) -> Optional[Dict[str, Any]]:
    """The manifest of a checkpoint folder, None for a folder without one (a stock HF checkpoint)."""
    path = folder / MANIFEST_FNAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot read checkpoint manifest {path}: {err}") from err


def verify_files(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest lists is there with the size it was written with (names the first bad file)."""
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file() and name == ROUTING_WEIGHTS_FNAME:
            raise ValueError(
                f"{path} is missing: {folder} was saved from a routed model, and its trained routing weights are "
                "only in that file. Restore it; fresh routing is only for a stock dense checkpoint."
            )
        if not path.is_file():
            raise ValueError(f"Checkpoint file {path} is missing (listed in {folder / MANIFEST_FNAME})")
        if path.stat().st_size != size:
            raise ValueError(
                f"Checkpoint file {path} is truncated or altered: {path.stat().st_size} bytes, written with {size}"
            )


def check_safetensors_complete(path: Path) -> None:
    """A truncated safetensors file fails here, naming the file, instead of deep inside safetensors."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError("header runs past the end of the file")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a complete safetensors file ({err})") from err
    if 8 + header_len + end > size:
        raise ValueError(f"{path} is truncated: {size} bytes, its header needs {8 + header_len + end}")


def hf_weight_files(folder: Path) -> List[str]:
    """The model weight files of an HF checkpoint folder, as ``checkpoint_files`` names them.

    A sharded checkpoint names its shards in its index (``model.safetensors.index.json`` or
    ``pytorch_model.bin.index.json``; ``tune download`` leaves one, and every save of this checkpointer writes one
    beside its ``model-0000i-of-0000n`` shards); an unsharded stock checkpoint is ``model.safetensors`` (or
    ``pytorch_model.bin``); shards without an index are taken in name order. The index comes first because a
    folder may hold more ``*.safetensors`` files than the model's (``routing.safetensors``, adapters).

    Raises:
        ValueError: naming the folder, when it holds none of these.
    """
    for index in (SAFETENSOR_INDEX_FNAME, TORCH_INDEX_FNAME):
        if (folder / index).is_file():
            try:
                return sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as err:
                raise ValueError(f"Cannot read the shard index {folder / index}: {err!r}") from err
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [single]
    for pattern in ("model-*.safetensors", "model-*.bin"):
        shards = sorted(path.name for path in folder.glob(pattern))
        if shards:
            return shards
    raise ValueError(
        f"{folder} holds no model weights: no {SAFETENSOR_INDEX_FNAME} or {TORCH_INDEX_FNAME}, no model.safetensors or "
        "pytorch_model.bin, no model-*.safetensors shards (is it an HF checkpoint folder or an epoch_N folder?)"
    )


def recover_interrupted_save(output_dir: Path) -> None:
    """Undo what a killed save left: its staging folder, and a previous ``epoch_N`` moved aside (put back
    when the new one never arrived, deleted when it did). Concurrent ranks may race here; both outcomes agree."""
    shutil.rmtree(output_dir / _STAGING, ignore_errors=True)
    for replaced in output_dir.glob(f"{_REPLACED}epoch_*"):
        target = output_dir / replaced.name[len(_REPLACED):]
        try:
            if target.exists():
                shutil.rmtree(replaced)
            else:
                os.replace(replaced, target)
        except FileNotFoundError:
            pass


def read_run_id(output_dir: Path) -> Optional[str]:
    path = output_dir / RUN_FNAME
    return json.loads(path.read_text())[RUN_ID_KEY] if path.is_file() else None


def resume_folder(output_dir: Path) -> Path:
    """The checkpoint folder a resume continues from: the newest complete one, which must belong to the run
    that owns ``output_dir`` (``run.json``) and hold the files its manifest lists."""
    recover_interrupted_save(output_dir)
    run_id = read_run_id(output_dir)
    if run_id is None:
        raise ValueError(
            f"Asked to resume, but {output_dir} has no {RUN_FNAME}: no run of this version started there "
            f"(checkpoints written before atomic checkpoints cannot be verified). Start a new run from its weights "
            f"(checkpointer.checkpoint_dir=<its epoch_N folder>) in a fresh output_dir."
        )
    folders = checkpoint_folders(output_dir)
    if not folders:
        raise ValueError(f"Asked to resume, but {output_dir} holds no complete epoch_N checkpoint of run {run_id}")
    folder = folders[max(folders)]
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"Asked to resume from {folder}, but it has no {MANIFEST_FNAME} and cannot be verified")
    if manifest.get(RUN_ID_KEY) != run_id:
        raise ValueError(
            f"The newest checkpoint {folder} belongs to run {manifest.get(RUN_ID_KEY)}, not to run {run_id} that "
            f"last started in {output_dir} ({RUN_FNAME}). Resuming it would mix two runs: remove {folder} (or "
            "resume into the output_dir of the run it belongs to), or start a new run in a fresh output_dir."
        )
    verify_files(folder, manifest)
    return folder


def saved_dtype_name(state_dict: Mapping[str, Any]) -> Optional[str]:
    """Hugging Face's name (``"float32"``, ``"bfloat16"``…) of the floating dtype holding most elements of
    ``state_dict``; None without floating tensors."""
    counts: Dict[torch.dtype, int] = {}
    for value in state_dict.values():
        if torch.is_tensor(value) and value.is_floating_point():
            counts[value.dtype] = counts.get(value.dtype, 0) + value.numel()
    return str(max(counts, key=counts.get)).removeprefix("torch.") if counts else None


def write_saved_dtype(config_json: Path, dtype_name: str) -> None:
    """Make ``config.json`` state the dtype its weights were saved in.

    The base checkpointer copies ``config.json`` from ``checkpoint_dir`` as it is, so an fp32 run from a bf16
    release saved fp32 weights under ``"torch_dtype": "bfloat16"``, and transformers (``torch_dtype="auto"``)
    would load them as bf16. Sets each of ``torch_dtype`` (transformers < 4.56) and ``dtype`` (its successor)
    that the file has, ``torch_dtype`` when it has neither (every transformers version reads it).
    """
    hf_config = json.loads(config_json.read_text())
    keys = [key for key in ("torch_dtype", "dtype") if key in hf_config] or ["torch_dtype"]
    if all(hf_config.get(key) == dtype_name for key in keys):
        return
    hf_config.update({key: dtype_name for key in keys})
    config_json.write_text(json.dumps(hf_config, indent=2) + "\n")


class _DropStagingSizeMessages(logging.Filter):
    """The base checkpointer logs every file it writes with its path in the staging folder, which is renamed a
    moment later (and left ``.saving`` on the console); :meth:`RoutedHFCheckpointer.save_checkpoint` logs the
    final folder and sizes once instead."""

    PREFIXES = ("Model checkpoint of size", "Adapter checkpoint of size", "Recipe checkpoint of size")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.PREFIXES)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RoutedHFCheckpointer:
    """HF-format checkpointer for the dense/MoD/SDT/STT Qwen2 models of this package (and LoRA twins).

    Args:
        checkpoint_dir (str): directory of the HF checkpoint (``config.json`` + weights), e.g. what
            ``tune download Qwen/Qwen2.5-0.5B`` leaves, or an ``epoch_N`` folder saved by this class.
        checkpoint_files (Union[List[str], Dict[str, str]]): weight files, as for
            ``FullModelHFCheckpointer`` (a list, or ``filename_format``/``max_filename``).
        model_type (str): must be ``"QWEN2"`` (the key mapping of every model built here).
        output_dir (str): where ``epoch_{N}`` checkpoint folders and ``run.json`` are written.
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

        # Built once, on the meta device: the shapes to check every loaded file against, and the routing modules
        # to initialise when a checkpoint has none.
        self._meta_model = meta_model = self._build_meta_model()
        shapes = {key: value.shape for key, value in meta_model.state_dict().items()}
        self._meta_attn = meta_model.layers[0].attn
        adapter_keys = set(get_adapter_params(meta_model))
        self._routing_shapes: _Shapes = {k: s for k, s in shapes.items() if is_routing_key(k)}
        self._lora_shapes: _Shapes = {k: s for k, s in shapes.items() if k in adapter_keys and not is_routing_key(k)}
        self._base_shapes: _Shapes = {
            k: s for k, s in shapes.items() if k not in self._routing_shapes and k not in self._lora_shapes
        }

        # A resume takes the adapter and the recipe state from the newest complete checkpoint folder of this run,
        # so neither is a constructor argument (torchtune's checkpointers take them as paths).
        adapter_checkpoint: Optional[str] = None
        recipe_checkpoint: Optional[str] = None
        self._resume_folder: Optional[Path] = None
        if should_load_recipe_state or resume_from_checkpoint:
            # Every file comes from the newest complete checkpoint of this run (torchtune itself would take the
            # largest epoch folder whatever run wrote it, and a recipe state shared by all epochs).
            self._resume_folder = resume_folder(Path(output_dir))
            name = self._resume_folder.name
            recipe_checkpoint = f"{name}/{RECIPE_STATE_FNAME}"
            if self._lora_shapes:
                adapter_checkpoint = f"{name}/adapter_model.pt"
            else:
                try:
                    files = hf_weight_files(self._resume_folder)
                except ValueError as err:
                    raise ValueError(f"Asked to resume, but {err}") from err
                checkpoint_files = [f"{name}/{f}" for f in files]
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
        routing = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._routing_init_seed)
            for name, module in self._meta_model.named_modules():
                if name.rsplit(".", 1)[-1] not in ROUTING_MODULE_NAMES:
                    continue
                module = copy.deepcopy(module).to_empty(device="cpu")  # the meta model itself stays untouched
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
        weights_dir = Path(self._base._checkpoint_paths[0]).parent
        manifest = read_manifest(weights_dir)
        if manifest is not None:
            verify_files(weights_dir, manifest)
        for path in self._base._checkpoint_paths:
            if Path(path).suffix == ".safetensors":
                check_safetensors_complete(Path(path))
        config_problems = self._config_json_problems()
        try:
            state = self._base.load_checkpoint()
        except Exception as err:  # e.g. q/k conversion with edited head counts: the cause is config.json
            _raise_if(config_problems, "Checkpoint config.json does not match the configured model")
            raise
        base = state[training.MODEL_KEY]
        sidecar = weights_dir / ROUTING_WEIGHTS_FNAME
        if sidecar.is_file():
            routing, routing_source = self._load_sidecar(sidecar, manifest), str(sidecar)
        else:  # a routed folder without it failed in verify_files
            routing_source = f"routing initialised with seed {self._routing_init_seed}"
            dtype = next((v.dtype for v in base.values() if v.is_floating_point()), torch.float32)
            routing = self._initial_routing(dtype)
            if routing:
                log.info(f"{weights_dir} is a dense checkpoint: {routing_source} ({len(routing)} tensors)")
        problems = config_problems + _key_problems(base, self._base_shapes, self._base_shapes, f"HF checkpoint in {weights_dir}")
        problems += _key_problems(routing, self._routing_shapes, self._routing_shapes, routing_source)
        _raise_if(problems, "Checkpoint does not match the configured model")
        state[training.MODEL_KEY] = {**base, **routing}

        if self._resume_folder is not None:
            self._check_identity(state, self._resume_folder)
        if training.ADAPTER_KEY in state:
            adapter = state[training.ADAPTER_KEY]
            adapter_dir = Path(self._base._adapter_checkpoint).parent
            adapter_sidecar = adapter_dir / ROUTING_WEIGHTS_FNAME
            if adapter_sidecar.is_file():
                adapter.update(self._load_sidecar(adapter_sidecar, read_manifest(adapter_dir)))
            elif self._routing_shapes:
                raise ValueError(f"{adapter_sidecar} is missing: the trained routing weights of this LoRA run are only in it")
            allowed = {**self._lora_shapes, **self._routing_shapes}
            source = f"adapter checkpoint {self._base._adapter_checkpoint}"
            _raise_if(_key_problems(adapter, allowed, (), source), "Adapter does not match the configured model")
        return state

    def _config_json_problems(self) -> List[str]:
        """``config.json`` must describe the configured model: the base checkpointer converts q/k with its
        head counts and copies it into every saved checkpoint, so an edited one would go through unseen."""
        hf, shapes = self._base._config, self._base_shapes
        embed = shapes["tok_embeddings.weight"]
        attn = self._meta_attn
        expected = {
            "vocab_size": embed[0],
            "hidden_size": embed[1],
            "num_hidden_layers": len({k.split(".")[1] for k in shapes if k.startswith("layers.")}),
            "num_attention_heads": attn.num_heads,
            "num_key_value_heads": attn.num_kv_heads,
            "intermediate_size": shapes["layers.0.mlp.w1.weight"][0],
        }
        path = self._base._checkpoint_dir / "config.json"
        problems = [
            f"{path}: {key} is {hf.get(key)!r}, the configured model has {value}"
            for key, value in expected.items()
            if hf.get(key) != value
        ]
        head_dim = hf.get("head_dim") or (hf.get("hidden_size") or 0) // max(hf.get("num_attention_heads") or 1, 1)
        if head_dim != attn.head_dim:
            problems.append(f"{path}: head_dim is {head_dim}, the configured model has {attn.head_dim}")
        return problems

    @staticmethod
    def _load_sidecar(path: Path, manifest: Optional[Mapping[str, Any]]) -> Dict[str, torch.Tensor]:
        """The routing sidecar, checked complete and (in a checkpoint folder) from the same run and step."""
        check_safetensors_complete(path)
        if manifest is not None:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
            for key in (RUN_ID_KEY, STEP_KEY):
                if key in manifest and meta.get(key) != str(manifest[key]):
                    raise ValueError(f"{path} holds {key} {meta.get(key)}, its checkpoint {manifest[key]}")
        return load_file(path)

    @staticmethod
    def _check_identity(state: Mapping[str, Any], folder: Path) -> None:
        """The recipe state must carry the run and step of the checkpoint folder it was loaded from."""
        manifest = read_manifest(folder)
        for key in (RUN_ID_KEY, STEP_KEY):
            if state.get(key) != manifest.get(key):
                raise ValueError(
                    f"{folder / RECIPE_STATE_FNAME} holds {key} {state.get(key)!r}, but {folder / MANIFEST_FNAME} "
                    f"says {manifest.get(key)!r}: the parts of this checkpoint come from different saves"
                )

    # -- save ----------------------------------------------------------------------------------
    def begin_run(self, run_id: str) -> None:
        """Record that ``run_id`` now owns ``output_dir``: resume takes only its checkpoints.

        Checkpoint folders of an earlier run stay where they are (they are never resumed); say so.
        """
        others = sorted(
            f"{p.name} (run {m.get(RUN_ID_KEY) if m else 'unknown'})"
            for p in checkpoint_folders(self._output_dir).values()
            for m in [read_manifest(p)]
        )
        if others:
            log.warning(f"{self._output_dir} holds checkpoints of an earlier run, which this run will replace or leave: {others}")
        atomic_write_text(self._output_dir / RUN_FNAME, json.dumps({RUN_ID_KEY: run_id}))

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
        ``recipe_state.pt`` when ``intermediate_checkpoint``, all into ``epoch_{epoch}`` atomically (module
        docstring); ``run_id`` and ``global_step`` entries are recorded in the manifest. ``load_checkpoint`` must
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

        identity = {key: state_dict[key] for key in (RUN_ID_KEY, STEP_KEY) if key in state_dict}
        # Before the base save: with intermediate_checkpoint it pops the model entry from what it is given.
        dtype_name = saved_dtype_name(to_save[training.MODEL_KEY]) if training.MODEL_KEY in to_save and not adapter_only else None

        # Everything is written into a staging folder and renamed into place when complete, so a kill at any
        # moment leaves the previous checkpoint whole.
        recover_interrupted_save(self._output_dir)
        staging = self._output_dir / _STAGING
        self._base._output_dir = staging
        size_messages = _DropStagingSizeMessages()
        base_logger = logging.getLogger("torchtune.utils._logging")  # torchtune's get_logger(): one logger for all
        base_logger.addFilter(size_messages)
        try:
            self._base.save_checkpoint(
                to_save, epoch=epoch, intermediate_checkpoint=intermediate_checkpoint, adapter_only=adapter_only
            )
        finally:
            self._base._output_dir = self._output_dir
            base_logger.removeFilter(size_messages)
        folder = staging / f"epoch_{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        if dtype_name is not None and (folder / "config.json").is_file():
            write_saved_dtype(folder / "config.json", dtype_name)
        recipe_state = staging / RECIPE_STATE_DIRNAME / "recipe_state.pt"
        if recipe_state.is_file():
            os.replace(recipe_state, folder / RECIPE_STATE_FNAME)
        if routing:
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in routing.items()},
                folder / ROUTING_WEIGHTS_FNAME,
                metadata={"format": "pt", **{k: str(v) for k, v in identity.items()}},
            )
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        manifest = {
            **identity,
            "epoch": epoch,
            "routing": bool(routing),
            "files": {str(p.relative_to(folder)): p.stat().st_size for p in files},
        }
        (folder / MANIFEST_FNAME).write_text(json.dumps(manifest, indent=2))
        for path in (*files, folder / MANIFEST_FNAME, folder):
            _fsync(path)

        final = self._output_dir / f"epoch_{epoch}"
        replaced = self._output_dir / f"{_REPLACED}epoch_{epoch}"
        if final.exists():
            os.replace(final, replaced)
        os.replace(folder, final)
        _fsync(self._output_dir)
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        total = sum(manifest["files"].values()) / 1024**3
        step = f"step {identity[STEP_KEY]}, " if STEP_KEY in identity else ""
        log.info(f"Saved {final} ({step}{total:.2f} GiB{f', weights in {dtype_name}' if dtype_name else ''})")
