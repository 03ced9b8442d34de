"""A local stand-in for ``gpt2`` so torchtune's stock ``eleuther_eval`` recipe runs offline.

torchtune 0.6.1's ``_LLMEvalWrapper`` (``recipes/eleuther_eval.py``) subclasses lm-eval's ``HFLM`` and
calls ``HFLM.__init__(pretrained="gpt2", device=...)`` before replacing the model and tokenizer with
the torchtune ones. The GPT-2 model and tokenizer are never used for scoring or generation [#]_, but
``HFLM.__init__`` still loads them with ``from_pretrained("gpt2")``, which goes to the Hugging Face hub.
Offline, anything named ``gpt2`` that transformers can load gets through. This module writes a
minimal one: a 1-layer, 4-wide random GPT-2 (GPT-2's 50,257-row embedding, ~0.2 M parameters, 0.8 MB)
with a byte-level tokenizer that keeps GPT-2's ids for the 256 bytes and ``<|endoftext|>`` = 50256 and
has no merges (ids 256–50255 hold placeholders that no text can produce). Two ways to make the name resolve:

1. a directory named ``gpt2`` in the working directory of ``tune run`` (transformers treats an
   existing local path as a model directory and never contacts the hub); the default, git-ignored in the
   repository root, from where the README runs every command::

       python -m torchtune_dtf.offline.lm_eval_standin       # writes ./gpt2/ (--workdir DIR: DIR/gpt2/)
       tune run eleuther_eval --config ...

2. a pre-seeded Hugging Face cache with the hub switched off (nothing in the working directory)::

       python -m torchtune_dtf.offline.lm_eval_standin --hf-home /path/to/hf_home
       HF_HOME=/path/to/hf_home HF_HUB_OFFLINE=1 tune run eleuther_eval --config ...

   Use a dedicated ``HF_HOME``: the stand-in is registered as the cached revision ``main`` of
   ``gpt2``, so it must not share a cache with a real ``gpt2`` download (the function refuses to
   overwrite one).

Set ``HF_DATASETS_OFFLINE=1`` as well when the tasks are local (``dataset_path: json`` + ``data_files``).

.. [#] With one exception, inherited from the stock wrapper: lm-eval prepends ``HFLM.prefix_token_id``
   to a continuation whose context is empty and to the first window of ``loglikelihood_rolling``
   (perplexity tasks such as wikitext), and that id comes from the GPT-2 tokenizer: 50256, which the
   routed Qwen model then reads as one of its own tokens. The stand-in keeps GPT-2's id 50256, so
   offline results equal what the same recipe computes online.
"""

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import List, Optional, Union

#: Name under which the stand-in must resolve (what ``_LLMEvalWrapper`` passes to ``HFLM``).
STANDIN_NAME = "gpt2"
#: Marker key in the stand-in's ``config.json``.
STANDIN_MARKER = "_torchtune_dtf_offline_standin"
#: GPT-2's <|endoftext|> id, kept so that lm-eval's prefix token is the same as with the real gpt2.
GPT2_EOT_ID = 50256
#: Fake commit hash under which the stand-in is registered in a seeded HF cache.
STANDIN_REVISION = hashlib.sha1(b"torchtune_dtf gpt2 offline stand-in v1").hexdigest()

PathLike = Union[str, os.PathLike]

_README = """\
Offline stand-in for the Hugging Face model `gpt2`, written by torchtune_dtf.offline.lm_eval_standin.
torchtune's eleuther_eval recipe constructs lm-eval's HFLM with pretrained="gpt2" and then replaces
model and tokenizer with its own; this tiny random GPT-2 only lets that constructor run offline.
It is NOT GPT-2: never use it as a model.
"""


def is_standin(directory: PathLike) -> bool:
    """Whether ``directory`` holds a stand-in written by :func:`write_gpt2_standin`."""
    config = Path(directory) / "config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get(STANDIN_MARKER))
    except (OSError, ValueError):
        return False


def write_gpt2_standin(directory: PathLike) -> Path:
    """Write the stand-in model and tokenizer files into ``directory`` (created if needed).

    Files: ``config.json`` (marked as the stand-in), ``model.safetensors``, ``generation_config.json``,
    the tokenizer files transformers writes (``vocab.json``, ``merges.txt``, ``tokenizer.json``…) and a
    ``README.md``. Needs ``transformers`` (a dependency of lm-eval). Deterministic.

    Returns:
        Path: ``directory``.

    Raises:
        FileExistsError: if ``directory`` holds a model that is not this stand-in.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    from torchtune_dtf.offline.tokenizer_assets import bytes_to_unicode

    directory = Path(directory)
    if (directory / "config.json").exists() and not is_standin(directory):
        raise FileExistsError(f"{directory} holds a model that is not the torchtune_dtf gpt2 stand-in; not overwriting")
    directory.mkdir(parents=True, exist_ok=True)

    # GPT-2's own ids for what is kept: its first 256 ids are the bytes in this order, and
    # <|endoftext|> is 50256 (bos = eos = prefix token, which the stock wrapper inherits; see above).
    eot = "<|endoftext|>"
    byte_encoder = bytes_to_unicode()
    vocab = {char: i for i, char in enumerate(byte_encoder.values())}
    # Every id below <|endoftext|> gets an entry: for each save of a vocabulary with gaps, tokenizers prints
    # "The OrderedVocab you are attempting to save contains holes for indices [256, …, 50255]" (≈ 340 KB, a Rust
    # println! to stdout, out of reach of any Python logging or warnings filter). Without merges BPE never
    # builds a multi-character token, so these placeholders are unreachable: text still encodes to bytes only.
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), GPT2_EOT_ID)})
    vocab[eot] = GPT2_EOT_ID
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    tokenizer = GPT2TokenizerFast(
        vocab_file=str(directory / "vocab.json"),
        merges_file=str(directory / "merges.txt"),
        unk_token=eot,
        bos_token=eot,
        eos_token=eot,
        model_max_length=1024,
    )
    tokenizer.save_pretrained(directory)

    config = GPT2Config(
        vocab_size=GPT2_EOT_ID + 1, n_positions=1024, n_embd=4, n_layer=1, n_head=1,
        bos_token_id=GPT2_EOT_ID, eos_token_id=GPT2_EOT_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(directory, safe_serialization=True)
    config_path = directory / "config.json"
    config_dict = json.loads(config_path.read_text(encoding="utf-8"))
    config_dict[STANDIN_MARKER] = True
    config_path.write_text(json.dumps(config_dict, indent=2), encoding="utf-8")
    (directory / "README.md").write_text(_README, encoding="utf-8")
    return directory


def write_gpt2_standin_in_workdir(workdir: PathLike) -> Path:
    """Way 1: write the stand-in to ``workdir/gpt2``; run ``tune run eleuther_eval`` from ``workdir``."""
    return write_gpt2_standin(Path(workdir) / STANDIN_NAME)


def seed_hf_cache(hf_home: PathLike) -> Path:
    """Way 2: register the stand-in as revision ``main`` of ``gpt2`` in the cache of ``HF_HOME=hf_home``.

    Writes ``hf_home/hub/models--gpt2/{refs/main, snapshots/<rev>/...}`` (the layout huggingface_hub
    reads). Run the recipe with ``HF_HOME=hf_home HF_HUB_OFFLINE=1``.

    Returns:
        Path: the snapshot directory.

    Raises:
        FileExistsError: if the cache already holds a ``gpt2`` that is not this stand-in.
    """
    repo = Path(hf_home) / "hub" / f"models--{STANDIN_NAME}"
    ref = repo / "refs" / "main"
    if ref.exists():
        current = ref.read_text(encoding="utf-8").strip()
        if current != STANDIN_REVISION and not is_standin(repo / "snapshots" / current):
            raise FileExistsError(f"{repo} holds a real `{STANDIN_NAME}` download; use a dedicated HF_HOME")
    snapshot = write_gpt2_standin(repo / "snapshots" / STANDIN_REVISION)
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(STANDIN_REVISION, encoding="utf-8")
    return snapshot


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m torchtune_dtf.offline.lm_eval_standin",
        description="Write the offline `gpt2` stand-in that torchtune's eleuther_eval recipe needs "
        "(its eval wrapper constructs lm-eval's HFLM with pretrained='gpt2').",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--workdir", default=".", help="write WORKDIR/gpt2 (default: ./gpt2, git-ignored in the "
                       "repository root); run `tune run eleuther_eval` from WORKDIR")
    where.add_argument("--hf-home", help="seed the HF cache of HF_HOME=HF_HOME; run with HF_HUB_OFFLINE=1")
    args = parser.parse_args(argv)
    if not args.hf_home:
        path = write_gpt2_standin_in_workdir(args.workdir)
        print(f"gpt2 stand-in: {path}  (run `tune run eleuther_eval ...` from {Path(args.workdir).resolve()})")
    else:
        path = seed_hf_cache(args.hf_home)
        print(f"gpt2 stand-in: {path}  (run with HF_HOME={Path(args.hf_home).resolve()} HF_HUB_OFFLINE=1)")


if __name__ == "__main__":
    main()
