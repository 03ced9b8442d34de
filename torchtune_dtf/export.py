"""Export a trained checkpoint as a Hugging Face ``transformers`` folder.

    python -m torchtune_dtf.export --config configs/quickstart/generate_recommended_0_81_linear_smollm2.yaml \\
        --checkpoint-dir quickstart_work/recommended_0_81_linear/epoch_0 --out exported/recommended_0_81_linear

``--config`` is the config whose ``model`` section is what you deploy (an eval or generate config: its student
rule), ``--checkpoint-dir`` an ``epoch_N`` folder the recipe saved (default: the config's
``checkpointer.checkpoint_dir``); ``key=value`` overrides apply as for ``tune run``. A LoRA run's checkpoint is
already merged and loads into the builder's non-LoRA twin. What comes out:

* **a routed model** (any routed layer, or a dropped layer with a learned skip bias or linear map, which stock Qwen2 cannot
  express): ``config.json`` (``model_type: torchtune_dtf_routed_qwen2``, the torchtune ``model`` section under
  ``torchtune_model``, an ``auto_map``), ``model.safetensors`` (backbone and routing weights, one state dict),
  two small files that re-export :mod:`torchtune_dtf.hf.modeling` (so loading needs ``pip install
  torchtune_dtf`` and ``trust_remote_code=True``), the tokenizer and generation config, and a model card;
* **a model with no routing left** (dense, or layer dropping without skip updates): a stock ``Qwen2ForCausalLM``
  folder with the dropped layers removed and renumbered, no remote code.

Unless ``--no-check``, the folder is loaded back with ``AutoModelForCausalLM`` and its logits compared with the
torchtune model's on a few held-in token rows; the largest difference is printed and a mismatch is an error.
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open

from torchtune_dtf import closed_form
from torchtune_dtf.models.model_config import model_variant
from torchtune_dtf.evaluation.routing_report import command_line_overrides, load_config, load_trained, trained_model_config
from torchtune_dtf.modules import DroppedLayer, is_routing_key
from torchtune_dtf.training.checkpointer import hf_weight_files

#: Files copied from the checkpoint folder (or the tokenizer's folder) when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")
CONFIGURATION_FILE, MODELING_FILE = "configuration_torchtune_dtf.py", "modeling_torchtune_dtf.py"
_SHIM = '''"""{what} of a routed model exported by torchtune_dtf: this file only re-exports the package's class, so
loading this folder with trust_remote_code=True needs `pip install torchtune_dtf` ({version})."""
from torchtune_dtf.hf.modeling import {names}  # noqa: F401
'''
#: Largest |Δ logit| between the exported folder and the torchtune model that the check accepts (fp32 weights).
CHECK_ATOL = 1e-4


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"this folder was written by version {version('torchtune_dtf')}"
    except PackageNotFoundError:
        return "from a source checkout"


def _checkpoint_dtype(checkpoint_dir: Path) -> torch.dtype:
    """The dtype of the checkpoint's first floating-point weight (the export keeps it)."""
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with safe_open(checkpoint_dir / hf_weight_files(checkpoint_dir)[0], framework="pt") as f:
        for key in f.keys():
            kind = f.get_slice(key).get_dtype()
            if kind in names:
                return names[kind]
    return torch.float32


def _dropped_layer_indices(model: torch.nn.Module) -> List[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer, DroppedLayer)]


def architecture_fields(model: torch.nn.Module) -> Dict[str, int]:
    """The standard ``PretrainedConfig`` shape fields of a torchtune decoder, read off the built model (a tiny or
    size-named builder's config section does not spell them out)."""
    attn = next(layer.attn for layer in model.layers if getattr(layer, "attn", None) is not None)
    mlp = next(layer.mlp for layer in model.layers if getattr(layer, "mlp", None) is not None)
    return {
        "vocab_size": model.tok_embeddings.num_embeddings, "hidden_size": attn.embed_dim,
        "num_hidden_layers": len(model.layers), "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads, "intermediate_size": mlp.w1.out_features,
        "max_position_embeddings": model.max_seq_len,
    }


def has_routing(model: torch.nn.Module) -> bool:
    """True when a stock Qwen2 cannot compute what ``model`` computes: a routing weight (router, predictor, skip
    bias or linear map) or a routed layer."""
    from torchtune_dtf.modules import RoutedSelfAttentionLayer

    return any(is_routing_key(k) for k in model.state_dict()) or any(
        isinstance(m, RoutedSelfAttentionLayer) for m in model.modules())


def stock_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """HF ``Qwen2ForCausalLM`` weights of a model without routing: the dropped layers' weights removed and the
    kept layers renumbered 0…n−1 (torchtune's own Qwen2 conversion)."""
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    dropped = set(_dropped_layer_indices(model))
    kept = [i for i in range(len(model.layers)) if i not in dropped]
    renumber = {old: new for new, old in enumerate(kept)}
    state = {}
    for key, value in model.state_dict().items():
        match = re.match(r"layers\.(\d+)\.(.*)", key)
        if match is None:
            state[key] = value
        elif int(match.group(1)) in renumber:
            state[f"layers.{renumber[int(match.group(1))]}.{match.group(2)}"] = value
    from torchtune.modules import TiedLinear

    shape = architecture_fields(model)
    return qwen2_tune_to_hf(
        state, num_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"],
        dim=shape["hidden_size"], tie_word_embeddings=isinstance(model.output, TiedLinear),
    )


def _stock_config(checkpoint_dir: Path, num_layers: int, kept: List[int], dtype: torch.dtype) -> Dict[str, Any]:
    source = checkpoint_dir / "config.json"
    if not source.is_file():
        raise ValueError(f"{source} is missing: a stock export starts from the checkpoint's own config.json")
    hf = json.loads(source.read_text())
    if hf.get("num_hidden_layers") != num_layers:
        raise ValueError(f"{source} has num_hidden_layers {hf.get('num_hidden_layers')}, the model {num_layers}")
    hf["num_hidden_layers"] = len(kept)
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = [hf["layer_types"][i] for i in kept]
    if isinstance(hf.get("max_window_layers"), int):
        hf["max_window_layers"] = min(hf["max_window_layers"], len(kept))
    hf["torch_dtype"] = hf["dtype"] = str(dtype).removeprefix("torch.")
    hf["architectures"] = ["Qwen2ForCausalLM"]
    return hf


def _copy_tokenizer(cfg: DictConfig, checkpoint_dir: Path, out: Path) -> List[str]:
    """Copy the HF tokenizer and generation files from the checkpoint folder, else from the folder of the config's
    tokenizer files; returns the names copied."""
    sources = [checkpoint_dir]
    tokenizer_path = OmegaConf.select(cfg, "tokenizer.path")
    if tokenizer_path:
        sources.append(Path(str(tokenizer_path)).parent)
    copied = []
    for name in TOKENIZER_FILES:
        for folder in sources:
            if (folder / name).is_file():
                shutil.copy(folder / name, out / name)
                copied.append(name)
                break
    return copied


def write_hf_tokenizer(cfg: DictConfig, out: Path) -> List[str]:
    """Write ``tokenizer.json`` / ``tokenizer_config.json`` for a Qwen2.5 tokenizer given only as ``vocab.json`` +
    ``merges.txt`` (what :mod:`torchtune_dtf.offline.tokenizer_assets` writes), so ``AutoTokenizer`` loads the
    folder: a ``Qwen2TokenizerFast`` of the same files with the torchtune tokenizer's special tokens at its ids.
    Returns the names written; raises ``ValueError`` when the two tokenizers would disagree on an id."""
    from tokenizers import AddedToken
    from torchtune import config as tt_config
    from transformers import Qwen2TokenizerFast

    if not (OmegaConf.select(cfg, "tokenizer.path") and OmegaConf.select(cfg, "tokenizer.merges_file")):
        raise ValueError("the checkpoint has no tokenizer_config.json / tokenizer.json and the config's tokenizer is "
                         "not a vocab.json + merges.txt pair: copy the HF tokenizer files into the checkpoint folder")
    torchtune_tokenizer = tt_config.instantiate(cfg.tokenizer)
    special = sorted(torchtune_tokenizer.special_tokens.items(), key=lambda item: item[1])
    by_id = {token_id: token for token, token_id in special}
    hf = Qwen2TokenizerFast(
        vocab_file=str(cfg.tokenizer.path), merges_file=str(cfg.tokenizer.merges_file), unk_token=None,
        bos_token=None, eos_token=None, pad_token=None, clean_up_tokenization_spaces=False,
    )
    hf.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                         for t, _ in special]})
    wrong = [t for t, i in special if hf.convert_tokens_to_ids(t) != i]
    if wrong:
        raise ValueError(f"the HF tokenizer would give {wrong[:3]} other ids than the torchtune tokenizer")
    hf.eos_token = by_id[torchtune_tokenizer.eos_id]
    hf.pad_token = by_id[torchtune_tokenizer.pad_id]
    hf.model_max_length = int(OmegaConf.select(cfg, "model.max_seq_len", default=None) or hf.model_max_length)
    return [Path(name).name for name in hf.save_pretrained(out)]


def training_provenance(checkpoint_dir: Path) -> Dict[str, Any]:
    """What the recipe recorded about the run that saved ``checkpoint_dir`` (an ``epoch_N`` folder): the base model,
    the training config, the step, and the end-of-training summary it logged (validation losses of the student and
    the teacher on the run's validation data). Empty for a folder the recipe did not write."""
    from torchtune_dtf.evaluation.metric_logs import read_metric_logs

    provenance: Dict[str, Any] = {}
    manifest = checkpoint_dir / "checkpoint.json"
    if manifest.is_file():
        provenance["global_step"] = json.loads(manifest.read_text()).get("global_step")
    run_config = checkpoint_dir.parent / "torchtune_config.yaml"
    if not run_config.is_file():
        return provenance
    trained = OmegaConf.load(run_config)
    provenance["training_config"] = str(run_config)
    provenance["base_model"] = OmegaConf.select(trained, "checkpointer.checkpoint_dir")
    provenance["data"] = OmegaConf.select(trained, "dataset.data_files") or OmegaConf.select(trained, "dataset.source")
    logger = OmegaConf.to_container(trained.metric_logger, resolve=True) if "metric_logger" in trained else {}
    if logger.get("log_dir") and not Path(logger["log_dir"]).is_dir():
        # a path relative to where training ran: the default ${output_dir}/logs sits beside the epoch folders
        logger["log_dir"] = str(checkpoint_dir.parent / Path(logger["log_dir"]).name)
    try:
        rows = read_metric_logs(logger)
    except (ValueError, KeyError, ImportError, OSError):
        rows = {}
    summary = {k.removeprefix("summary/"): v for row in rows.values() for k, v in row.items() if k.startswith("summary/")}
    provenance["summary"] = {k: summary[k] for k in ("steps", "tokens", "train_lm_loss", "val_lm_loss_student",
                                                     "val_lm_loss_teacher") if k in summary}
    return provenance


def model_card(*, config_path: str, checkpoint_dir: Path, model_cfg: Mapping[str, Any], routed: bool,
               dropped: List[int], flop_ratio: Optional[float], notes: Optional[str],
               provenance: Optional[Mapping[str, Any]] = None) -> str:
    """The exported folder's ``README.md``: what the model is, how it was made and how to load it."""
    variant = model_variant(model_cfg)
    lines = [
        "---", "library_name: transformers", "tags: [torchtune_dtf, conditional-compute, routed]" if routed else
        "tags: [torchtune_dtf, layer-dropping]", "---", "",
        f"# {'Routed' if routed else 'Layer-dropped' if dropped else 'Dense'} Qwen2 model from torchtune_dtf", "",
        f"- made by: `python -m torchtune_dtf.export --config {config_path}` from `{checkpoint_dir}`",
        f"- variant: `{variant}`; {len(model_cfg.get('routed_layers') or []) if isinstance(model_cfg.get('routed_layers'), list) else model_cfg.get('routed_layers', 'no')} routed layers"
        + (f" at capacity {model_cfg.get('capacity')}" if routed else ""),
        f"- dropped layers (run on no token): {dropped or 'none'}",
    ]
    if routed:
        lines += [
            f"- deployed student rule: `{model_cfg.get('student_routing_mode')}`"
            + (f", window {model_cfg.get('student_window')}" if model_cfg.get("student_window") else "")
            + (f", threshold {model_cfg.get('student_threshold')}" if model_cfg.get("student_threshold") is not None else ""),
            f"- routed layers: {model_cfg.get('routed_layers')}",
        ]
    if flop_ratio is not None:
        lines.append(f"- forward FLOPs relative to the dense model (closed form, "
                     f"{model_cfg.get('max_seq_len')} tokens): {flop_ratio:.3f}")
    provenance = provenance or {}
    if provenance.get("base_model"):
        lines.append(f"- base model: `{provenance['base_model']}`")
    if provenance.get("training_config"):
        lines.append(f"- trained by `torchtune_dtf/recipes/routed_finetune.py` with `{provenance['training_config']}` "
                     f"(step {provenance.get('global_step')}, data `{provenance.get('data')}`)")
    summary = provenance.get("summary") or {}
    if "val_lm_loss_student" in summary:
        lines.append(f"- validation loss at the end of training (the run's own validation data, nats/token): "
                     f"student (deployed) {summary['val_lm_loss_student']:.3f}"
                     + (f", teacher {summary['val_lm_loss_teacher']:.3f}" if "val_lm_loss_teacher" in summary else ""))
    lines += ["", "## Load it", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if routed:
        lines += [
            "# needs `pip install torchtune_dtf`: the modeling code is the package's (these files re-export it)",
            'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER", trust_remote_code=True)',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")',
            'out = model.generate(**tokenizer(["Once upon a time"], return_tensors="pt"), max_new_tokens=32, do_sample=False)',
            "print(model.executed_fractions())  # per routed layer: share of the tokens that ran it",
        ]
    else:
        lines += [
            "# a stock Qwen2ForCausalLM: no remote code",
            'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")',
        ]
    lines += ["```", "", "Score it offline with lm-eval's `hf` backend:", "", "```",
              "lm_eval --model hf --model_args pretrained=THIS_FOLDER" + (",trust_remote_code=True" if routed else "")
              + " --tasks YOUR_TASKS", "```", ""]
    if routed:
        lines += ["Generation supports greedy decoding and sampling, batched with left padding; beam search and "
                  "assisted decoding are refused (the selective KV cache cannot be reordered).", ""]
    lines += ["## Measured", "", notes.strip() if notes else "Nothing measured against the dense model was given "
              "to the export (`--notes FILE` adds it here, e.g. the side-by-side report of "
              "`python -m torchtune_dtf.evaluation.routing_report`).", ""]
    lines += ["## Upload", "", "```", "huggingface-cli upload YOUR_NAME/YOUR_MODEL THIS_FOLDER .", "```", ""]
    return "\n".join(lines)


def refuse_unrepresentable(model_cfg: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming what an exported model could not reproduce outside torchtune."""
    if model_cfg.get("student_routing_mode") == "topk":
        raise ValueError(
            "student_routing_mode 'topk' ranks a prompt's tokens against each other and a decode step's rows "
            "against the other rows of the batch, so what a token runs depends on how a caller batches it (lm-eval "
            "and generate batch as they please): deploy a causal student, model.student_routing_mode=window_topk "
            "(with student_window) or threshold (with student_threshold)")
    if model_cfg.get("allow_noncausal_student_topk"):
        raise ValueError("allow_noncausal_student_topk is True: that student is not causal (an analysis setting), "
                         "set it False to export")


def export(cfg: DictConfig, checkpoint_dir: Path, out: Path, *, config_path: str, notes: Optional[str] = None,
           check: bool = True) -> Dict[str, Any]:
    """Write the export of ``checkpoint_dir`` (loaded into ``cfg``'s model) into ``out``; returns a summary."""
    checkpoint_dir = Path(checkpoint_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: choose a new folder")
    model_cfg = trained_model_config(cfg)
    refuse_unrepresentable(model_cfg)
    model = load_trained(cfg, checkpoint_dir)
    dtype = _checkpoint_dtype(checkpoint_dir)
    routed = has_routing(model)
    dropped = _dropped_layer_indices(model)
    out.mkdir(parents=True, exist_ok=True)
    try:
        flop_ratio = closed_form.model_config_flop_ratio(model_cfg, int(model_cfg["max_seq_len"]))
    except (KeyError, ValueError):
        flop_ratio = None
    if routed:
        from torchtune_dtf.hf.modeling import RoutedQwen2Config, RoutedQwen2ForCausalLM

        source = json.loads((checkpoint_dir / "config.json").read_text()) if (checkpoint_dir / "config.json").is_file() else {}
        hf_config = RoutedQwen2Config(
            torchtune_model=model_cfg, torch_dtype=str(dtype).removeprefix("torch."),
            bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"),
            pad_token_id=source.get("pad_token_id"), architectures=["RoutedQwen2ForCausalLM"],
            **architecture_fields(model),
            auto_map={"AutoConfig": f"{CONFIGURATION_FILE[:-3]}.RoutedQwen2Config",
                      "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.RoutedQwen2ForCausalLM"},
        )
        hf_model = RoutedQwen2ForCausalLM(hf_config)
        hf_model.model.load_state_dict(model.state_dict(), strict=True)
        # Once a folder was loaded with trust_remote_code, transformers marks our classes for auto-class saving and
        # would copy this package's modeling.py into the folder and point auto_map at that copy; the folder's
        # code must stay the shims below, which import the installed package.
        hf_model._auto_class = hf_config._auto_class = None
        hf_model.to(dtype).save_pretrained(out, safe_serialization=True)
        (out / CONFIGURATION_FILE).write_text(_SHIM.format(what="Configuration", version=_package_version(),
                                                          names="RoutedQwen2Config"))
        (out / MODELING_FILE).write_text(_SHIM.format(what="Modeling code", version=_package_version(),
                                                     names="RoutedQwen2ForCausalLM, SelectiveCache"))
    else:
        from safetensors.torch import save_file

        kept = [i for i in range(len(model.layers)) if i not in set(dropped)]
        hf_state = {k: v.to(dtype).contiguous() for k, v in stock_state_dict(model).items()}
        save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})
        stock = _stock_config(checkpoint_dir, len(model.layers), kept, dtype)
        (out / "config.json").write_text(json.dumps(stock, indent=2) + "\n")
    copied = _copy_tokenizer(cfg, checkpoint_dir, out)
    if "tokenizer_config.json" not in copied:
        copied = sorted(set(copied) | set(write_hf_tokenizer(cfg, out)))
    (out / "README.md").write_text(model_card(config_path=config_path, checkpoint_dir=checkpoint_dir,
                                              model_cfg=model_cfg, routed=routed, dropped=dropped,
                                              flop_ratio=flop_ratio, notes=notes,
                                              provenance=training_provenance(checkpoint_dir)))
    summary = {"out": str(out), "kind": "routed (remote code)" if routed else "stock Qwen2ForCausalLM",
               "dropped_layers": dropped, "dtype": str(dtype), "tokenizer_files": copied}
    if check:
        summary["max_abs_logit_difference"] = check_export(model, out, routed)
    return summary


def check_export(model: torch.nn.Module, out: Path, routed: bool) -> float:
    """Load ``out`` with ``AutoModelForCausalLM`` and compare its logits with ``model``'s on two rows of 32 tokens;
    returns the largest |Δ| (in fp32) and raises if it exceeds :data:`CHECK_ATOL`."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=routed, dtype=torch.float32).eval()
    vocab = model.tok_embeddings.num_embeddings
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.float()(tokens)
        theirs = exported(tokens).logits
    difference = float((ours - theirs).abs().max())
    if difference > CHECK_ATOL:
        raise RuntimeError(f"the exported folder {out} computes different logits (max |Δ| = {difference:.3g} > "
                           f"{CHECK_ATOL}): do not use it")
    return difference


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m torchtune_dtf.export", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the deployed config (eval / generate): its model section")
    parser.add_argument("--checkpoint-dir", help="an epoch_N folder (default: the config's checkpointer.checkpoint_dir)")
    parser.add_argument("--out", required=True, help="a new folder to write")
    parser.add_argument("--notes", help="a markdown file of measured results for the model card")
    parser.add_argument("--no-check", action="store_true", help="skip loading the folder back and comparing logits")
    args, overrides = command_line_overrides(parser, argv)
    cfg = load_config(Path(args.config), overrides)
    checkpoint_dir = Path(args.checkpoint_dir or cfg.checkpointer.checkpoint_dir)
    notes = Path(args.notes).read_text() if args.notes else None
    summary = export(cfg, checkpoint_dir, Path(args.out), config_path=args.config, notes=notes, check=not args.no_check)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        sys.exit(1)
