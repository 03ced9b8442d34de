"""What a good token choice is worth before any training, against dropping whole layers at about the same FLOPs.

The frontier study trains for 60 steps; a routed recipe that trails layer dropping could be held back
by its routers (they choose badly) or by the shape itself (no choice of tokens at that budget beats removing
layers). This probe looks at both on the pretrained model, with no training at all, with three choices of tokens:

- ``oracle``: each routed layer runs the ⌊γT⌋ tokens whose *true* update ‖block(x_t) − x_t‖ is largest (the
  update the full layer would make with every token's context, on the hidden states that earlier routed layers
  actually produced). Non-causal, never deployable, and greedy layer by layer: a strong choice by update size,
  not a bound (without skipped tokens' K/V a token's update among the executed tokens alone differs from the
  full-context one it is ranked by);
- ``random``: ⌊γT⌋ tokens drawn uniformly (seeded), as the random-routing baseline's training teacher chooses;
- ``stt teacher (init)`` (with ``--stt-config``): the untrained STT model in the same shape (routing weights
  initialised as the study's checkpointer does, untrained TPN), in teacher mode at the final γ and β, without
  the forecast update on skipped tokens: top-k on its surprise score.

Both keep the first token (``always_run_first_token``, as every study config does). A skipped token leaves the
layer unchanged. With ``skipped_tokens_write_kv`` the executed tokens attend to every token's keys/values, so
their outputs are the full layer's outputs on those positions; without it the layer runs on the gathered
executed tokens alone (their own keys/values, RoPE at their original positions). Dropped layers run on no
token. The shapes are the study's (``study.yaml``): the same dropped/routed layers and capacities, resolved from
its runs as the study resolves them (``SHAPE_SOURCES``: the planner's placements on ``block_influence.json``), so
each row sits beside the trained run of that name; the probe-only shapes are placements the same parts resolve.

    python experiments/frontier/oracle_probe.py --config configs/quickstart/dense_smollm2.yaml \
        --text quickstart_work/corpus/heldout.jsonl --windows 16 --seq-len 256 \
        --json experiments/frontier/oracle_probe.json --markdown experiments/frontier/oracle_probe.md \
        --stt-config configs/quickstart/stt_smollm2.yaml
    python experiments/frontier/oracle_probe.py --markdown-only \
        --json experiments/frontier/oracle_probe.json --markdown experiments/frontier/oracle_probe.md   # new runs
    python experiments/frontier/oracle_probe.py <the first command's arguments> --only d3_bi6_g75 ...   # new shapes

Evaluated on the study's held-out windows (the same ``heldout_windows`` the study scores trained runs on).
"""

import argparse
import functools
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import config

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script: the checkout's experiments package (the study's parts)

from torchtune_dtf import closed_form  # noqa: E402
from torchtune_dtf.evaluation.routing_report import heldout_loss, heldout_windows, load_trained  # noqa: E402
from torchtune_dtf.models.model_config import ARCH_KEYS  # noqa: E402
from torchtune_dtf.modules import RoutingContext, predictors  # noqa: E402
from torchtune_dtf.training.skip_bias_init import SkippedUpdateStats  # noqa: E402

#: The RMSNorm epsilon of the models the probe runs (SmolLM2's ``norm_eps``), for the fitted maps' inputs.
NORM_EPS = 1e-5

#: The study whose shapes the probe runs in, and whose parts resolve the probe-only shapes.
STUDY = Path(__file__).parent / "study.yaml"


@dataclass(frozen=True)
class Shape:
    """One of the study's compute shapes: whole layers removed, and layers routed at a capacity each."""

    name: str
    dropped: Sequence[int] = ()
    routed: Sequence[int] = ()
    capacity: Sequence[float] = ()
    skipped_tokens_write_kv: bool = True
    study_runs: Sequence[str] = ()  # the study's trained runs of this shape, for the table's last columns

    def capacity_of(self) -> Dict[int, float]:
        if len(self.capacity) != len(self.routed):
            raise ValueError(f"{self.name}: {len(self.routed)} routed layers but {len(self.capacity)} capacities")
        return dict(zip(self.routed, self.capacity))


#: The probe's shapes in table order, grouped by FLOP level: (name, the study's trained runs of that shape, or for a
#: probe-only shape a placement on the study's block influence). A study shape has the dropped and routed layers,
#: capacities and K/V of its runs as the study resolves them (``study.yaml`` composed from its parts: the planner's
#: placement on ``block_influence.json``), which must agree; a probe-only shape is the STT config with skipped
#: tokens' K/V (technique ``kv``) in the placement, resolved by the same parts. No layer list is written here.
SHAPE_SOURCES = (
    ("dense", ("dense",)),
    # ≈ 0.90
    ("layerdrop_4", ("layerdrop_4", "layerdrop_4_distill")),
    ("stt_d2_bi5", ("stt_d2_bi5_all_rlr10", "stt_d2_bi5_all_nocurr_rlr10")),
    ("stt_bi8_graded", ("stt_bi8_graded_all_rlr10",)),
    ("stt_d3_bi4_g75", ("stt_d3_bi4_g75_all_rlr10",)),
    # probe only (not trained): the same ≈ 4.5 layers' worth of skipped work spread thinner, over more layers at a
    # higher γ, in block-influence order; does a mild skip on many layers keep more than a deep one on few?
    ("d2_bi10_g75", {"drop": 2, "route": 10, "capacity": 0.75}),
    ("d3_bi6_g75", {"drop": 3, "route": 6, "capacity": 0.75}),
    ("d1_bi14_g75", {"drop": 1, "route": 14, "capacity": 0.75}),
    ("bi12_g62", {"route": 12, "capacity": 0.625}),
    ("bi18_g75", {"route": 18, "capacity": 0.75}),
    ("all28_g84", {"route": 28, "capacity": 0.84}),
    # ≈ 0.81
    ("layerdrop_7", ("layerdrop_7", "layerdrop_7_distill")),
    ("stt_d4_bi7", ("stt_d4_bi7_all_rlr10",)),
    ("stt_50", ("stt_50", "mod_50", "random_50")),
    ("stt_50_kv", ("stt_50_kv", "stt_50_all")),
    # ≈ 0.72
    ("layerdrop_10", ("layerdrop_10", "layerdrop_10_distill")),
    ("stt_d6_bi10", ("stt_d6_bi10_all_rlr10",)),
)
#: The ranking the probe-only placements are planned on (a ranking of the study's parts).
PROBE_RANKING = "block_influence"


def _as_listed(written, resolved: Sequence[int]) -> List[int]:
    """A config's layer list in the order it lists the layers (a placement name such as ``every_other_inner``:
    the layers it resolves to)."""
    if isinstance(written, (list, tuple)):
        if sorted(int(i) for i in written) != sorted(resolved):
            raise ValueError(f"layers {written} do not resolve to themselves ({list(resolved)})")
        return [int(i) for i in written]
    return list(resolved)


def shape_of_model(name: str, model: Dict, study_runs: Sequence[str] = ()) -> Shape:
    """The :class:`Shape` of a recipe's ``model`` section: its dropped and routed layers in the order it lists them,
    each routed layer's γ as the config pairs them (``routing_config.validate_routing``, through the closed form's
    reading), and whether skipped tokens write K/V."""
    architecture = closed_form.model_shape_from_config(model)
    routing = closed_form.routing_shape_from_model_config(model, architecture.num_layers, architecture.embed_dim)
    dropped = tuple(_as_listed(model.get("dropped_layers"), routing.dropped_layers))
    if not routing.routed_layers:
        return Shape(name, dropped=dropped, study_runs=tuple(study_runs))
    routed = tuple(_as_listed(model.get("routed_layers"), routing.routed_layers))
    gamma = routing.gamma_of()
    return Shape(name, dropped=dropped, routed=routed, capacity=[gamma[layer] for layer in routed],
                 skipped_tokens_write_kv=routing.skipped_tokens_write_kv, study_runs=tuple(study_runs))


@functools.lru_cache(maxsize=None)
def study_shapes(study: Path = STUDY) -> List[Shape]:
    """The shapes of ``SHAPE_SOURCES``, resolved from ``study`` and its parts (seconds: every run of the study is
    resolved)."""
    from experiments.parts import model_section, resolve_runs
    from experiments.spec import load_study

    of_study = {run["name"]: run for run in load_study(study, root=REPO)["runs"]}
    raw = OmegaConf.to_container(OmegaConf.load(study), resolve=True)
    placements = [{"name": name, "config": "stt", "placement": {**source, "by": PROBE_RANKING}, "use": ["kv"]}
                  for name, source in SHAPE_SOURCES if isinstance(source, dict)]
    # resolved with the study's parts and held-out length (the FLOP ratio's), as a run of the study would be
    probe_only = {run["name"]: run for run in resolve_runs(
        {"parts": raw.get("parts"), "heldout": raw.get("heldout"), "runs": placements}, study, REPO)}

    def shape_of_run(name: str, run: Dict, study_runs: Sequence[str]) -> Shape:
        return shape_of_model(name, model_section(REPO / run["config"], run["overrides"]), study_runs)

    shapes = []
    for name, source in SHAPE_SOURCES:
        if isinstance(source, dict):
            shapes.append(shape_of_run(name, probe_only[name], ()))
            continue
        missing = [run for run in source if run not in of_study]
        if missing:
            raise ValueError(f"shape {name}: {study} has no run {missing}")
        of_runs = [shape_of_run(name, of_study[run], source) for run in source]
        differ = [run for run, shape in zip(source, of_runs) if asdict(shape) != asdict(of_runs[0])]
        if differ:
            raise ValueError(f"shape {name}: the study's runs {differ} are not in the shape of {source[0]}")
        shapes.append(of_runs[0])
    return shapes


def __getattr__(name: str):
    """``SHAPES``: :func:`study_shapes` of the frontier study, resolved when first read."""
    if name == "SHAPES":
        return study_shapes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SELECTIONS = ("oracle", "random")
STT_AT_INIT = "stt teacher (init)"


def executed_positions(update_norm: torch.Tensor, capacity: float, selection: str,
                       generator: Optional[torch.Generator]) -> torch.Tensor:
    """[b, T] update sizes → [b, k] sorted positions each sequence runs (k = ⌊γT⌋, the first token always)."""
    b, seq_len = update_norm.shape
    k = math.floor(capacity * seq_len)
    if selection == "oracle":
        score = update_norm.float().clone()
    elif selection == "random":
        score = torch.rand(b, seq_len, generator=generator).to(update_norm.device)
    else:
        raise ValueError(f"unknown selection {selection!r}; expected one of {SELECTIONS}")
    score[:, 0] = float("inf")
    return score.topk(k, dim=-1).indices.sort(dim=-1).values


class SkippedUpdateSums:
    """Running sums, per layer, of the true update ``block(x_t) − x_t`` [d] of the tokens a layer does not run (a
    dropped layer: every token but the first, whose attention-sink update is outsized; a routed layer: the tokens
    not selected). ``means()`` gives the mean skipped update per layer; where the inputs ``x_t`` were added too,
    ``linear_maps()`` gives the least-squares affine map from the normalised input to the update. The sums and the
    solve are the package's (:class:`~torchtune_dtf.training.skip_bias_init.SkippedUpdateStats`, what
    ``skip_bias_init`` fits the model's skip maps with); this adds the probes' normalisation of the inputs."""

    def __init__(self) -> None:
        self.stats = SkippedUpdateStats()

    @property
    def counts(self) -> Dict[int, int]:
        return {layer: int(count) for layer, count in self.stats.counts.items()}

    def add(self, layer: int, updates: torch.Tensor, inputs: Optional[torch.Tensor] = None) -> None:
        """``updates`` [n, d]: the true updates of n skipped tokens; ``inputs`` [n, d]: those tokens' layer inputs."""
        self.stats.add(layer, updates, None if inputs is None else rms_normalised(inputs))

    def means(self) -> Dict[int, torch.Tensor]:
        return {layer: self.stats.mean(layer) for layer in self.stats.sums}

    def linear_maps(self, ridge: float) -> Dict[int, "AffineUpdate"]:
        """Per layer, ``argmin_{W,b} Σ ‖Δ_t − W·rms(x_t) − b‖² + ridge·‖W‖²`` over the tokens added with inputs."""
        return {layer: AffineUpdate(self.stats.ridge_solution(layer, ridge).float()) for layer in self.stats.gram}


def rms_normalised(x: torch.Tensor) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension with SmolLM2's epsilon (what :class:`SkipLinear` feeds its map)."""
    return predictors.rms_normalised(x, NORM_EPS)


def _with_one(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


class AffineUpdate:
    """An update predicted from the layer input: ``[..., d] → [..., d]``, ``W·rms(x) + b`` with ``solution``
    ``[d+1, d]`` stacking ``Wᵀ`` over ``b``."""

    def __init__(self, solution: torch.Tensor) -> None:
        self.solution = solution

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _with_one(rms_normalised(x)) @ self.solution.to(x.dtype)


@torch.no_grad()
def shape_loss(model, windows: torch.Tensor, shape: Shape, selection: str, batch_size: int, seed: int,
               skip_updates: Optional[Dict[int, torch.Tensor]] = None,
               skipped_sums: Optional[SkippedUpdateSums] = None) -> Dict:
    """Mean next-token loss over ``windows`` [n, T] of the pretrained model run in ``shape``; executed share.

    ``skip_updates`` {layer: [d] or a callable [b, T, d] → [b, T, d]}: what the tokens a dropped or routed layer
    does not run receive instead of nothing: a constant update (``skip_update: bias`` with that value) or one
    computed from the layer input (an :class:`AffineUpdate`). ``skipped_sums``: filled with the true updates of
    those tokens and their inputs (runs the dropped layers' blocks too, to measure them)."""
    capacity = shape.capacity_of()
    skip_updates = skip_updates or {}
    generator = torch.Generator().manual_seed(seed)
    total, count, executed, offered = 0.0, 0, 0, 0
    for batch in windows.split(batch_size):
        h = model.tok_embeddings(batch)
        b, seq_len = batch.shape
        for i, layer in enumerate(model.layers):
            if i in shape.dropped:
                offered += b * seq_len
                if skipped_sums is not None:
                    skipped_sums.add(i, (layer(h) - h)[:, 1:].flatten(0, 1), h[:, 1:].flatten(0, 1))
                if i in skip_updates:
                    h = h + _skip_update(skip_updates[i], h)
                continue
            if i not in capacity:
                h = layer(h)
                continue
            full = layer(h)
            positions = executed_positions((full - h).norm(dim=-1), capacity[i], selection, generator)
            index = positions.unsqueeze(-1).expand(-1, -1, h.size(-1))
            skipped = torch.ones(b, seq_len, dtype=torch.bool, device=h.device).scatter(1, positions, False)
            if skipped_sums is not None:
                skipped_sums.add(i, (full - h)[skipped], h[skipped])
            if shape.skipped_tokens_write_kv:
                update = full.gather(1, index)
            else:
                # the executed tokens alone: their own keys/values, RoPE at their original positions
                update = layer(h.gather(1, index), input_pos=positions)
            if i in skip_updates:
                h = h + _skip_update(skip_updates[i], h) * skipped.unsqueeze(-1)
            h = h.scatter(1, index, update)
            executed += positions.numel()
            offered += b * seq_len
        logits = model.output(model.norm(h)).float()
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return {"loss": total / count, "executed_share_of_routed_and_dropped": executed / offered if offered else None}


def _skip_update(update, h: torch.Tensor) -> torch.Tensor:
    return update(h) if callable(update) else update


def stt_teacher_at_init(stt_cfg, shape: Shape, windows: torch.Tensor, batch_size: int) -> Dict:
    """Held-out loss of the untrained STT model in ``shape``, teacher mode (top-k on surprise at the final β)."""
    cfg = stt_cfg.copy()
    routing = {"dropped_layers": list(shape.dropped), "routed_layers": list(shape.routed),
               "capacity": list(shape.capacity), "skipped_tokens_write_kv": shape.skipped_tokens_write_kv,
               "skip_update": "none"}
    for key, value in routing.items():
        OmegaConf.update(cfg, f"model.{key}", value)
    model = load_trained(cfg, cfg.checkpointer.checkpoint_dir)
    beta = cfg.beta_schedule
    teacher = RoutingContext(mode="teacher", beta_ce=float(beta.beta_ce_end), beta_cu=float(beta.beta_cu_end))
    return {"loss": heldout_loss(model, windows, teacher, batch_size),
            "executed_share_of_routed_and_dropped": None}


def shape_flops_ratio(stt_model: Dict, shape: Shape, seq_len: int) -> float:
    """Closed-form forward FLOPs per token of ``shape`` against dense (``torchtune_dtf/closed_form.py``), as the study
    counts its runs: a routed shape is the STT student of ``stt_model`` (the STT config's ``model`` section) at γ per
    routed layer, its routers included, nothing on the skip path; a shape without routed layers is layer dropping."""
    if shape.routed:
        model = {**stt_model, "dropped_layers": list(shape.dropped), "routed_layers": list(shape.routed),
                 "capacity": list(shape.capacity), "skipped_tokens_write_kv": shape.skipped_tokens_write_kv,
                 "skip_update": "none"}
    else:
        model = {key: value for key, value in stt_model.items() if key in ARCH_KEYS}
        model.update(variant="layerdrop" if shape.dropped else "dense", dropped_layers=list(shape.dropped))
    architecture = closed_form.model_shape_from_config(model)
    routing = closed_form.routing_shape_from_model_config(model, architecture.num_layers, architecture.embed_dim)
    return float(closed_form.per_token_compute(architecture, routing, seq_len)["forward_flops_ratio"])


def trained_run_summary(runs_dir: Path, name: str) -> Optional[Dict[str, float]]:
    """The study's student held-out loss and forward FLOPs ratio of run ``name``, mean over its seeds."""
    runs = [json.loads(p.read_text()) for p in sorted(runs_dir.glob(f"{name}__seed*.json"))]
    if not runs:
        return None
    return {"seeds": len(runs), "student_loss": statistics.mean(r["heldout"]["student_loss"] for r in runs),
            "flops": statistics.mean(r["compute"]["forward_flops_ratio"] for r in runs)}


def markdown(probe: Dict, runs_dir: Path) -> str:
    """The probe's table (one row per shape and choice) with the study's trained runs of each shape beside it."""
    rows = probe["rows"]
    dense = next(r["loss"] for r in rows if r["shape"]["name"] == "dense")
    stt_model = OmegaConf.to_container(OmegaConf.load(probe["stt_config"]).model) if probe.get("stt_config") else None
    lines = ["# Token choice before training: hindsight, random and STT's own choice against layer dropping", "",
             f"Written by `python experiments/frontier/oracle_probe.py` (its docstring says what it does): the "
             f"pretrained model with no training, held-out loss per token on {probe['windows']} windows of "
             f"{probe['seq_len']} tokens of `{probe['text']}` (the study's held-out windows). Shapes as in "
             "`study.yaml`; K/V: skipped tokens still write keys/values; selection `oracle`: the largest true "
             "updates in hindsight; `stt teacher (init)`: the untrained STT model's teacher (top-k on surprise, "
             f"final γ and β). The last column is the study's trained runs of each shape (`{runs_dir}`; student "
             "held-out loss and measured forward FLOPs, mean over the seeds landed): what 60 steps of training make "
             "of the shape. FLOPs: closed-form forward FLOPs per token against dense (`torchtune_dtf/closed_form.py`) "
             "of the shape as the STT student at γ (routers counted, nothing on the skip path), or as layer dropping; "
             "shapes without a trained run are probes only.", "",
             "| shape | FLOPs | dropped | routed (γ) | K/V | selection | loss | − dense | trained in the study: run, "
             "seeds, FLOPs, student loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        flops = "–"
        if stt_model is not None:
            shape = Shape(**{key: tuple(value) if isinstance(value, list) else value for key, value in s.items()})
            flops = f"{shape_flops_ratio(stt_model, shape, probe['seq_len']):.3f}"
        routed = ", ".join(f"{layer} ({c:g})" for layer, c in zip(s["routed"], s["capacity"])) or "–"
        dropped = ", ".join(map(str, s["dropped"])) or "–"
        kv = ("yes" if s["skipped_tokens_write_kv"] else "no") if s["routed"] else "–"
        study = []
        if r["selection"] in ("all", "oracle"):  # once per shape
            for name in s["study_runs"]:
                t = trained_run_summary(runs_dir, name)
                if t:
                    study.append(f"`{name}` ({t['seeds']}) {t['flops']:.3f}: {t['student_loss']:.3f}")
        lines.append(f"| {s['name']} | {flops} | {dropped} | {routed} | {kv} | {r['selection']} | {r['loss']:.3f} | "
                     f"{r['loss'] - dense:+.3f} | {'; '.join(study)} |")
    return "\n".join(lines) + "\n"


def merged(earlier: Dict, new: Dict) -> Dict:
    """``earlier`` with ``new``'s rows in place of its rows of the same shapes, in SHAPES order; the settings of
    both must agree (rows measured on other windows or another seed would not compare)."""
    settings = ("config", "stt_config", "text", "windows", "seq_len", "seed")
    differ = [k for k in settings if earlier.get(k) != new.get(k)]
    if differ:
        raise ValueError(f"--only: the existing probe was measured with other {differ}: "
                         f"{ {k: earlier.get(k) for k in differ} } vs { {k: new.get(k) for k in differ} }")
    remeasured = {row["shape"]["name"] for row in new["rows"]}
    rows = [row for row in earlier["rows"] if row["shape"]["name"] not in remeasured] + new["rows"]
    order = {shape.name: i for i, shape in enumerate(study_shapes())}
    rows.sort(key=lambda row: order.get(row["shape"]["name"], len(order)))  # stable: a shape's rows keep their order
    return {**earlier, "rows": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="the dense training config (model, tokenizer, checkpointer)")
    parser.add_argument("--text", type=Path, help="JSONL with a 'text' field (the held-out works)")
    parser.add_argument("--windows", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random selection")
    parser.add_argument("--json", type=Path, required=True, help="written; read alone with --markdown-only")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--stt-config", help="also the untrained STT teacher in each routed shape (study's STT config)")
    parser.add_argument("--runs", type=Path, default=Path(__file__).parent / "runs", help="the study's run JSONs")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite --markdown from --json (new runs)")
    parser.add_argument("--only", nargs="+", metavar="SHAPE",
                        help="measure these shapes alone and merge their rows into the existing --json")
    args = parser.parse_args(argv)
    if args.markdown_only:
        if not args.markdown:
            parser.error("--markdown-only needs --markdown")
        args.markdown.write_text(markdown(json.loads(args.json.read_text()), args.runs))
        return
    missing = [f"--{k.replace('_', '-')}" for k in ("config", "text", "windows", "seq_len") if getattr(args, k) is None]
    if missing:
        parser.error(f"measuring needs {', '.join(missing)}")
    cfg = OmegaConf.load(args.config)
    model = load_trained(cfg, cfg.checkpointer.checkpoint_dir)  # the stock pretrained folder
    windows = heldout_windows(config.instantiate(cfg.tokenizer), args.text, args.seq_len, args.windows)
    shapes = study_shapes()
    if args.only:
        unknown = sorted(set(args.only) - {shape.name for shape in shapes})
        if unknown:
            parser.error(f"--only: no shape named {unknown}; known: {[shape.name for shape in shapes]}")
        shapes = [shape for shape in shapes if shape.name in args.only]
    rows = []
    for shape in shapes:
        for selection in SELECTIONS if shape.routed else ("all",):
            result = shape_loss(model, windows, shape, "oracle" if selection == "all" else selection,
                                args.batch_size, args.seed)
            rows.append({"shape": asdict(shape), "selection": selection, **result})
            print(f"{shape.name:14s} {selection:7s} loss {result['loss']:.3f}", flush=True)
        if args.stt_config and shape.routed:
            result = stt_teacher_at_init(OmegaConf.load(args.stt_config), shape, windows, args.batch_size)
            rows.append({"shape": asdict(shape), "selection": STT_AT_INIT, **result})
            print(f"{shape.name:14s} {STT_AT_INIT} loss {result['loss']:.3f}", flush=True)
    probe = {"config": args.config, "stt_config": args.stt_config, "text": str(args.text), "windows": args.windows,
             "seq_len": args.seq_len, "seed": args.seed, "rows": rows}
    if args.only:
        probe = merged(json.loads(args.json.read_text()), probe)
    args.json.write_text(json.dumps(probe, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(probe, args.runs))


if __name__ == "__main__":
    main()
