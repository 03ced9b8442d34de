"""The metrics a recipe logged, read back as ``{step: {key: value}}`` from the files of torchtune's metric loggers:

* ``DiskLogger``: ``Step N | key:value key:value ...`` lines in ``<log_dir>/log_<unix time>.txt`` (one file per
  start of the recipe, so a resumed run has several);
* ``TensorBoardLogger``: TensorBoard event files (``<log_dir>/run_<rank>_<time>/events.out.tfevents.*`` with
  torchtune's default ``organize_logs``), one scalar per key and step, the keys as the DiskLogger writes them.

:func:`read_metric_logs` picks the reader from a config's ``metric_logger`` section.
"""

from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

#: The loggers whose files can be read back, by the class name that ends their ``_component_``.
READABLE_LOGGERS = ("DiskLogger", "TensorBoardLogger")


def parse_disk_logs(log_dir: Path) -> Dict[int, Dict[str, float]]:
    """Every ``Step N | key:value ...`` line of torchtune's DiskLogger files in ``log_dir``, merged by step.

    Files are read oldest first (``log_<unix time>.txt``): a resumed attempt restarts from its checkpoint, so
    its first logged step drops every row an earlier attempt logged from that step on (steps past the
    checkpoint that the interrupted attempt reached, not yet trained again, would otherwise read as done)."""

    def order(path: Path):
        stamp = path.stem.rsplit("_", 1)[-1]
        return (int(stamp) if stamp.isdigit() else 0, path.name)

    rows: Dict[int, Dict[str, float]] = {}
    for path in sorted(Path(log_dir).glob("*.txt"), key=order):
        first_step = True
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("Step ") or " | " not in line:
                continue
            head, rest = line.split(" | ", 1)
            try:
                step = int(head.split()[1])
            except (IndexError, ValueError):
                continue
            if first_step:
                rows = {s: row for s, row in rows.items() if s < step}
                first_step = False
            row = rows.setdefault(step, {})
            for item in rest.split():
                key, sep, value = item.rpartition(":")
                if not sep:
                    continue
                try:
                    row[key] = float(value)
                except ValueError:
                    continue
    return dict(sorted(rows.items()))


def metric_series(rows: Dict[int, Dict[str, float]], key: str) -> Tuple[List[int], List[float]]:
    """The steps at which ``key`` was logged and its values there (validation, for one, is logged every few steps)."""
    steps = [step for step, row in rows.items() if key in row]
    return steps, [rows[step][key] for step in steps]


def parse_tensorboard_logs(log_dir: Path) -> Dict[int, Dict[str, float]]:
    """Every scalar in the TensorBoard event files under ``log_dir`` (any depth), merged by step.

    Files are read in the order they were started (their first event's wall time), so a resumed run's values of a
    step it logged again win, as for :func:`parse_disk_logs`. Needs the ``tensorboard`` package (extra
    ``experiments``)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    files = []
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        events = list(LegacyEventFileLoader(str(path)).Load())
        files.append((events[0].wall_time if events else 0.0, str(path), events))
    rows: Dict[int, Dict[str, float]] = {}
    for _, _, events in sorted(files, key=lambda item: item[:2]):
        for event in events:
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    number = float(value.simple_value)
                elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
                    number = float(make_ndarray(value.tensor).item())
                else:
                    continue
                rows.setdefault(int(event.step), {})[value.tag] = number
    return dict(sorted(rows.items()))


def read_metric_logs(metric_logger: Mapping[str, Any]) -> Dict[int, Dict[str, float]]:
    """The metrics that a config's ``metric_logger`` section wrote (empty when its folder does not exist yet).

    Raises:
        ValueError: for a logger whose files cannot be read back (stdout, Weights & Biases, Comet, MLflow).
    """
    component = str((metric_logger or {}).get("_component_", ""))
    kind = component.rsplit(".", 1)[-1]
    if kind not in READABLE_LOGGERS:
        raise ValueError(
            f"metrics logged with {component or 'no metric_logger'} cannot be read back: log with "
            "torchtune.training.metric_logging.DiskLogger or TensorBoardLogger (metric_logger._component_=..., "
            "metric_logger.log_dir=DIR), or point at such a run's files the same way")
    log_dir = Path(str(metric_logger["log_dir"]))
    if not log_dir.is_dir():
        return {}
    return parse_disk_logs(log_dir) if kind == "DiskLogger" else parse_tensorboard_logs(log_dir)
