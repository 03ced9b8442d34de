"""Table of the quickstart routing-option runs: `python experiments/quickstart_options/summarize.py`.

Reads every ``<name>[_seed<N>].json`` written by ``run.sh`` next to this file and prints a Markdown table
(held-out loss per token of the dense control, the STT student and teacher, the student's executed
fraction, teacher–student agreement, the teacher ranking's tie share and first-half share), one row per
option, mean ± std over the seeds present; ``--write`` also saves it to ``results.md``.
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("papers", "straight_through", "scheduled_sampling", "inner_layers", "first_token", "combined", "shipped")


def _mean_layers(report, key):
    rows = report["layers"].values()
    return sum(r[key] for r in rows) / len(rows)


def _fmt(values, digits=3):
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    runs = defaultdict(list)
    for path in sorted(HERE.glob("*.json")):
        report = json.loads(path.read_text())
        runs[report["name"]].append(report)
    lines = [
        "| option | seeds | dense | STT student | student − dense | STT teacher | executed | agreement | ties | first half |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(runs, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        reports = runs[name]
        col = lambda f: [f(r) for r in reports]  # noqa: E731
        lines.append(
            f"| {name} | {len(reports)} | {_fmt(col(lambda r: r['loss']['dense']))} "
            f"| {_fmt(col(lambda r: r['loss']['routed_student']))} "
            f"| {_fmt(col(lambda r: r['loss']['routed_student'] - r['loss']['dense']))} "
            f"| {_fmt(col(lambda r: r['loss']['routed_teacher']))} "
            f"| {_fmt(col(lambda r: _mean_layers(r, 'student/selected_fraction')))} "
            f"| {_fmt(col(lambda r: _mean_layers(r, 'teacher/agreement_accuracy')))} "
            f"| {_fmt(col(lambda r: _mean_layers(r, 'teacher/score_tie_share')))} "
            f"| {_fmt(col(lambda r: _mean_layers(r, 'teacher/teacher_first_half_share')))} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.write:
        (HERE / "results.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
