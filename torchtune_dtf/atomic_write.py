"""Atomic replacement of a text file, shared by everything in the package that rewrites a file a reader may open
at any time (tokenizer files, the corpus, a run's ``run.json``, experiments/study.py's ``study.json``)."""

import os
import uuid
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to a unique temporary file beside ``path``, then rename it over ``path``.

    A reader sees the old file or the new one, never a half-written one. The temporary name is unique to the
    call, so writers of the same file side by side (two study workers) never rename each other's temporary away;
    on any failure the temporary is removed and the error re-raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
