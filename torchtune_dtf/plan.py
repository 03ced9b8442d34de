"""Layer planner: which layers of a pretrained model to drop whole and which to route, measured on your text.

The frontier study's rule (``experiments/frontier/``): rank the inner layers by *block influence* on the training
text, drop the least influential whole, route the next ones at capacity γ, and keep the rest dense. The first and
the last layer are never dropped nor routed. Block influence (ShortGPT's measure) of layer l is

    BI_l = 1 − E_t[cos(x_t^(l−1), x_t^(l))],

the mean over tokens of how far the layer turns each token's hidden state, measured on the config's *starting*
weights (the dense model, every layer on every token) and on training text, never on the held-out text a run is
scored on.

    # the study's ≈ 0.81 recipe for the quickstart model: drop 5, route the next 6 at γ = 0.5
    python -m torchtune_dtf.plan --config configs/quickstart/stt_smollm2.yaml --drop 5 --route 6 --capacity 0.5
    # as many routed layers as a FLOP target needs (closed form, prefill at the measured length)
    python -m torchtune_dtf.plan --config CFG --drop 4 --capacity 0.5 --target-flops 0.81 --write my_recipe.yaml
    # one γ per routed layer, in ranking order: the 2 least influential of the 4 routed at 0.25, the next 2 at 0.75
    python -m torchtune_dtf.plan --config CFG --drop 0 --route 4 --capacity 0.25 0.25 0.75 0.75
    # layer dropping alone (a ``layerdrop`` config): the fewest dropped layers that reach the target
    python -m torchtune_dtf.plan --config configs/quickstart/layerdrop_smollm2.yaml --target-flops 0.81

The text is ``--data`` (JSONL with a ``text`` field) or else the config's ``dataset.data_files``; it is cut into
the first ``--windows`` windows of ``--seq-len`` tokens (default: the tokenizer's ``max_seq_len``, the length the
recipe trains on), and the FLOP ratio is the closed form's (``torchtune_dtf.closed_form``) forward at that length,
with the config's own technique keys (K/V kept, forecast, router sizes). ``--write`` saves the config with the
planned ``dropped_layers`` / ``routed_layers`` / ``capacity`` in place (every other line, comments included, as it
was); ``--json`` saves the measurement.

``--capacity`` is one γ for every routed layer, or one per routed layer (then ``--route`` gives their number): the
*k*-th value is the γ of the *k*-th routed layer in ranking order, which is the order the plan lists
``routed_layers`` in, and configs pair a ``capacity`` list with ``routed_layers`` in the order it lists them
(``torchtune_dtf.models.routing_config.capacity_per_layer``).
"""

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from torchtune_dtf import closed_form
from torchtune_dtf.atomic_write import atomic_write_text

_COMMAND_PREFIX = "# python -m torchtune_dtf.plan"
#: The keys of a config's ``model`` section that a plan sets.
PLANNED_KEYS = ("dropped_layers", "routed_layers", "capacity")
#: γ of the routed layers: one for all of them, or one per routed layer in ranking order.
Capacity = Union[float, Sequence[float]]


@torch.no_grad()
def block_influence(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 4) -> List[float]:
    """Block influence of every layer of a dense decoder.

    Args:
        model: a dense ``TransformerDecoder`` (``tok_embeddings``, ``layers``), evaluation mode.
        windows: token ids ``[n, T]``.
        batch_size: windows per forward.

    Returns:
        List[float]: per layer, 1 − the mean over the ``n·T`` tokens of cos(layer input, layer output).
    """
    totals = torch.zeros(len(model.layers), dtype=torch.float64)
    for batch in windows.split(batch_size):
        hidden = model.tok_embeddings(batch)
        for index, layer in enumerate(model.layers):
            out = layer(hidden)
            totals[index] += (1 - F.cosine_similarity(hidden.float(), out.float(), dim=-1)).double().sum()
            hidden = out
    return (totals / windows.numel()).tolist()


def inner_layers_by_influence(influence: Sequence[float]) -> List[int]:
    """The inner layers (not the first, not the last), least influential first (ties: lower index first)."""
    return sorted(range(1, len(influence) - 1), key=lambda layer: (influence[layer], layer))


@dataclass(frozen=True)
class Plan:
    """Which layers a recipe drops and routes.

    Attributes:
        dropped_layers: layers that run on no token, least influential first.
        routed_layers: layers routed at ``capacity``, in ranking order (a config may list them in any order).
        capacity: γ of every routed layer, or a list of one γ per layer of ``routed_layers`` in its order
            (``None`` for layer dropping alone).
        flop_ratio: closed-form forward FLOPs / dense at ``seq_len`` (student mode, routers included).
        seq_len: the length the ratio is computed at.
    """

    dropped_layers: List[int]
    routed_layers: List[int]
    capacity: Optional[Union[float, List[float]]]
    flop_ratio: float
    seq_len: int

    def model_values(self) -> Dict[str, object]:
        """The ``model`` keys a config gets (a layer-dropping plan sets ``dropped_layers`` only); a per-layer
        ``capacity`` is written as its list, paired with ``routed_layers`` in the order both list them."""
        values: Dict[str, object] = {"dropped_layers": list(self.dropped_layers)}
        if self.routed_layers:
            capacity = list(self.capacity) if isinstance(self.capacity, list) else self.capacity
            values.update(routed_layers=list(self.routed_layers), capacity=capacity)
        return values


def _flop_ratio(model_section: Mapping, values: Mapping, seq_len: int) -> float:
    return closed_form.model_config_flop_ratio({**model_section, **values}, seq_len)


def _capacities(capacity: Optional[Capacity]) -> Optional[Union[float, List[float]]]:
    """``capacity`` as the plan holds it: None, one float, or a list of floats (one value given as a list of one
    is that value)."""
    if capacity is None or isinstance(capacity, (int, float)):
        return None if capacity is None else float(capacity)
    if isinstance(capacity, str):
        raise ValueError(f"--capacity must be numbers, got {capacity!r}")
    values = [float(value) for value in capacity]
    if not values:
        raise ValueError("--capacity lists no value: give one γ, or one per routed layer")
    return values[0] if len(values) == 1 else values


def plan_layers(
    model_section: Mapping,
    ranking: Sequence[int],
    *,
    seq_len: int,
    drop: Optional[int] = None,
    route: Optional[int] = None,
    capacity: Optional[Capacity] = None,
    target_flops: Optional[float] = None,
) -> Plan:
    """Drop the first ``drop`` layers of ``ranking`` and route the next ``route`` at ``capacity``.

    A routed config (variant mod / sdt / stt / random) needs ``drop`` and ``capacity``, and either ``route`` or
    ``target_flops``: then ``route`` is the fewest layers whose closed-form FLOP ratio is at most the target. A
    ``layerdrop`` config takes either ``drop`` or ``target_flops`` (the fewest dropped layers that reach it).
    ``capacity`` may list one γ per routed layer, in ranking order; then ``route`` must be given and equal its
    length (the layers do not depend on γ: only their FLOP ratio does).

    Args:
        model_section: the config's ``model`` section (architecture and the technique keys the closed form reads).
        ranking: inner layers, least influential first (:func:`inner_layers_by_influence`).
        seq_len: the length the FLOP ratio is computed at.
        drop: whole layers to drop.
        route: layers to route.
        capacity: γ of the routed layers: one value, or one per routed layer in ranking order.
        target_flops: a forward FLOP ratio to reach instead of a given count.

    Returns:
        Plan: the layer lists and their FLOP ratio.

    Raises:
        ValueError: on a missing or contradictory count, more layers than the ranking holds, a target that no
            count reaches, or a per-layer capacity whose length is not the number of routed layers.
    """
    variant = closed_form.variant_of_model_config(model_section)
    ranking = list(ranking)
    capacity = _capacities(capacity)
    per_layer = isinstance(capacity, list)
    if variant == "dense":
        raise ValueError("a dense config has nothing to plan: give a routed config (mod, sdt, stt, random) or a layerdrop one")

    def ratio(dropped: Sequence[int], routed: Sequence[int]) -> float:
        values = {"dropped_layers": list(dropped)}
        if variant != "layerdrop":
            values.update(routed_layers=list(routed), capacity=capacity)
        return _flop_ratio(model_section, values, seq_len)

    if variant == "layerdrop":
        if route is not None or capacity is not None:
            raise ValueError("a layerdrop config routes no layer: give --drop or --target-flops, not --route / --capacity")
        if (drop is None) == (target_flops is None):
            raise ValueError("a layerdrop config takes exactly one of --drop and --target-flops")
        if drop is None:
            drop = next((k for k in range(1, len(ranking) + 1) if ratio(ranking[:k], []) <= target_flops), None)
            if drop is None:
                raise ValueError(f"dropping every inner layer gives {ratio(ranking, []):.3f} of dense FLOPs, "
                                 f"above the target {target_flops}")
        if not 0 < drop <= len(ranking):
            raise ValueError(f"--drop {drop}: the model has {len(ranking)} inner layers to drop from")
        return Plan(ranking[:drop], [], None, ratio(ranking[:drop], []), seq_len)

    if drop is None or capacity is None:
        raise ValueError(f"a {variant} config needs --drop (whole layers, 0 for none) and --capacity (γ of the routed layers)")
    if (route is None) == (target_flops is None):
        raise ValueError("give exactly one of --route (a count) and --target-flops (the count that reaches it)")
    if per_layer and route is None:
        raise ValueError(f"--capacity lists {len(capacity)} values, one per routed layer: give --route "
                         f"{len(capacity)}, not --target-flops (a target would choose the number of routed layers)")
    if per_layer and len(capacity) != route:
        raise ValueError(f"--capacity lists {len(capacity)} values but --route {route} routes {route} layers: give "
                         "one γ, or one per routed layer in ranking order")
    if not 0 <= drop < len(ranking):
        raise ValueError(f"--drop {drop}: the model has {len(ranking)} inner layers, and at least one must stay to route")
    dropped, remaining = ranking[:drop], ranking[drop:]
    if route is None:
        if ratio(dropped, []) <= target_flops and drop > 0:
            raise ValueError(f"dropping {drop} layers alone gives {ratio(dropped, []):.3f} ≤ the target {target_flops}: "
                             "drop fewer layers, or plan a layerdrop config")
        route = next((n for n in range(1, len(remaining) + 1) if ratio(dropped, remaining[:n]) <= target_flops), None)
        if route is None:
            raise ValueError(f"routing every remaining inner layer gives {ratio(dropped, remaining):.3f} of dense "
                             f"FLOPs, above the target {target_flops}: drop more layers or lower --capacity")
    if not 0 < route <= len(remaining):
        raise ValueError(f"--route {route}: {len(remaining)} inner layers remain after dropping {drop}")
    routed = remaining[:route]
    return Plan(dropped, routed, capacity, ratio(dropped, routed), seq_len)


def planned_config_text(config_text: str, plan: Plan, note: str) -> str:
    """``config_text`` with the plan's keys set in its top-level ``model:`` block; every other line unchanged.

    Each key must already be in the block (shipped configs list every routing key); its line is replaced by the
    planned value followed by ``# note``.

    Raises:
        ValueError: if the text has no ``model:`` block or the block lacks one of the keys.
    """
    lines = config_text.splitlines(keepends=True)
    values = plan.model_values()
    found = set()
    in_model = False
    for index, line in enumerate(lines):
        if re.match(r"^\S", line) and not line.startswith("#"):
            in_model = line.rstrip() == "model:"
            continue
        match = re.match(r"^(\s+)(\w+):", line) if in_model else None
        if match and match.group(2) in values:
            key = match.group(2)
            lines[index] = f"{match.group(1)}{key}: {json.dumps(values[key])}   # {note}\n"
            found.add(key)
    missing = [key for key in values if key not in found]
    if missing:
        raise ValueError(f"the config's model section has no line for {', '.join(missing)} to plan")
    return "".join(lines)


def _measure(cfg: DictConfig, data: Path, windows: int, seq_len: int) -> List[float]:
    from torchtune import config

    from torchtune_dtf.evaluation.routing_report import heldout_windows, load_trained
    from torchtune_dtf.models.model_config import dense_model_config

    dense_cfg = cfg.copy()
    OmegaConf.update(dense_cfg, "model", dense_model_config(OmegaConf.to_container(cfg.model, resolve=True)), merge=False)
    model = load_trained(dense_cfg, Path(cfg.checkpointer.checkpoint_dir))  # the starting (pretrained) weights
    text = heldout_windows(config.instantiate(cfg.tokenizer), data, seq_len, windows)
    return block_influence(model, text)


def _data_file(cfg: DictConfig, data: Optional[Path]) -> Path:
    if data is not None:
        return data
    files = OmegaConf.select(cfg, "dataset.data_files")
    if OmegaConf.select(cfg, "dataset.source") != "json" or not isinstance(files, str):
        raise ValueError("the config's dataset is not one local JSON file: give the training text with --data FILE")
    return Path(files)


def main(argv: Optional[List[str]] = None) -> Plan:
    parser = argparse.ArgumentParser(prog="python -m torchtune_dtf.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="a routed or layerdrop training config")
    parser.add_argument("--data", type=Path, help="training text, JSONL with a 'text' field (default: the config's dataset)")
    parser.add_argument("--windows", type=int, default=16, help="windows of text to measure on (default 16)")
    parser.add_argument("--seq-len", type=int, help="tokens per window and the FLOP ratio's length (default: tokenizer.max_seq_len)")
    parser.add_argument("--drop", type=int, help="whole layers to drop")
    parser.add_argument("--route", type=int, help="layers to route (or --target-flops)")
    parser.add_argument("--capacity", type=float, nargs="+", metavar="GAMMA",
                        help="γ of the routed layers: one value, or one per routed layer in ranking order (with --route)")
    parser.add_argument("--target-flops", type=float, help="forward FLOP ratio to reach (solves --route, or --drop for layerdrop)")
    parser.add_argument("--write", type=Path, help="write the config with the planned layers here")
    parser.add_argument("--json", type=Path, help="write the measured block influence and the plan here")
    args = parser.parse_args(argv)

    cfg = OmegaConf.load(args.config)
    seq_len = args.seq_len or int(cfg.tokenizer.max_seq_len)
    data = _data_file(cfg, args.data)
    influence = _measure(cfg, data, args.windows, seq_len)
    ranking = inner_layers_by_influence(influence)
    model_section = OmegaConf.to_container(cfg.model, resolve=True)
    plan = plan_layers(model_section, ranking, seq_len=seq_len, drop=args.drop, route=args.route,
                       capacity=args.capacity, target_flops=args.target_flops)  # one value given is that value

    print("layer  block influence")
    for layer, value in enumerate(influence):
        role = "dropped" if layer in plan.dropped_layers else "routed" if layer in plan.routed_layers else ""
        print(f"{layer:5d}  {value:.4f}  {role}")
    print("inner layers, least influential first:", ranking)
    print("plan:", ", ".join(f"model.{key}={json.dumps(value)}" for key, value in plan.model_values().items()))
    print(f"forward FLOPs / dense at T = {seq_len}: {plan.flop_ratio:.3f}")
    note = f"planned: block influence on {data}, {args.windows} x {seq_len} tokens"
    if args.write:
        # The first line says how the file was planned (replacing such a line, so re-planning in place is idempotent).
        text = args.config.read_text()
        if text.startswith(_COMMAND_PREFIX):
            text = text.split("\n", 1)[1]
        command = " ".join([_COMMAND_PREFIX.removeprefix("# ")] + list(argv if argv is not None else sys.argv[1:]))
        atomic_write_text(args.write, f"# {command}\n" + planned_config_text(text, plan, note))
        print(f"wrote {args.write}")
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "config": str(args.config), "text": str(data), "windows": args.windows, "seq_len": seq_len,
            "block_influence": influence, "inner_layers_by_influence": ranking,
            "plan": {**plan.model_values(), "flop_ratio": plan.flop_ratio},
        }, indent=1) + "\n")
    return plan


if __name__ == "__main__":
    main()
