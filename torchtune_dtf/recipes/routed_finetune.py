"""Fine-tune a routed (MoD / SDT / STT) or dense Qwen2.5 model with teacher–student routing.

    tune run torchtune_dtf/recipes/routed_finetune.py --config configs/stt_qwen0_5b.yaml
    tune run --nproc_per_node 8 torchtune_dtf/recipes/routed_finetune.py --config configs/stt_qwen0_5b.yaml

Every optimizer step s the recipe

1. computes β_ce(s), β_cu(s) from ``beta_schedule`` (spec §6) and passes them to the model in a
   teacher-mode :class:`RoutingContext`;
   The routed pass runs the teacher's selection, or on a scheduled share of steps the student's own
   (``scheduled_sampling``, DESIGN R2), so the backbone also trains on what inference executes;
2. forms L = L_LM + λ_pred·L_pred + λ_causal·L_causal + λ_g_reg·L_g_reg, each auxiliary loss averaged over
   tokens and then over routed layers (spec §4.8; paper §3.3.2);
3. steps AdamW with separate learning rates for the backbone, the predictors (PriorFFN/TPN), the predictive
   router (o_ce, m_cu) and the routers (causal routers, MoD router).

Single device or FSDP2 (torchrun), CPU or CUDA, fp32 or bf16, gradient accumulation and clipping,
packed datasets (``packed: True``: block-causal mask, positions restarting per document, DESIGN R3),
activation checkpointing and compile applied from outside the model (they cover routed layers because
those are ``TransformerSelfAttentionLayer`` s). Periodic validation reports the held-out LM loss of the
student (what users deploy) and of the teacher. Checkpoints carry the optimizer, step and data position,
so ``resume_from_checkpoint: True`` continues a crashed run where its last checkpoint left it.
"""

import sys
import time
from functools import partial
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import get_adapter_params, get_merged_lora_ckpt, set_trainable_params
from torchtune.recipe_interfaces import FTRecipeInterface
from tqdm import tqdm

from torchtune_dtf.modules.layers import RoutedSelfAttentionLayer
from torchtune_dtf.modules.routing_context import RoutingContext
from torchtune_dtf.training.checkpointer import routed_adapter_state_dict
from torchtune_dtf.training.routing_losses import auxiliary_losses, routing_metrics
from torchtune_dtf.data.collate import padded_collate_packed_dense
from torchtune_dtf.training.schedules import BetaSchedule, LossWeights, ScheduledSampling

log = utils.get_logger("INFO")

#: Parameter groups and the name fragments that put a parameter in them (anything else is backbone).
PARAM_GROUPS = {
    "predictors": ("transition.", "prior_ffn."),
    "predictive_router": ("predictive_router.",),
    "routers": ("causal_router.", "mod_router."),
}
REQUIRED_KEYS = (
    "model",
    "tokenizer",
    "checkpointer",
    "dataset",
    "seed",
    "shuffle",
    "batch_size",
    "epochs",
    "max_steps_per_epoch",
    "gradient_accumulation_steps",
    "clip_grad_norm",
    "optimizer",
    "learning_rates",
    "lr_scheduler",
    "loss",
    "freeze_base",
    "resume_from_checkpoint",
    "save_every_n_steps",
    "validation",
    "device",
    "dtype",
    "enable_activation_checkpointing",
    "compile",
    "metric_logger",
    "log_every_n_steps",
    "output_dir",
)
ROUTED_KEYS = ("routing_loss_weights", "beta_schedule", "scheduled_sampling")


def validate_recipe_config(cfg: DictConfig) -> None:
    """Fail before any work with one message naming every missing or misplaced key."""
    missing = [key for key in REQUIRED_KEYS if key not in cfg]
    variant = _variant_of(cfg.model) if "model" in cfg else None
    if variant not in (None, "dense"):
        missing += [key for key in ROUTED_KEYS if key not in cfg]
        for section, keys in (
            ("routing_loss_weights", ("pred", "causal", "g_reg", "warmup_steps")),
            ("beta_schedule", ("type", "beta_ce_start", "beta_ce_end", "beta_cu_start", "beta_cu_end", "warmup_steps")),
            ("scheduled_sampling", ("share_start", "share_end", "ramp_steps")),
        ):
            if section in cfg:
                missing += [f"{section}.{key}" for key in keys if key not in cfg[section]]
    if "learning_rates" in cfg:
        missing += [f"learning_rates.{g}" for g in ("backbone", *PARAM_GROUPS) if g not in cfg.learning_rates]
    if "validation" in cfg:
        missing += [f"validation.{k}" for k in ("every_n_steps", "max_batches") if k not in cfg.validation]
    if missing:
        raise ValueError(f"Config is missing required key(s): {', '.join(missing)}")


def _variant_of(cfg_model: DictConfig) -> str:
    """Variant named by the model config: ``variant:`` for the component builders, else the builder name
    (``stt_qwen2_5_0_5b``, ``lora_sdt_qwen2_5_tiny``…)."""
    if "variant" in cfg_model:
        return cfg_model.variant
    builder = cfg_model._component_.rsplit(".", 1)[-1]
    return builder.removeprefix("lora_").split("_", 1)[0]


#: Prefix that activation checkpointing adds to the names of wrapped modules' parameters (not to state-dict keys).
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


def merged_lora_copy(state_dict: Dict[str, torch.Tensor], rank: int, alpha: float) -> Dict[str, torch.Tensor]:
    """``state_dict`` with its LoRA weights merged into *copies* of the base weights.

    torchtune's ``get_merged_lora_ckpt`` adds the delta in place, and on a single CPU device the state dict
    holds the live parameters themselves (``.cpu()`` of a CPU tensor is no copy): merging there would move
    the frozen base by the current delta at every save.
    """
    targets = {k.removesuffix(".lora_a.weight") + ".weight" for k in state_dict if k.endswith(".lora_a.weight")}
    copies = {k: v.clone() if k in targets else v for k, v in state_dict.items()}
    return get_merged_lora_ckpt(copies, rank=rank, alpha=alpha)


def param_group_of(name: str) -> str:
    for group, fragments in PARAM_GROUPS.items():
        if any(fragment in name for fragment in fragments):
            return group
    return "backbone"


class RoutedFinetuneRecipe(FTRecipeInterface):
    """Teacher–student fine-tuning of routed Qwen2.5 models (see module docstring)."""

    def __init__(self, cfg: DictConfig) -> None:
        validate_recipe_config(cfg)
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        self._distributed = self.world_size > 1
        self._variant = _variant_of(cfg.model)
        self._is_lora = cfg.model._component_.rsplit(".", 1)[-1].startswith("lora_")
        if self._is_lora:
            self._lora_rank, self._lora_alpha = cfg.model.lora_rank, cfg.model.lora_alpha

        self._output_dir = cfg.output_dir
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._clip_grad_norm = cfg.clip_grad_norm
        self._log_every_n_steps = cfg.log_every_n_steps
        self._save_every_n_steps = cfg.save_every_n_steps
        self._val_every_n_steps = cfg.validation.every_n_steps
        self._val_max_batches = cfg.validation.max_batches
        self._resume_from_checkpoint = cfg.resume_from_checkpoint
        self.seed = training.set_seed(seed=cfg.seed)
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.epochs_run = 0
        self.global_step = 0
        if self._variant != "dense":
            self._loss_weights = LossWeights(**cfg.routing_loss_weights)
            self._scheduled_sampling = ScheduledSampling(**cfg.scheduled_sampling)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)
        self._checkpointer = config.instantiate(cfg.checkpointer, should_load_recipe_state=self._resume_from_checkpoint)
        checkpoint = self._checkpointer.load_checkpoint()
        self._model = self._setup_model(cfg, checkpoint[training.MODEL_KEY])
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg)
        if self._resume_from_checkpoint:
            if self._is_lora:
                self._load_adapter(checkpoint[training.ADAPTER_KEY])
            self._restore_recipe_state(checkpoint)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        if cfg.compile:
            training.compile_loss(self._loss_fn, verbose=self._is_rank_zero)

        self._dataloader = self._setup_data(
            cfg.dataset, shuffle=cfg.shuffle, batch_size=cfg.batch_size,
            state=checkpoint.get(training.DATALOADER_KEY) if self._resume_from_checkpoint else None,
        )
        self._val_dataloader = (
            self._setup_data(cfg.dataset_val, shuffle=False, batch_size=cfg.batch_size, state=None)
            if cfg.get("dataset_val") is not None
            else None
        )
        if self._val_dataloader is not None:
            self._check_student_is_causal()
        self._steps_per_epoch = len(self._dataloader) // self._gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        self._total_steps = self.total_epochs * self._steps_per_epoch
        self._lr_scheduler = config.instantiate(
            cfg.lr_scheduler, self._optimizer, num_training_steps=self._total_steps, last_epoch=self.global_step - 1
        )
        if self._variant != "dense":
            self._beta_schedule = BetaSchedule(**cfg.beta_schedule, total_steps=self._total_steps)
        self._ignore_labels = torch.full((cfg.batch_size, 1), self._loss_fn.ignore_index, device=self._device)

    def _setup_model(self, cfg: DictConfig, state_dict: Dict[str, Any]) -> nn.Module:
        with training.set_default_dtype(self._dtype), torch.device("meta" if self._distributed else self._device):
            model = config.instantiate(cfg.model)
        if self._is_lora:
            # LoRA twins: adapters plus every routing module train; the base stays frozen.
            set_trainable_params(model, get_adapter_params(model))
        elif cfg.freeze_base:
            for name, param in model.named_parameters():
                param.requires_grad_(param_group_of(name) != "backbone")
        if cfg.compile:
            training.compile_model(model, verbose=self._is_rank_zero)
        if cfg.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})

        if self._distributed:
            # Shard every decoder layer (routed layers are TransformerSelfAttentionLayers) and the root.
            training.shard_model(
                model,
                [lambda name, module: isinstance(module, modules.TransformerSelfAttentionLayer)],
                cpu_offload=False,
                reshard_after_forward=True,
            )
            with training.set_default_dtype(self._dtype), self._device:
                for module in model.modules():
                    if hasattr(module, "rope_init"):
                        module.rope_init()
            training.load_from_full_model_state_dict(model, state_dict, self._device, strict=not self._is_lora)
        else:
            model.load_state_dict(state_dict, strict=not self._is_lora)
        training.validate_no_params_on_meta_device(model)
        if self._is_lora:
            self._check_only_adapters_missing(model, state_dict)
        return model

    def _check_student_is_causal(self) -> None:
        """Validation scores held-out text with the student; a whole-sequence top-k student is not causal
        (DESIGN R4), so refuse it before any training unless the config asks for that analysis."""
        noncausal = sorted(
            m.layer_idx for m in self._model.modules()
            if isinstance(m, RoutedSelfAttentionLayer) and m.student_routing_mode == "topk" and not m.allow_noncausal_student_topk
        )
        if noncausal:
            raise ValueError(
                f"validation would score held-out text with student_routing_mode='topk' (routed layers {noncausal}), "
                "a per-sequence top-k that is not causal. Use student_routing_mode='threshold', drop dataset_val, "
                "or set allow_noncausal_student_topk: True to run that analysis deliberately."
            )

    def _load_adapter(self, adapter_state: Dict[str, Any]) -> None:
        """LoRA resume: the base comes from the original checkpoint, adapters and routing from the run."""
        if self._distributed:
            training.load_from_full_model_state_dict(self._model, adapter_state, self._device, strict=False)
        else:
            self._model.load_state_dict(adapter_state, strict=False)

    @staticmethod
    def _check_only_adapters_missing(model: nn.Module, state_dict: Dict[str, Any]) -> None:
        # Parameter names carry the activation-checkpointing wrapper's prefix; state-dict keys do not.
        adapters = {name.replace(_CHECKPOINT_WRAPPED, "") for name in get_adapter_params(model)}
        missing = [k for k in model.state_dict() if k not in state_dict and k not in adapters]
        if missing:
            raise ValueError(f"Checkpoint lacks base weights of the model: {missing[:10]}")

    def _setup_optimizer(self, cfg: DictConfig) -> torch.optim.Optimizer:
        groups: Dict[str, List[nn.Parameter]] = {g: [] for g in ("backbone", *PARAM_GROUPS)}
        for name, param in self._model.named_parameters():
            if param.requires_grad:
                groups[param_group_of(name)].append(param)
        param_groups = [
            {"params": params, "lr": float(cfg.learning_rates[group]), "name": group}
            for group, params in groups.items()
            if params
        ]
        optimizer = config.instantiate(cfg.optimizer, param_groups)
        if self._is_rank_zero:
            sizes = {g["name"]: sum(p.numel() for p in g["params"]) for g in param_groups}
            log.info(f"Optimizer parameter groups (trainable elements): {sizes}")
        return optimizer

    def _setup_data(
        self, cfg_dataset: DictConfig, *, shuffle: bool, batch_size: int, state: Optional[Dict[str, Any]]
    ) -> StatefulDataLoader:
        parts = list(cfg_dataset) if (isinstance(cfg_dataset, (list, tuple)) or OmegaConf.is_list(cfg_dataset)) else [cfg_dataset]
        packed = {bool(part.get("packed", False)) for part in parts}
        if len(packed) > 1:
            raise ValueError("Dataset components mix packed: True and packed: False; pack all of them or none")
        datasets = [config.instantiate(part, self._tokenizer) for part in parts]
        dataset = datasets[0] if len(datasets) == 1 else torch.utils.data.ConcatDataset(datasets)
        sampler = StatefulDistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=self.seed
        )
        if packed.pop():
            # As torchtune means it: block-causal attention, positions restart in every document.
            collate = padded_collate_packed_dense
        else:
            collate = partial(
                _get_component_from_path("torchtune.data.padded_collate_sft"),
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=self._loss_fn.ignore_index,
            )
        dataloader = StatefulDataLoader(
            dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True
        )
        if state is not None:
            dataloader.load_state_dict(state)
        return dataloader

    def _restore_recipe_state(self, checkpoint: Dict[str, Any]) -> None:
        try:
            self.epochs_run = checkpoint[training.EPOCHS_KEY]
            self.global_step = checkpoint["global_step"]
            opt_state = checkpoint[training.OPT_KEY]
        except KeyError as err:
            raise ValueError(
                f"resume_from_checkpoint=True but the recipe state lacks {err}; was it written by this recipe?"
            ) from err
        if checkpoint.get(training.SEED_KEY) != self.seed:
            raise ValueError(f"Resuming with seed {self.seed} but the checkpoint was trained with {checkpoint.get(training.SEED_KEY)}")
        if self._distributed:
            training.load_from_full_optimizer_state_dict(self._model, self._optimizer, opt_state, self._device)
        else:
            self._optimizer.load_state_dict(opt_state)

    # -------------------------------------------------------------------------------------- training
    def _routing_context(self, mode: str, execute: str = "teacher") -> RoutingContext:
        if self._variant == "dense":
            return RoutingContext(mode=mode)
        beta_ce, beta_cu = self._beta_schedule(self.global_step)
        return RoutingContext(mode=mode, beta_ce=beta_ce, beta_cu=beta_cu, execute=execute)

    def _lm_loss(self, batch: Dict[str, torch.Tensor], routing: RoutingContext) -> torch.Tensor:
        labels = batch["labels"]
        labels = torch.hstack((labels[..., 1:], self._ignore_labels[: labels.shape[0]]))
        # Packed batches carry the block-causal mask and per-document positions.
        logits = self._model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"), routing=routing)
        return self._loss_fn(logits, labels)

    def _executes_student(self) -> bool:
        return self._variant != "dense" and self._scheduled_sampling.executes_student(self.global_step, self.seed)

    def _total_loss(self, batch: Dict[str, torch.Tensor]):
        routing = self._routing_context("teacher", "student" if self._executes_student() else "teacher")
        lm_loss = self._lm_loss(batch, routing)
        if self._variant == "dense":
            return lm_loss, {"lm": lm_loss.detach()}, routing
        aux = auxiliary_losses(routing)
        w_pred, w_causal, w_g_reg = self._loss_weights.at(self.global_step)
        loss = lm_loss + w_pred * aux["pred"] + w_causal * aux["causal"] + w_g_reg * aux["g_reg"]
        parts = {"lm": lm_loss.detach(), **{k: v.detach() for k, v in aux.items()}}
        return loss, parts, routing

    @torch.no_grad()
    def validate(self) -> Dict[str, float]:
        """Held-out LM loss in student mode (deployed) and teacher mode, averaged over batches."""
        self._model.eval()
        totals = {"student": 0.0, "teacher": 0.0}
        batches = 0
        for idx, batch in enumerate(self._val_dataloader):
            if idx >= self._val_max_batches:
                break
            batch = {k: v.to(self._device) for k, v in batch.items()}
            for mode in totals:
                totals[mode] += self._lm_loss(batch, self._routing_context(mode)).item()
            batches += 1
        self._model.train()
        result = torch.tensor([totals["student"], totals["teacher"], batches], dtype=torch.float64, device=self._device)
        if self._distributed:
            dist.all_reduce(result)
        return {"val/lm_loss_student": (result[0] / result[2]).item(), "val/lm_loss_teacher": (result[1] / result[2]).item()}

    def train(self) -> None:
        self._model.train()
        self._optimizer.zero_grad()
        parts_sum: Dict[str, float] = {}
        num_tokens = 0
        step_start = time.perf_counter()
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._dataloader.sampler.set_epoch(curr_epoch)
            steps_done_this_epoch = self.global_step - curr_epoch * self._steps_per_epoch
            pbar = tqdm(total=self._steps_per_epoch, initial=steps_done_this_epoch, disable=not self._is_rank_zero)
            micro_step = 0
            for batch in self._dataloader:
                if self.global_step >= (curr_epoch + 1) * self._steps_per_epoch:
                    break
                batch = {k: v.to(self._device) for k, v in batch.items()}
                num_tokens += int((batch["labels"] != self._loss_fn.ignore_index).sum())
                loss, parts, routing = self._total_loss(batch)
                (loss / self._gradient_accumulation_steps).backward()
                for name, value in parts.items():
                    parts_sum[name] = parts_sum.get(name, 0.0) + value.item() / self._gradient_accumulation_steps
                micro_step += 1
                if micro_step % self._gradient_accumulation_steps:
                    continue

                grad_norm = None
                if self._clip_grad_norm is not None:
                    grad_norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), max_norm=float(self._clip_grad_norm))
                    if hasattr(grad_norm, "full_tensor"):
                        grad_norm = grad_norm.full_tensor()
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                self._lr_scheduler.step()
                self.global_step += 1
                pbar.update(1)
                pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {parts_sum['lm']:.4f}")

                if self.global_step % self._log_every_n_steps == 0 and self._is_rank_zero:
                    elapsed = time.perf_counter() - step_start
                    metrics = {f"loss/{k}": v for k, v in parts_sum.items()}
                    metrics["tokens_per_second"] = num_tokens * self.world_size / max(elapsed, 1e-9)
                    for group in self._optimizer.param_groups:
                        metrics[f"lr/{group['name']}"] = group["lr"]
                    if grad_norm is not None:
                        metrics["grad_norm"] = float(grad_norm)
                    if self._variant != "dense":
                        metrics["beta_ce"], metrics["beta_cu"] = routing.beta_ce, routing.beta_cu
                        metrics["scheduled_sampling/share"] = self._scheduled_sampling.share(self.global_step - 1)
                        metrics["scheduled_sampling/executed_student"] = float(routing.execute == "student")
                        metrics.update(routing_metrics(routing))
                    self._metric_logger.log_dict(metrics, step=self.global_step)
                parts_sum, num_tokens, step_start = {}, 0, time.perf_counter()

                if self._val_dataloader is not None and self.global_step % self._val_every_n_steps == 0:
                    val = self.validate()
                    if self._is_rank_zero:
                        self._metric_logger.log_dict(val, step=self.global_step)
                        log.info(f"step {self.global_step}: {val}")
                end_of_epoch = self.global_step == (curr_epoch + 1) * self._steps_per_epoch
                if self.global_step % self._save_every_n_steps == 0 and not end_of_epoch:
                    self.save_checkpoint(epoch=curr_epoch, epochs_run=curr_epoch)
            pbar.close()
            self.epochs_run = curr_epoch + 1
            self.save_checkpoint(epoch=curr_epoch, epochs_run=self.epochs_run)

    # ----------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, epoch: int, epochs_run: int) -> None:
        """Model (base weights in HF layout + routing sidecar) and, unless training is over, the recipe
        state needed to resume: optimizer, epoch, step, seed and data position."""
        intermediate = self.global_step < self._total_steps
        if self._distributed:
            model_state = training.gather_cpu_state_dict(self._model, self._is_rank_zero, device=self._device)
            opt_state = (
                training.get_full_optimizer_state_dict(self._model, self._optimizer, self._is_rank_zero, device=self._device)
                if intermediate
                else None
            )
        else:
            model_state = {k: v.cpu() for k, v in self._model.state_dict().items()}
            opt_state = self._optimizer.state_dict() if intermediate else None
        dataloader_state = self._dataloader.state_dict()
        if self._is_rank_zero:
            state = {training.MODEL_KEY: model_state}
            if intermediate:
                state.update(
                    {
                        training.OPT_KEY: opt_state,
                        training.EPOCHS_KEY: epochs_run,
                        training.SEED_KEY: self.seed,
                        training.TOTAL_EPOCHS_KEY: self.total_epochs,
                        training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                        training.DATALOADER_KEY: dataloader_state,
                        "global_step": self.global_step,
                    }
                )
            if self._is_lora:
                # Adapters and routing weights to resume from; merged weights for eval and generate.
                state[training.ADAPTER_KEY] = routed_adapter_state_dict(model_state)
                state[training.MODEL_KEY] = merged_lora_copy(model_state, rank=self._lora_rank, alpha=self._lora_alpha)
            self._checkpointer.save_checkpoint(state, epoch=epoch, intermediate_checkpoint=intermediate)
            log.info(f"Saved checkpoint at step {self.global_step} (epoch {epoch})")
        if self._distributed:
            dist.barrier()

    def cleanup(self) -> None:
        if self._is_rank_zero:
            self._metric_logger.close()
        if self._distributed:
            dist.destroy_process_group()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point for ``tune run torchtune_dtf/recipes/routed_finetune.py --config ...``."""
    if utils.get_world_size_and_rank()[0] > 1 and not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    config.log_config(recipe_name="RoutedFinetuneRecipe", cfg=cfg)
    recipe = RoutedFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
