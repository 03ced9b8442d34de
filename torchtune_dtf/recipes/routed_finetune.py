"""Fine-tune a routed (MoD / SDT / STT) or dense Qwen2.5 model with teacher–student routing.

    tune run torchtune_dtf/recipes/routed_finetune.py --config configs/stt_qwen0_5b.yaml
    tune run --nproc_per_node 8 torchtune_dtf/recipes/routed_finetune.py --config configs/stt_qwen0_5b.yaml

Every optimizer step s the recipe

1. computes β_ce(s), β_cu(s) from ``beta_schedule`` (spec §6) and passes them to the model in a
   teacher-mode :class:`RoutingContext`;
   The routed pass runs the teacher's selection, or on a scheduled share of steps the student's own
   (``scheduled_sampling``, docs/design.md R2), so the backbone also trains on what inference executes;
2. forms L = L_LM + λ_pred·L_pred + λ_causal·L_causal + λ_g_reg·L_g_reg, each auxiliary loss averaged over
   tokens and then over routed layers (spec §4.8; paper §3.3.2), plus λ_distill·T²·KL(dense ‖ routed)
   against a frozen dense copy of the starting weights when ``distillation.weight`` > 0; top-k teachers
   keep γ' = 1 − p(s)·(1 − γ) of the tokens while the ``capacity_curriculum`` ramps p from 0 to 1;
3. steps AdamW with separate learning rates for the backbone, the predictors (PriorFFN/TPN), the predictive
   router (o_ce, m_cu) and the routers (causal routers, MoD router);
4. after the last step, with ``student_calibration.batches`` > 0, shifts each threshold student's router bias so
   that it executes on training text what its teacher does (γ for top-k teachers), so the saved model runs at
   the budget its config states (:mod:`torchtune_dtf.training.calibration`).

Variants: dense, the two baselines (``layerdrop``: layers removed; ``random``: random selection at the
routed budget), MoD, SDT and STT. Single device or FSDP2 (torchrun), CPU or CUDA, fp32 or bf16, gradient accumulation and clipping,
packed datasets (``packed: True``: block-causal mask, positions restarting per document, docs/design.md R3),
activation checkpointing and compile applied from outside the model (they cover routed layers because
those are ``TransformerSelfAttentionLayer`` s). Periodic validation reports the held-out LM loss of the
student (what users deploy) and of the teacher. Checkpoints carry the optimizer, step and data position,
so ``resume_from_checkpoint: True`` continues a crashed run where its last checkpoint left it.

Resume is exact or refused: every checkpoint is written atomically and carries the run id and step (see
:class:`~torchtune_dtf.training.RoutedHFCheckpointer`); a finished run, a checkpoint of another run, and a
config that changes what the rest of the run computes (model, data, batch, optimizer, learning rates,
schedules…) are refused with a message saying what to do. Extending a finished run is a deliberate act:
raise ``epochs`` or ``max_steps_per_epoch`` and set ``resume_from_checkpoint: extend`` (the LR and β
schedules are then recomputed over the new length).

The config and resume checks are :mod:`torchtune_dtf.training.recipe_checks`, the summary a run logs at its
end is :mod:`torchtune_dtf.evaluation.run_summary`, and the command line is parsed by
:func:`torchtune_dtf.recipes.stock.parse` (``tune run``'s own merge).
"""

import math
import os
import sys
import time
import uuid
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

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

from torchtune_dtf.evaluation.run_summary import student_executed_fractions, summarize_run
from torchtune_dtf.models.model_config import dense_model_config, is_lora, model_variant
from torchtune_dtf.models.routing_config import STATIC_VARIANTS
from torchtune_dtf.modules import routing_group_of
from torchtune_dtf.modules.layers import RoutedSelfAttentionLayer
from torchtune_dtf.modules.routing_context import RoutingContext
from torchtune_dtf.recipes.stock import log_config_if_asked, parse
from torchtune_dtf.training.calibration import batch_for_calibration, calibrate_to_teacher
from torchtune_dtf.training.checkpointer import RUN_ID_KEY, STEP_KEY, routed_adapter_state_dict
from torchtune_dtf.training.recipe_checks import (
    PARAM_GROUPS,
    check_resumable,
    check_resume_length,
    check_resume_mode,
    resume_fingerprint,
    validate_recipe_config,
)
from torchtune_dtf.training.routing_losses import distillation_loss, routing_metrics, training_loss
from torchtune_dtf.data.checks import check_local_text_files, check_text_column
from torchtune_dtf.data.collate import padded_collate_packed_dense
from torchtune_dtf.training.skip_bias_init import fit_skip_linear_maps, init_skip_biases
from torchtune_dtf.training.schedules import (
    BetaSchedule,
    CapacityCurriculum,
    Distillation,
    LossWeights,
    ScheduledSampling,
)

log = utils.get_logger("INFO")


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
    return routing_group_of(name) or "backbone"


class RoutedFinetuneRecipe(FTRecipeInterface):
    """Teacher–student fine-tuning of routed Qwen2.5 models (see module docstring)."""

    def __init__(self, cfg: DictConfig) -> None:
        validate_recipe_config(cfg)
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        self._distributed = self.world_size > 1
        model_section = OmegaConf.to_container(cfg.model, resolve=True)
        self._variant, self._is_lora = model_variant(model_section), is_lora(model_section)
        # Dense and static layer dropping take no routing decision: no routing context, losses or schedules.
        self._routed = self._variant not in STATIC_VARIANTS
        if self._is_lora:
            self._lora_rank, self._lora_alpha = cfg.model.lora_rank, cfg.model.lora_alpha

        self._output_dir = cfg.output_dir
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._clip_grad_norm = cfg.clip_grad_norm
        self._log_every_n_steps = cfg.log_every_n_steps
        self._save_every_n_steps = cfg.save_every_n_steps
        self._val_every_n_steps = cfg.validation.every_n_steps
        self._val_max_batches = cfg.validation.max_batches
        check_resume_mode(cfg.resume_from_checkpoint)
        self._resume_from_checkpoint = bool(cfg.resume_from_checkpoint)
        self._extend = cfg.resume_from_checkpoint == "extend"
        self.seed = training.set_seed(seed=cfg.seed)
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.epochs_run = 0
        self.global_step = 0
        self._distillation = Distillation(**cfg.distillation)
        if self._distillation.enabled and self._distributed:
            raise ValueError(
                "distillation.weight > 0 keeps a full dense teacher on every rank, which this recipe does not shard; "
                "distillation runs on a single device for now (set distillation.weight: 0 with torchrun)"
            )
        if self._routed:
            self._loss_weights = LossWeights(**cfg.routing_loss_weights)
            self._scheduled_sampling = ScheduledSampling(**cfg.scheduled_sampling)
            self._curriculum = CapacityCurriculum(**cfg.capacity_curriculum)
            self._calibration_batches = cfg.student_calibration.batches
            self._calibration_rounds = cfg.student_calibration.rounds
            BetaSchedule(**cfg.beta_schedule, total_steps=1)  # its checks, before any work (total comes with the data)
        # Absent: every skip bias (linear map) starts at zero, as every run before the section existed did.
        self._skip_bias_init_batches = cfg.skip_bias_init.batches if "skip_bias_init" in cfg else 0
        self._skip_update = cfg.model.get("skip_update")
        self._skip_map_ridge = float(cfg.skip_bias_init.ridge) if self._skip_update == "linear" and self._skip_bias_init_batches else None
        if self._skip_map_ridge is not None and self._distributed:
            raise ValueError(
                "skip_bias_init with model.skip_update: linear fits the maps layer by layer on one device; it does not "
                "run under torchrun yet (fit on one device and resume from that checkpoint, or set skip_bias_init.batches: 0)"
            )

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)  # torchtune's loggers save it as output_dir/torchtune_config.yaml
            log.info(f"{self._variant} model, config saved to {os.path.join(cfg.output_dir, 'torchtune_config.yaml')}"
                     " (print_config=True also prints it)")
        self._checkpointer = config.instantiate(cfg.checkpointer, should_load_recipe_state=self._resume_from_checkpoint)
        checkpoint = self._checkpointer.load_checkpoint()
        self._fingerprint = resume_fingerprint(cfg, self.world_size)
        if self._resume_from_checkpoint:
            # Before any state is applied: a checkpoint that cannot be continued faithfully is refused.
            check_resumable(checkpoint, self._fingerprint, self._checkpointer._resume_folder, extend=self._extend)
            self._run_id = checkpoint[RUN_ID_KEY]
        else:
            self._run_id = uuid.uuid4().hex  # recorded in output_dir when training starts (setup writes nothing)
        self._model = self._setup_model(cfg, checkpoint[training.MODEL_KEY])
        self._dense_teacher = self._setup_dense_teacher(cfg) if self._distillation.enabled else None
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg)
        if self._resume_from_checkpoint:
            if self._is_lora:
                self._load_adapter(checkpoint[training.ADAPTER_KEY])
            self._restore_recipe_state(checkpoint)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
            if self._dense_teacher is not None:
                self._dense_teacher.set_num_output_chunks(self._loss_fn.num_output_chunks)
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
        if self._steps_per_epoch == 0:
            raise ValueError(
                f"The training data gives 0 optimizer steps per epoch: {len(self._dataloader.dataset)} examples make "
                f"{len(self._dataloader)} full batches of batch_size {cfg.batch_size} per rank ({self.world_size} "
                f"rank(s)), fewer than gradient_accumulation_steps {self._gradient_accumulation_steps}. Lower those "
                "or add data; the run would save the untrained model as its result."
            )
        if self._resume_from_checkpoint:
            # A finished run is only continued on purpose (extend); otherwise its length must be unchanged.
            check_resume_length(self._checkpointer._resume_folder, done=self.global_step,
                                planned_steps=checkpoint["total_steps"], total_steps=self._total_steps, extend=self._extend)
            if self._extend:
                self.epochs_run = self.global_step // self._steps_per_epoch
                log.info(f"Extending run {self._run_id} from step {self.global_step} to {self._total_steps}; "
                         "the LR and β schedules are recomputed over the new length")
        self._lr_scheduler = config.instantiate(
            cfg.lr_scheduler, self._optimizer, num_training_steps=self._total_steps, last_epoch=self.global_step - 1
        )
        if self._routed:
            self._beta_schedule = BetaSchedule(**cfg.beta_schedule, total_steps=self._total_steps)
        self._ignore_labels = torch.full((cfg.batch_size, 1), self._loss_fn.ignore_index, device=self._device)
        if self._skip_bias_init_batches and not self._resume_from_checkpoint:  # a resumed run has its own
            self._init_skip_biases()

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

    def _setup_dense_teacher(self, cfg: DictConfig) -> nn.Module:
        """The distillation teacher: the *starting* weights (``checkpointer.checkpoint_dir``, also when this
        run resumes) as a dense model of the same architecture, frozen. Every layer runs on every token —
        dropped layers and routed layers alike — so its logits are the pretrained model's."""
        teacher_cfg = OmegaConf.create(dense_model_config(OmegaConf.to_container(cfg.model, resolve=True)))
        fresh = config.instantiate(cfg.checkpointer, should_load_recipe_state=False)
        state = fresh.load_checkpoint()[training.MODEL_KEY]
        with training.set_default_dtype(self._dtype), torch.device(self._device):
            teacher = config.instantiate(teacher_cfg)
        expected = teacher.state_dict()
        missing = [k for k in expected if k not in state and ".lora_" not in k]
        if missing:
            raise ValueError(f"The distillation teacher lacks weights in {cfg.checkpointer.checkpoint_dir}: {missing[:10]}")
        teacher.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
        teacher.requires_grad_(False)
        log.info(f"Distillation: frozen dense teacher from {cfg.checkpointer.checkpoint_dir} "
                 f"(weight {self._distillation.weight}, temperature {self._distillation.temperature})")
        return teacher.eval()

    def _check_student_is_causal(self) -> None:
        """Validation scores held-out text with the student; a whole-sequence top-k student is not causal
        (docs/design.md R4), so refuse it before any training unless the config asks for that analysis."""
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
        for part in parts:  # before datasets reads them: bad rows fail here, naming file and line
            check_local_text_files(part.get("source"), part.get("data_files"), part.get("column", "text"))
        datasets = [config.instantiate(part, self._tokenizer) for part in parts]
        for part, ds in zip(parts, datasets):
            check_text_column(ds, part.get("column", "text"), f"dataset {part.get('source')} ({part.get('split', '')})")
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
            self.global_step = checkpoint[STEP_KEY]
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
        if not self._routed:
            return RoutingContext(mode=mode)
        beta_ce, beta_cu = self._beta_schedule(self.global_step)
        progress = self._curriculum.progress(self.global_step) if mode == "teacher" else 1.0
        return RoutingContext(mode=mode, beta_ce=beta_ce, beta_cu=beta_cu, execute=execute, capacity_progress=progress)

    def _shifted_labels(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        return torch.hstack((labels[..., 1:], self._ignore_labels[: labels.shape[0]]))

    def _logits(self, model: nn.Module, batch: Dict[str, torch.Tensor], routing: Optional[RoutingContext]):
        # Packed batches carry the block-causal mask and per-document positions.
        return model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"), routing=routing)

    def _lm_loss(self, batch: Dict[str, torch.Tensor], routing: RoutingContext) -> torch.Tensor:
        return self._loss_fn(self._logits(self._model, batch, routing), self._shifted_labels(batch))

    def _executes_student(self) -> bool:
        return self._routed and self._scheduled_sampling.executes_student(self.global_step, self.seed)

    def _total_loss(self, batch: Dict[str, torch.Tensor]):
        """The objective of this step (:func:`~torchtune_dtf.training.routing_losses.training_loss`)."""
        routing = self._routing_context("teacher", "student" if self._executes_student() else "teacher")
        labels = self._shifted_labels(batch)
        logits = self._logits(self._model, batch, routing)
        distill = None
        if self._dense_teacher is not None:
            with torch.no_grad():
                teacher_logits = self._logits(self._dense_teacher, batch, None)
            distill = distillation_loss(
                logits, teacher_logits, labels, float(self._distillation.temperature), self._loss_fn.ignore_index
            )
        loss, parts = training_loss(
            self._loss_fn(logits, labels),
            routing if self._routed else None,
            self._loss_weights.at(self.global_step) if self._routed else None,
            distill,
            float(self._distillation.weight),
        )
        return loss, parts, routing

    @torch.no_grad()
    def validate(self) -> Dict[str, float]:
        """Held-out LM loss in student mode (deployed) and teacher mode, averaged over batches. A model without
        routed layers (dense, layer dropping) runs the same forward in both modes: one pass gives both numbers."""
        self._model.eval()
        totals = {"student": 0.0, "teacher": 0.0}
        routed = getattr(self._model, "routed_layers", None)
        one_pass = callable(routed) and not routed()
        batches = 0
        for idx, batch in enumerate(self._val_dataloader):
            if idx >= self._val_max_batches:
                break
            batch = {k: v.to(self._device) for k, v in batch.items()}
            for mode in ("student",) if one_pass else totals:
                totals[mode] += self._lm_loss(batch, self._routing_context(mode)).item()
            batches += 1
        if one_pass:
            totals["teacher"] = totals["student"]
        self._model.train()
        result = torch.tensor([totals["student"], totals["teacher"], batches], dtype=torch.float64, device=self._device)
        if self._distributed:
            dist.all_reduce(result)
        return {"val/lm_loss_student": (result[0] / result[2]).item(), "val/lm_loss_teacher": (result[1] / result[2]).item()}

    def train(self) -> None:
        if not self._resume_from_checkpoint and self._is_rank_zero:
            self._checkpointer.begin_run(self._run_id)
        self._model.train()
        self._optimizer.zero_grad()
        # Per step, on the device: the loss parts (averaged over micro-batches) and the target tokens. They
        # come back to the host once per optimizer step, with the gradient norm (_read_step_values).
        parts_on_device: Dict[str, torch.Tensor] = {}
        tokens_on_device = torch.zeros((), dtype=torch.float64, device=self._device)
        tokens_since_log = 0  # the `tokens` metric: summed over the log lines, the run's training tokens
        step_start = time.perf_counter()
        # For the run summary (_summarize): this invocation's wall time, steps and target tokens (this rank).
        run_start, first_step, trained_tokens, last_lm_loss = time.perf_counter(), self.global_step, 0, None
        self._last_validation: Optional[Tuple[int, Dict[str, float]]] = None
        for curr_epoch in range(self.epochs_run, self.total_epochs):
            self._dataloader.sampler.set_epoch(curr_epoch)
            steps_done_this_epoch = self.global_step - curr_epoch * self._steps_per_epoch
            pbar = tqdm(total=self._steps_per_epoch, initial=steps_done_this_epoch, disable=not self._is_rank_zero)
            micro_step = 0
            for batch in self._dataloader:
                if self.global_step >= (curr_epoch + 1) * self._steps_per_epoch:
                    break
                batch = {k: v.to(self._device) for k, v in batch.items()}
                tokens_on_device += (batch["labels"] != self._loss_fn.ignore_index).sum()
                loss, parts, routing = self._total_loss(batch)
                (loss / self._gradient_accumulation_steps).backward()
                for name, value in parts.items():
                    share = value.double() / self._gradient_accumulation_steps
                    parts_on_device[name] = parts_on_device[name] + share if name in parts_on_device else share
                micro_step += 1
                if micro_step % self._gradient_accumulation_steps:
                    continue

                # Without clipping the norm is still computed (max_norm inf scales by 1): it guards divergence.
                max_norm = math.inf if self._clip_grad_norm is None else float(self._clip_grad_norm)
                grad_norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), max_norm=max_norm)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                parts_sum, num_tokens, grad_norm = self._read_step_values(parts_on_device, tokens_on_device, grad_norm)
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
                self._lr_scheduler.step()
                self.global_step += 1
                tokens_since_log += num_tokens
                trained_tokens += num_tokens
                last_lm_loss = parts_sum["lm"]
                pbar.update(1)
                pbar.set_description(f"{curr_epoch + 1}|{self.global_step}|Loss: {parts_sum['lm']:.4f}")

                # The run's last step is always logged: a run shorter than log_every_n_steps would otherwise
                # leave an empty metric log, and the tokens of the steps after the last log line would be lost.
                log_now = self.global_step % self._log_every_n_steps == 0 or self.global_step == self._total_steps
                if log_now and self._is_rank_zero:
                    elapsed = time.perf_counter() - step_start
                    metrics = {f"loss/{k}": v for k, v in parts_sum.items()}
                    metrics["tokens_per_second"] = num_tokens * self.world_size / max(elapsed, 1e-9)
                    # Target tokens trained on since the previous log line (all ranks; this rank's count × ranks).
                    metrics["tokens"] = tokens_since_log * self.world_size
                    tokens_since_log = 0
                    for group in self._optimizer.param_groups:
                        metrics[f"lr/{group['name']}"] = group["lr"]
                    metrics["grad_norm"] = grad_norm
                    if self._routed:
                        metrics["beta_ce"], metrics["beta_cu"] = routing.beta_ce, routing.beta_cu
                        metrics["capacity_progress"] = routing.capacity_progress
                        metrics["scheduled_sampling/share"] = self._scheduled_sampling.share(self.global_step - 1)
                        metrics["scheduled_sampling/executed_student"] = float(routing.execute == "student")
                        metrics.update(routing_metrics(routing))
                    self._metric_logger.log_dict(metrics, step=self.global_step)
                parts_on_device, step_start = {}, time.perf_counter()
                tokens_on_device = torch.zeros((), dtype=torch.float64, device=self._device)

                if self._val_dataloader is not None and self.global_step % self._val_every_n_steps == 0:
                    val = self.validate()
                    self._last_validation = (self.global_step, val)
                    if self._is_rank_zero:
                        self._metric_logger.log_dict(val, step=self.global_step)
                        log.info(f"step {self.global_step}: {val}")
                end_of_epoch = self.global_step == (curr_epoch + 1) * self._steps_per_epoch
                if self.global_step % self._save_every_n_steps == 0 and not end_of_epoch:
                    self.save_checkpoint(epoch=curr_epoch, epochs_run=curr_epoch)
            pbar.close()
            self.epochs_run = curr_epoch + 1
            if self.epochs_run == self.total_epochs and self._routed and self._calibration_batches:
                self._calibrate_student()
            self.save_checkpoint(epoch=curr_epoch, epochs_run=self.epochs_run)
        self.summary = self._summarize(
            wall_s=time.perf_counter() - run_start, steps=self.global_step - first_step, tokens=trained_tokens,
            last_lm_loss=last_lm_loss,
        )

    # ----------------------------------------------------------------------------------- run summary
    def _summarize(self, wall_s: float, steps: int, tokens: int, last_lm_loss: Optional[float]) -> Dict[str, Any]:
        """The run summary (:func:`~torchtune_dtf.evaluation.run_summary.summarize_run`), once, after the final
        checkpoint. Collective: every rank runs the student forward for the executed fractions and sums its
        target tokens into the total. Returns the summary on rank 0, ``{}`` elsewhere."""
        source, executed = (
            student_executed_fractions(self._model, self._dataloader, self._val_dataloader, self._loss_fn.ignore_index,
                                       self._device, all_reduce=self._distributed)
            if self._routed else ("", {})
        )
        tokens_all = torch.tensor(float(tokens), dtype=torch.float64, device=self._device)
        if self._distributed:
            dist.all_reduce(tokens_all)
        if not self._is_rank_zero:
            return {}
        return summarize_run(
            steps=steps, global_step=self.global_step, total_steps=self._total_steps, tokens=int(tokens_all.item()),
            wall_s=wall_s, last_lm_loss=last_lm_loss, last_validation=self._last_validation,
            has_validation_data=self._val_dataloader is not None, val_every_n_steps=self._val_every_n_steps,
            calibrated=self._routed and bool(self._calibration_batches), executed_source=source, executed=executed,
            output_dir=os.path.join(self._output_dir, f"epoch_{self.epochs_run - 1}"), metric_logger=self._metric_logger,
        )

    def _first_training_batches(self, count: int) -> List[Dict[str, Optional[torch.Tensor]]]:
        """The first ``count`` batches of the training set in dataset order (the same on every rank, whatever the
        shuffle), as :data:`~torchtune_dtf.training.calibration.CalibrationBatch` es on the device."""
        dataset, collate = self._dataloader.dataset, self._dataloader.collate_fn
        size = self._dataloader.batch_size
        return [
            {k: (v.to(self._device) if v is not None else None) for k, v in batch_for_calibration(
                collate([dataset[i] for i in range(n * size, (n + 1) * size)]), self._loss_fn.ignore_index).items()}
            for n in range(min(count, len(dataset) // size))
        ]

    def _init_skip_biases(self) -> None:
        """Before step 0: each skip bias starts at the mean update of the tokens it stands in for, measured on the
        first ``skip_bias_init.batches`` training batches with the loaded model (a routed layer: the tokens its
        teacher skips at step 0); each skip linear map at the ridge regression of that update on the token's input,
        layer by layer in depth order. See :mod:`torchtune_dtf.training.skip_bias_init`."""
        batches = self._first_training_batches(self._skip_bias_init_batches)
        if self._skip_update == "linear":
            report = fit_skip_linear_maps(self._model, batches, lambda: self._routing_context("teacher"), self._skip_map_ridge)
            if self._is_rank_zero:
                log.info(f"Skip linear maps fitted on {len(batches)} training batches (share of the update explained): "
                         + ", ".join(f"layer {i}: {r['explained']:.3f}" for i, r in report.items()))
            return
        norms = init_skip_biases(self._model, batches, lambda: self._routing_context("teacher"),
                                 all_reduce=self._distributed)
        if self._is_rank_zero:
            log.info(f"Skip biases set to the mean skipped update on {len(batches)} training batches (‖b‖): "
                     + ", ".join(f"layer {i}: {n:.3f}" for i, n in norms.items()))

    def _calibrate_student(self) -> None:
        """Before the final save: shift each threshold student's router bias so that it executes, on the
        first ``student_calibration.batches`` training batches (dataset order, the same on every rank), what
        its teacher executes there (γ for top-k teachers). See :mod:`torchtune_dtf.training.calibration`."""
        batches = self._first_training_batches(self._calibration_batches)
        count = len(batches)
        teacher = self._routing_context("teacher")
        teacher.capacity_progress = 1.0
        report = calibrate_to_teacher(self._model, batches, teacher, rounds=self._calibration_rounds)
        if self._is_rank_zero:
            log.info(
                f"Student calibration on {count} training batches (executed fraction, target ← before → after): "
                + ", ".join(f"layer {i}: {r['target']:.3f} ← {r['before']:.3f} → {r['after']:.3f}" for i, r in report.items())
            )
            self._metric_logger.log_dict(
                {f"calibration/{key}_layer_{i}": r[key] for i, r in report.items() for key in r}, step=self.global_step
            )

    def _read_step_values(
        self, parts: Dict[str, torch.Tensor], tokens: torch.Tensor, grad_norm: torch.Tensor
    ) -> Tuple[Dict[str, float], int, float]:
        """The step's loss parts and target tokens as Python numbers, in one host read per optimizer step
        (not one per loss part per micro-batch), after checking them: a non-finite loss or gradient stops
        the run before the optimizer step, so neither the weights nor any checkpoint take it (all ranks
        agree: the flag is reduced).

        Returns:
            (parts as floats, this rank's target tokens, the gradient norm).
        """
        names = list(parts)
        values = torch.stack([*(parts[name] for name in names), grad_norm.detach().double().reshape(())])
        bad = (~torch.isfinite(values)).any().double()
        if self._distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        *part_values, norm, num_tokens, flag = torch.cat([values, tokens.reshape(1), bad.reshape(1)]).tolist()
        step_parts = dict(zip(names, part_values))
        if flag:
            losses = ", ".join(f"{k} {v:.4g}" for k, v in step_parts.items())
            raise FloatingPointError(
                f"Training diverged at step {self.global_step + 1}: loss ({losses}), grad norm {norm:.4g} "
                "(on some rank). Stopped before the optimizer step; the checkpoints in output_dir are untouched. "
                "Lower the learning rates, check clip_grad_norm and the data (documents of a single token give no "
                "LM targets), then resume or restart."
            )
        return step_parts, int(num_tokens), norm

    # ----------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, epoch: int, epochs_run: int) -> None:
        """Model (base weights in HF layout + routing sidecar) and the recipe state needed to resume (or,
        after the last step, to extend) the run: optimizer, epoch, step, seed, data position, run id and the
        resume-invariant config. The checkpointer writes them atomically into ``epoch_{epoch}``."""
        if self._distributed:
            model_state = training.gather_cpu_state_dict(self._model, self._is_rank_zero, device=self._device)
            opt_state = training.get_full_optimizer_state_dict(
                self._model, self._optimizer, self._is_rank_zero, device=self._device
            )
        else:
            model_state = {k: v.cpu() for k, v in self._model.state_dict().items()}
            opt_state = self._optimizer.state_dict()
        dataloader_state = self._dataloader.state_dict()
        if self._is_rank_zero:
            state = {
                training.MODEL_KEY: model_state,
                training.OPT_KEY: opt_state,
                training.EPOCHS_KEY: epochs_run,
                training.SEED_KEY: self.seed,
                training.TOTAL_EPOCHS_KEY: self.total_epochs,
                training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                training.DATALOADER_KEY: dataloader_state,
                STEP_KEY: self.global_step,
                RUN_ID_KEY: self._run_id,
                "total_steps": self._total_steps,
                "resume_fingerprint": self._fingerprint,
            }
            if self._is_lora:
                # Adapters and routing weights to resume from; merged weights for eval and generate.
                state[training.ADAPTER_KEY] = routed_adapter_state_dict(model_state)
                state[training.MODEL_KEY] = merged_lora_copy(model_state, rank=self._lora_rank, alpha=self._lora_alpha)
            # The checkpointer logs the folder, step and size.
            self._checkpointer.save_checkpoint(state, epoch=epoch, intermediate_checkpoint=True)
        if self._distributed:
            dist.barrier()

    def cleanup(self) -> None:
        if self._is_rank_zero:
            self._metric_logger.close()
        if self._distributed:
            dist.destroy_process_group()


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point for ``tune run torchtune_dtf/recipes/routed_finetune.py --config ...``."""
    # torchrun's environment, not get_world_size_and_rank(): that one reports 1 until the group exists.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    # The metric logger saves the resolved config as output_dir/torchtune_config.yaml (setup names the file).
    log_config_if_asked("RoutedFinetuneRecipe", cfg)
    recipe = RoutedFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
