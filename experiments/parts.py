"""Runs composed from named parts: config files by name, techniques (named sets of overrides), and placements
planned on a measured layer ranking by the package's planner (``torchtune_dtf.plan``), with names generated from
the parts.

A composed run resolves to the same plain ``{name, config, overrides}`` a run written out key by key is, and that
is what the driver trains and ``study.json`` records: composing a study changes nothing it trains.

Parts
-----
At the top of a study file, or in a parts file the study names (``parts: PATH`` or a list of paths; a parts file
holds only these three sections). A name defined twice, in either place, is an error::

    configs:                               # config files by name: a run's ``config`` may be one of these names
      stt: configs/quickstart/stt_smollm2.yaml
    techniques:                            # named overrides; a list names techniques defined above it
      kv: {model.skipped_tokens_write_kv: True}
      curr: {capacity_curriculum.ramp_steps: 20}
      all: [kv, curr]
      nocurr: {capacity_curriculum.ramp_steps: 0}   # defined after `curr`: a run that uses both gets 0
    rankings:                              # measured layer rankings, as ``python -m torchtune_dtf.plan --json`` writes
      block_influence: experiments/frontier/block_influence.json

Runs
----
::

    - config: stt                          # a name of ``configs``, or a path
      placement: {drop: 5, route: 6, by: block_influence}
      use: [all, nocurr]                   # techniques
      overrides: {model.gate: scaled}      # optional, applied last
      name: stt_d5_bi6_all_nocurr          # optional where the parts can generate it (this is what they generate)

A **placement** ``{drop: K, route: N, capacity: γ, by: RANKING, order: influence | layer}`` is planned by
``torchtune_dtf.plan.plan_layers`` on the ranking's inner layers, least influential first
(``inner_layers_by_influence`` of the measured influence): the first K dropped whole, the next N routed at γ. In
place of ``route``, ``target_flops: f`` routes the fewest layers whose closed-form forward FLOP ratio is at most f
(at the study's held-out ``seq_len``, with the config's model section after the run's techniques and overrides).
``capacity`` is one γ or one per routed layer, written as given (a list needs ``route``, of its length, and pairs
with the layers in the order the run's ``routed_layers`` lists them, as a config's does: the planner's ranking
order, or index order with ``order: layer``; the planner is given it in its ranking order). Left out, the config's
own γ is planned with and no ``model.capacity`` is written. A layerdrop config takes ``drop`` or ``target_flops``
alone. ``order: layer`` lists the layers by index (the layer-dropping baselines list theirs so) instead of the
planner's order.
``{capacity: γ}`` alone sets γ on the config's own routed layers and plans nothing.

A run's overrides are, in this order: the placement's (``model.dropped_layers`` when it drops a layer or the config
drops any, ``model.routed_layers``, ``model.capacity`` when it names one), the techniques', and its own
``overrides``. The techniques a run uses (lists expanded into their members) apply in the order they are defined,
so where two set one key the later definition wins, whatever order the run lists them in; their keys come out in
the order the definitions first name them. The run's own overrides win over its techniques' and may not set a key
its placement sets.

A run without a ``name`` is named ``<config>_<placement>_<technique>_…``: the config's name; for a layerdrop config
the number of dropped layers (``layerdrop_4``), else ``d<K>_bi<N>`` (``d<K>_`` left out when nothing is dropped) and
``_g<γ>`` when the placement names γ (0.625 → ``g625``), or γ alone for ``{capacity: γ}`` (``stt_75``); then the
techniques in the order the run lists them. A path as config, or one γ per routed layer, needs a ``name``.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from experiments import StudyError

PART_KEYS = ("configs", "techniques", "rankings")
RUN_KEYS = ("name", "config", "placement", "use", "overrides")
PLACEMENT_KEYS = ("drop", "route", "target_flops", "capacity", "by", "order")
PLACED_KEYS = ("model.dropped_layers", "model.routed_layers", "model.capacity")


class Parts:
    """The named parts a study's runs may use, in the order they were defined (parts files first)."""

    def __init__(self, root: Path):
        self.root = root
        self.configs: Dict[str, str] = {}
        self.techniques: Dict[str, Any] = {}
        self.rankings: Dict[str, str] = {}
        self._ranking_cache: Dict[str, List[int]] = {}

    def add(self, section: Mapping[str, Any], where: str) -> None:
        """Add the ``configs`` / ``techniques`` / ``rankings`` of ``section`` (a study or a parts file)."""
        for kind in PART_KEYS:
            defined = getattr(self, kind)
            entries = section.get(kind) or {}
            if not isinstance(entries, dict):
                raise StudyError(f"{where}: {kind} must map names to definitions, got {entries!r}")
            for name, value in entries.items():
                if name in defined:
                    raise StudyError(f"{where}: {kind[:-1]} {name!r} is defined twice")
                if kind == "techniques":
                    value = self._checked_technique(name, value, where)
                elif not isinstance(value, str):
                    raise StudyError(f"{where}: {kind[:-1]} {name!r} must be a path, got {value!r}")
                defined[name] = value

    def _checked_technique(self, name: str, value: Any, where: str) -> Any:
        if isinstance(value, dict) and all(isinstance(key, str) for key in value):
            return dict(value)
        if isinstance(value, list) and value and all(isinstance(member, str) for member in value):
            unknown = [member for member in value if member not in self.techniques]
            if unknown:
                raise StudyError(f"{where}: technique {name!r} names {unknown}, which are not techniques defined "
                                 "above it")
            return list(value)
        raise StudyError(f"{where}: technique {name!r} must be overrides {{key: value}} or a list of techniques, "
                         f"got {value!r}")

    def members(self, names: Sequence[str], where: str) -> set:
        """The techniques with overrides of their own that ``names`` stand for (lists expanded)."""
        out = set()
        for name in names:
            if name not in self.techniques:
                raise StudyError(f"{where}: unknown technique {name!r} (defined: {sorted(self.techniques)})")
            value = self.techniques[name]
            out |= self.members(value, where) if isinstance(value, list) else {name}
        return out

    def technique_overrides(self, names: Sequence[str], where: str) -> Dict[str, Any]:
        """The overrides of the techniques ``names``: applied in definition order, keyed in first-named order."""
        chosen = self.members(names, where)
        merged: Dict[str, Any] = {}
        order: Dict[str, None] = {}
        for name, value in self.techniques.items():
            if isinstance(value, dict):
                order.update(dict.fromkeys(value))
                if name in chosen:
                    merged.update(value)
        return {key: merged[key] for key in order if key in merged}

    def ranking(self, name: str, where: str) -> List[int]:
        """The inner layers of the ranking ``name``, least influential first."""
        if name not in self.rankings:
            raise StudyError(f"{where}: placement by {name!r}, which is not a ranking of the study "
                             f"(defined: {sorted(self.rankings)})")
        if name not in self._ranking_cache:
            self._ranking_cache[name] = read_ranking(self.root / self.rankings[name])
        return self._ranking_cache[name]


def read_ranking(path: Path) -> List[int]:
    """Inner layers, least influential first, from a measurement file (``block_influence``: one value per layer;
    a stored ``inner_layers_by_influence`` must agree with it)."""
    from torchtune_dtf.plan import inner_layers_by_influence

    if not path.is_file():
        raise StudyError(f"ranking file {str(path)!r} does not exist")
    data = json.loads(path.read_text())
    if "block_influence" not in data:
        raise StudyError(f"{path}: no block_influence (one value per layer) to rank the layers by")
    ranking = inner_layers_by_influence(data["block_influence"])
    stored = data.get("inner_layers_by_influence")
    if stored is not None and list(stored) != ranking:
        raise StudyError(f"{path}: inner_layers_by_influence {stored} is not the ranking of its block_influence "
                         f"({ranking})")
    return ranking


def capacity_digits(gamma: float) -> str:
    """γ as names write it: its decimals (0.625 → 625, 0.75 → 75; 1 → 1)."""
    return format(gamma, "g").removeprefix("0.").replace(".", "")


def model_section(config_file: Path, overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """The config's ``model`` section with ``overrides`` applied (what the planner's closed form reads)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config_file)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return OmegaConf.to_container(cfg.model, resolve=True)


def place(placement: Any, model: Dict[str, Any], parts: Parts, seq_len: Optional[int],
          where: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """A placement's overrides and its piece of a generated name (None where a name cannot say it)."""
    if not isinstance(placement, dict) or set(placement) - set(PLACEMENT_KEYS):
        raise StudyError(f"{where}: placement takes {list(PLACEMENT_KEYS)}, got {placement!r}")
    capacity = placement.get("capacity")
    per_layer = isinstance(capacity, list)
    if capacity is not None and not (isinstance(capacity, (int, float)) or per_layer):
        raise StudyError(f"{where}: placement capacity must be a number or a list of them, got {capacity!r}")
    if set(placement) <= {"capacity"}:
        if capacity is None or per_layer:
            raise StudyError(f"{where}: a placement without drop / route / target_flops sets one capacity, "
                             f"got {placement!r}")
        return {"model.capacity": capacity}, capacity_digits(capacity)
    from torchtune_dtf import closed_form
    from torchtune_dtf.plan import plan_layers

    if "by" not in placement:
        raise StudyError(f"{where}: placement {placement!r} needs by: RANKING (one of {sorted(parts.rankings)})")
    order = placement.get("order", "influence")
    if order not in ("influence", "layer"):
        raise StudyError(f"{where}: placement order is influence or layer, got {order!r}")
    if seq_len is None:
        raise StudyError(f"{where}: a placement needs the study's heldout.seq_len (the FLOP ratio's length)")
    ranking = parts.ranking(placement["by"], where)
    variant = closed_form.variant_of_model_config(model)
    planned_capacity = capacity
    if variant != "layerdrop" and capacity is None:
        planned_capacity = model.get("capacity")
        if not isinstance(planned_capacity, (int, float)):
            raise StudyError(f"{where}: the config's capacity {planned_capacity!r} is not one γ: give the "
                             "placement a capacity")
    drop = placement.get("drop", None if variant == "layerdrop" else 0)  # a routed plan drops nothing unless told
    arrange = sorted if order == "layer" else list

    def plan_with(gamma):
        try:
            return plan_layers(model, ranking, seq_len=int(seq_len), drop=drop, route=placement.get("route"),
                               capacity=gamma, target_flops=placement.get("target_flops"))
        except ValueError as err:  # the planner refuses a per-layer capacity of another length than route
            raise StudyError(f"{where}: placement {placement!r}: {err}") from err

    plan = plan_with(planned_capacity)
    if per_layer and order == "layer":
        # The list pairs with routed_layers as the run writes them (by index); the planner's with its ranking
        # order. Which layers are routed does not depend on γ (route is given), only their FLOP ratio does.
        from torchtune_dtf.models.routing_config import capacity_per_layer

        plan = plan_with(capacity_per_layer(arrange(plan.routed_layers), plan.routed_layers, capacity))
    overrides: Dict[str, Any] = {}
    if plan.dropped_layers or model.get("dropped_layers"):
        overrides["model.dropped_layers"] = arrange(plan.dropped_layers)
    if variant == "layerdrop":
        return overrides, str(len(plan.dropped_layers))
    overrides["model.routed_layers"] = arrange(plan.routed_layers)
    if capacity is not None:
        overrides["model.capacity"] = capacity
    if per_layer:
        return overrides, None
    dropped = len(plan.dropped_layers)
    piece = (f"d{dropped}_" if dropped else "") + f"bi{len(plan.routed_layers)}"
    return overrides, piece + (f"_g{capacity_digits(capacity)}" if capacity is not None else "")


def resolve_run(run: Any, parts: Parts, seq_len: Optional[int], where: str) -> Dict[str, Any]:
    """One run of the study file as ``{name, config, overrides}``."""
    if not isinstance(run, dict) or set(run) - set(RUN_KEYS):
        raise StudyError(f"{where}: a run takes {list(RUN_KEYS)}, got {run!r}")
    named_config = isinstance(run.get("config"), str) and run["config"] in parts.configs
    if set(run) <= {"name", "config", "overrides"} and not named_config:
        return dict(run)  # written out key by key, as studies were before parts
    where = f"{where} ({run['name']})" if "name" in run else where
    if "config" not in run:
        raise StudyError(f"{where}: the run has no config")
    config_name = run["config"] if named_config else None
    config = parts.configs.get(run["config"], run["config"])
    use = run.get("use") or []
    if not isinstance(use, list) or not all(isinstance(name, str) for name in use):
        raise StudyError(f"{where}: use must be a list of technique names, got {use!r}")
    own = dict(run.get("overrides") or {})
    techniques = parts.technique_overrides(use, where)
    placed: Dict[str, Any] = {}
    piece: Optional[str] = ""
    if run.get("placement") is not None:
        model = model_section(parts.root / config, {**techniques, **own})
        placed, piece = place(run["placement"], model, parts, seq_len, where)
        clash = sorted(set(placed) & set(own))
        if clash:
            raise StudyError(f"{where}: overrides {clash} set what the placement sets")
    name = run.get("name")
    if name is None:
        if config_name is None or piece is None:
            raise StudyError(f"{where}: no name, and none can be generated "
                             + ("(config is a path, not a name of configs)" if config_name is None
                                else "(one capacity per routed layer)"))
        name = "_".join([config_name] + ([piece] if piece else []) + use)
    return {"name": name, "config": config, "overrides": {**placed, **techniques, **own}}


def resolve_runs(study: Dict[str, Any], path: Path, root: Path) -> List[Dict[str, Any]]:
    """The study's ``runs`` resolved from their parts; the parts sections (``parts``, ``configs``, ``techniques``,
    ``rankings``) are taken out of ``study``."""
    from omegaconf import OmegaConf

    parts = Parts(root)
    files = study.pop("parts", None) or []
    for file in [files] if isinstance(files, str) else files:
        source = root / file
        if not source.is_file():
            raise StudyError(f"{path}: parts file {str(source)!r} does not exist")
        section = OmegaConf.to_container(OmegaConf.load(source), resolve=True) or {}
        extra = sorted(set(section) - set(PART_KEYS))
        if extra:
            raise StudyError(f"{source}: a parts file holds {list(PART_KEYS)} only, not {extra}")
        parts.add(section, str(source))
    parts.add({kind: study.pop(kind) for kind in PART_KEYS if kind in study}, str(path))
    seq_len = (study.get("heldout") or {}).get("seq_len")
    return [resolve_run(run, parts, seq_len, f"{path}: runs[{index}]")
            for index, run in enumerate(study.get("runs") or [])]
