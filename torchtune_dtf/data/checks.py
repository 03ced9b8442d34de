"""Checks of text datasets at setup, so a bad row fails before training and names its file and line.

torchtune's ``text_completion_dataset`` reads rows lazily: a row without its text column (or with a null
there) fails only when the sampler reaches it, many steps in, as ``TypeError: normalize() argument 2 must
be str, not None``; a file that is not UTF-8 fails inside ``datasets`` without its path.
"""

import json
from pathlib import Path
from typing import Any, Iterable, List, Mapping

#: Local ``load_dataset`` builders whose files this module reads line by line.
_LINE_SOURCES = ("json", "text")


def _local_files(data_files: Any) -> List[Path]:
    if isinstance(data_files, (str, Path)):
        return [Path(data_files)]
    if isinstance(data_files, Mapping):
        return [p for files in data_files.values() for p in _local_files(files)]
    if isinstance(data_files, Iterable):
        return [Path(p) for p in data_files]
    return []


def check_local_text_files(source: str, data_files: Any, column: str) -> None:
    """Every line of local ``json``/``jsonl`` files is a JSON object whose ``column`` is a string; every
    ``text`` file is UTF-8; no file is empty. Other sources are left to :func:`check_text_column`.

    Raises:
        ValueError: naming the file and the line of the first problem found in each bad file.
    """
    if source not in _LINE_SOURCES:
        return
    problems = []
    for path in _local_files(data_files):
        if not path.is_file():
            continue  # a glob or a remote path: ``datasets`` resolves and reports it
        problem = _first_problem(path, source, column)
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError("Bad training data:\n  - " + "\n  - ".join(problems))


def _first_problem(path: Path, source: str, column: str) -> str:
    rows = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return f"{path}, line {number}: not UTF-8 ({err.reason} at byte {err.start}); re-encode the file as UTF-8"
            if not line.strip():
                continue
            rows += 1
            if source == "text":
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                return f"{path}, line {number}: not valid JSON ({err})"
            if not isinstance(row, dict) or column not in row:
                return f"{path}, line {number}: no {column!r} field (the dataset's column)"
            if not isinstance(row[column], str):
                return f"{path}, line {number}: {column!r} is {type(row[column]).__name__}, not text"
    return "" if rows else f"{path}: empty file, no rows"


def check_text_column(dataset: Any, column: str, description: str) -> None:
    """A dataset loaded by torchtune's ``TextCompletionDataset`` has ``column`` as a string column without
    nulls (checked on the Arrow table, without reading the rows). Other datasets are left alone."""
    data = getattr(dataset, "_data", None)
    if data is None or not hasattr(data, "column_names"):
        return
    if column not in data.column_names:
        raise ValueError(f"{description}: no column {column!r}; it has {data.column_names}")
    values = data.data.column(column)
    if values.null_count:
        import pyarrow.compute as pc

        first = pc.index(pc.is_null(values), True).as_py()
        raise ValueError(f"{description}: {values.null_count} row(s) without text in column {column!r}, the first is row {first}")
    if "string" not in str(values.type):
        raise ValueError(f"{description}: column {column!r} holds {values.type}, not text")
