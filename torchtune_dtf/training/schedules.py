"""Schedules the trainer applies every step: inverse temperatures β (spec §6) and auxiliary-loss weights."""

import math
from dataclasses import dataclass
from typing import Tuple

import torch

BETA_SCHEDULE_TYPES = ("linear", "cosine")


@dataclass(frozen=True)
class BetaSchedule:
    """β_ce(s), β_cu(s) with warm-up (spec §6.1).

    r = 0 for s ≤ S_w, else (s − S_w)/(S − S_w) clipped to 1;
    linear: β = β_start + r(β_end − β_start); cosine: β = β_start + (1 − cos πr)/2 · (β_end − β_start).

    Args:
        type (str): ``"linear"`` or ``"cosine"``.
        beta_ce_start, beta_ce_end, beta_cu_start, beta_cu_end (float): endpoints, all > 0.
        warmup_steps (int): S_w ≥ 0, steps held at the start values.
        total_steps (int): S, the step at which the end values are reached.
    """

    type: str
    beta_ce_start: float
    beta_ce_end: float
    beta_cu_start: float
    beta_cu_end: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        problems = []
        if self.type not in BETA_SCHEDULE_TYPES:
            problems.append(f"beta_schedule.type must be one of {BETA_SCHEDULE_TYPES}, got {self.type!r}")
        for name in ("beta_ce_start", "beta_ce_end", "beta_cu_start", "beta_cu_end"):
            if not getattr(self, name) > 0:
                problems.append(f"beta_schedule.{name} must be > 0, got {getattr(self, name)!r}")
        for kind in ("ce", "cu"):
            start, end = getattr(self, f"beta_{kind}_start"), getattr(self, f"beta_{kind}_end")
            if end < start:  # β anneals the gate from soft to hard (spec §6); falling β is a swapped pair
                problems.append(f"beta_schedule.beta_{kind}_end ({end}) is below beta_{kind}_start ({start})")
        if self.warmup_steps < 0:
            problems.append(f"beta_schedule.warmup_steps must be ≥ 0, got {self.warmup_steps}")
        if problems:
            raise ValueError("Invalid beta schedule:\n  - " + "\n  - ".join(problems))

    def progress(self, step: int) -> float:
        if step <= self.warmup_steps:
            return 0.0
        span = self.total_steps - self.warmup_steps
        return 1.0 if span <= 0 else min(1.0, (step - self.warmup_steps) / span)

    def __call__(self, step: int) -> Tuple[float, float]:
        """(β_ce, β_cu) at optimizer step ``step``."""
        r = self.progress(step)
        w = r if self.type == "linear" else (1.0 - math.cos(math.pi * r)) / 2.0
        return (
            self.beta_ce_start + w * (self.beta_ce_end - self.beta_ce_start),
            self.beta_cu_start + w * (self.beta_cu_end - self.beta_cu_start),
        )


@dataclass(frozen=True)
class LossWeights:
    """λ_pred, λ_causal, λ_g_reg, optionally ramped linearly from 0 over ``warmup_steps`` (spec §8).

    Args:
        pred (float): λ_pred ≥ 0, weight of the PriorFFN/TPN MSE.
        causal (float): λ_causal ≥ 0, weight of the causal router BCE.
        g_reg (float): λ_g_reg ≥ 0, weight of the mean-gate sparsity regulariser.
        warmup_steps (int): ramp length; 0 applies the full weights from the first step.
    """

    pred: float
    causal: float
    g_reg: float
    warmup_steps: int

    def __post_init__(self) -> None:
        bad = [f"{n}={getattr(self, n)!r}" for n in ("pred", "causal", "g_reg", "warmup_steps") if getattr(self, n) < 0]
        if bad:
            raise ValueError(f"Loss weights must be ≥ 0: {', '.join(bad)}")

    def at(self, step: int) -> Tuple[float, float, float]:
        scale = 1.0 if self.warmup_steps == 0 else min(1.0, step / self.warmup_steps)
        return self.pred * scale, self.causal * scale, self.g_reg * scale


@dataclass(frozen=True)
class ScheduledSampling:
    """Share of optimizer steps whose routed pass runs the student's own mask (docs/design.md R2).

    Inference executes what the causal router selects; training on the teacher's mask alone never shows
    the backbone that. share(s) = share_start + min(1, s / ramp_steps)·(share_end − share_start)
    (ramp_steps = 0: share_end throughout). Step s runs the student iff u_s < share(s), with u_s drawn
    from a generator seeded by (seed, s): the same steps on every rank and after a resume.

    Args:
        share_start (float): share at step 0, in [0, 1].
        share_end (float): share from ``ramp_steps`` on, in [0, 1].
        ramp_steps (int): ≥ 0.
    """

    share_start: float
    share_end: float
    ramp_steps: int

    def __post_init__(self) -> None:
        problems = [
            f"scheduled_sampling.{name} must be in [0, 1], got {getattr(self, name)!r}"
            for name in ("share_start", "share_end")
            if not 0 <= getattr(self, name) <= 1
        ]
        if self.ramp_steps < 0:
            problems.append(f"scheduled_sampling.ramp_steps must be ≥ 0, got {self.ramp_steps}")
        if problems:
            raise ValueError("Invalid scheduled_sampling:\n  - " + "\n  - ".join(problems))

    def share(self, step: int) -> float:
        ramp = 1.0 if self.ramp_steps == 0 else min(1.0, step / self.ramp_steps)
        return self.share_start + ramp * (self.share_end - self.share_start)

    def executes_student(self, step: int, seed: int) -> bool:
        share = self.share(step)
        if share <= 0 or share >= 1:
            return share >= 1
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return bool(torch.rand((), generator=generator) < share)


@dataclass(frozen=True)
class CapacityCurriculum:
    """Teacher capacity curriculum: routed layers start by running every token and reach their γ after
    ``ramp_steps`` optimizer steps, γ'(s) = 1 − p(s)·(1 − γ) with p(s) = min(1, s / ramp_steps)
    (``ramp_steps`` = 0: γ from the first step). A pretrained model is moved to sparse execution
    gradually instead of losing half of its tokens' updates at step 0. Applies to top-k teachers;
    a threshold teacher (dynamic capacity) sets its own budget.

    Args:
        ramp_steps (int): ≥ 0.
    """

    ramp_steps: int

    def __post_init__(self) -> None:
        if not (isinstance(self.ramp_steps, int) and not isinstance(self.ramp_steps, bool) and self.ramp_steps >= 0):
            raise ValueError(f"capacity_curriculum.ramp_steps must be an integer ≥ 0, got {self.ramp_steps!r}")

    def progress(self, step: int) -> float:
        return 1.0 if self.ramp_steps == 0 else min(1.0, step / self.ramp_steps)


@dataclass(frozen=True)
class Distillation:
    """Distillation from the pretrained model's dense logits (a frozen copy of the starting weights,
    every layer run on every token): L += weight · T² · KL(p_dense,T ‖ p_routed,T) per target token.

    Args:
        weight (float): ≥ 0; 0 turns it off (no teacher is built).
        temperature (float): T > 0.
    """

    weight: float
    temperature: float

    def __post_init__(self) -> None:
        problems = []
        if not float(self.weight) >= 0:
            problems.append(f"distillation.weight must be ≥ 0, got {self.weight!r}")
        if not float(self.temperature) > 0:
            problems.append(f"distillation.temperature must be > 0, got {self.temperature!r}")
        if problems:
            raise ValueError("Invalid distillation:\n  - " + "\n  - ".join(problems))

    @property
    def enabled(self) -> bool:
        return float(self.weight) > 0
