"""The metrics a recipe logged with torchtune's ``DiskLogger``: ``Step N | key:value key:value ...`` lines in
``<log_dir>/log_<unix time>.txt`` (one file per start of the recipe, so a resumed run has several)."""

from pathlib import Path
from typing import Dict, List, Tuple


def parse_disk_logs(log_dir: Path) -> Dict[int, Dict[str, float]]:
    """Every ``Step N | key:value ...`` line of torchtune's DiskLogger files in ``log_dir``, merged by step.

    Files are read oldest first (``log_<unix time>.txt``), so steps that a resumed run logged again take the
    values of the attempt that finished."""

    def order(path: Path):
        stamp = path.stem.rsplit("_", 1)[-1]
        return (int(stamp) if stamp.isdigit() else 0, path.name)

    rows: Dict[int, Dict[str, float]] = {}
    for path in sorted(Path(log_dir).glob("*.txt"), key=order):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("Step ") or " | " not in line:
                continue
            head, rest = line.split(" | ", 1)
            try:
                step = int(head.split()[1])
            except (IndexError, ValueError):
                continue
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
