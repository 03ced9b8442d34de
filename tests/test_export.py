"""torchtune_dtf.export and torchtune_dtf.hf.modeling: a trained checkpoint as a Hugging Face folder that loads with
``AutoModelForCausalLM`` and computes what the torchtune model computes (logits, the student's routing, greedy
generations of a left-padded batch), and a model without routing as a stock ``Qwen2ForCausalLM``."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torchtune.generation import generate as torchtune_generate
from torchtune.modules.common_utils import local_kv_cache

from tests.test_recipe import write_tiny_hf_checkpoint
from torchtune_dtf.evaluation.routing_report import load_trained
from torchtune_dtf.export import export, main as export_main
from torchtune_dtf.models.qwen2_5._model_builders import QWEN2_5_SHAPES
from torchtune_dtf.modules import is_routing_key
from torchtune_dtf.offline.tokenizer_assets import write_qwen2_5_tokenizer_files

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151936
#: The recommended recipe's deployed setting on the tiny model: STT, window top-k student, context kept, skip bias.
STT_DEPLOYED = {
    "model.student_routing_mode": "window_topk", "model.student_window": 4, "model.student_threshold": None,
    "model.skipped_tokens_write_kv": True, "model.skip_update": "bias",
}
#: The papers' setting: SDT with a threshold student, skipped tokens write no K/V (the selective cache's gaps).
SDT_PAPERS = {"model._component_": "torchtune_dtf.models.qwen2_5.sdt_qwen2_5_tiny"}
#: The recommended shape with the skip linear map on a dropped layer and the routed layers' skipped tokens.
STT_LINEAR = {**STT_DEPLOYED, "model.skip_update": "linear", "model.routed_layers": [1], "model.dropped_layers": [2]}
DEPLOYED = {"stt_window_topk_kv_kept": STT_DEPLOYED, "sdt_threshold_kv_skipped": SDT_PAPERS, "stt_linear_maps": STT_LINEAR}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_assets")
    write_qwen2_5_tokenizer_files(root / "qwen2_5_tokenizer")
    write_tiny_hf_checkpoint(root / "tiny_qwen2_5_hf")
    return root


def generate_config(assets: Path, **overrides):
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "generate_stt.yaml")
    cfg.checkpointer.checkpoint_dir = str(assets / "tiny_qwen2_5_hf")
    cfg.tokenizer.path = str(assets / "qwen2_5_tokenizer" / "vocab.json")
    cfg.tokenizer.merges_file = str(assets / "qwen2_5_tokenizer" / "merges.txt")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def trained_routing_checkpoint(cfg, folder: Path) -> Path:
    """A copy of the tiny checkpoint with routing weights far from their initialisation (routers that rank tokens
    by content, skip biases that are not zero), as ``routing.safetensors`` beside it, the way the recipe saves."""
    shutil.copytree(cfg.checkpointer.checkpoint_dir, folder)
    model = load_trained(cfg, folder)
    gen = torch.Generator().manual_seed(7)
    routing = {k: (torch.randn(v.shape, generator=gen) * 0.5).to(v.dtype)
               for k, v in model.state_dict().items() if is_routing_key(k) and v.is_floating_point()}
    routing.update({k: v for k, v in model.state_dict().items() if is_routing_key(k) and not v.is_floating_point()})
    save_file({k: v.contiguous() for k, v in routing.items()}, str(folder / "routing.safetensors"))
    return folder


@pytest.fixture(scope="module", params=sorted(DEPLOYED))
def routed_export(assets, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("routed_export")
    cfg = generate_config(assets, **DEPLOYED[request.param])
    checkpoint = trained_routing_checkpoint(cfg, root / "checkpoint")
    summary = export(cfg, checkpoint, root / "out", config_path="configs/tiny/generate_stt.yaml")
    reference = load_trained(cfg, checkpoint)
    exported = AutoModelForCausalLM.from_pretrained(root / "out", trust_remote_code=True, dtype=torch.float32).eval()
    return summary, reference, exported, root / "out"


def test_routed_export_is_a_remote_code_folder_with_tokenizer(routed_export):
    summary, _, exported, out = routed_export
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["model_type"] == "torchtune_dtf_routed_qwen2"
    assert hf_config["auto_map"]["AutoModelForCausalLM"] == "modeling_torchtune_dtf.RoutedQwen2ForCausalLM"
    assert hf_config["torchtune_model"]["student_routing_mode"] in ("window_topk", "threshold")
    assert hf_config["num_hidden_layers"] == 4 and hf_config["vocab_size"] == VOCAB
    for name in ("model.safetensors", "modeling_torchtune_dtf.py", "configuration_torchtune_dtf.py", "README.md",
                 "vocab.json", "merges.txt"):
        assert (out / name).is_file(), name
    # The folder's code is the two shims that import the installed package, not a frozen copy of it.
    assert sorted(p.name for p in out.glob("*.py")) == ["configuration_torchtune_dtf.py", "modeling_torchtune_dtf.py"]
    assert type(exported).__name__ == "RoutedQwen2ForCausalLM"
    assert summary["max_abs_logit_difference"] <= 1e-5
    card = (out / "README.md").read_text()
    assert "trust_remote_code=True" in card and hf_config["torchtune_model"]["student_routing_mode"] in card


def test_routed_export_logits_loss_and_routing_match_torchtune(routed_export):
    _, reference, exported, _ = routed_export
    tokens = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    reference.reset_routing_counters()
    exported.reset_routing_counters()
    with torch.no_grad():
        ours = reference(tokens)
        output = exported(tokens, labels=tokens)
    torch.testing.assert_close(output.logits, ours, atol=1e-5, rtol=0)
    expected_loss = torch.nn.functional.cross_entropy(ours[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(output.loss, expected_loss, atol=1e-5, rtol=0)
    fractions = exported.executed_fractions()
    assert fractions == reference.executed_fractions()
    # Routing is live in the exported model, not all-or-nothing (window top-k runs γ = 0.5 by rank).
    assert fractions and all(0.1 < f < 0.9 for f in fractions.values()), fractions
    # and which tokens ran depends on the routing weights: zeroing one router changes the logits.
    state = {k: v.clone() for k, v in exported.model.state_dict().items()}
    router = next(k for k in state if is_routing_key(k) and "router" in k and k.endswith("weight"))
    with torch.no_grad():
        exported.model.state_dict()[router].mul_(-1.0)
        flipped = exported(tokens).logits
    exported.model.load_state_dict(state)
    assert (flipped - ours).abs().max() > 1e-3


def torchtune_greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """torchtune's stock ``generate`` (greedy, pad id 0) in a selective KV cache sized prompt + new tokens."""
    with local_kv_cache(model, batch_size=prompts.shape[0], device=torch.device("cpu"), dtype=torch.float32,
                        decoder_max_seq_len=prompts.shape[1] + new_tokens):
        generated, _ = torchtune_generate(model, prompts, max_generated_tokens=new_tokens, pad_id=0,
                                          temperature=0.0, stop_tokens=None)
    return generated


def left_padded(lengths, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    prompts = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        prompts[row, width - length:] = torch.randint(1, VOCAB, (length,), generator=gen)
        mask[row, width - length:] = 1
    return prompts, mask


@pytest.mark.parametrize("lengths", [(11, 6, 9), (10,)], ids=["left_padded_batch", "one_prompt"])
def test_routed_export_generates_what_torchtune_generates(routed_export, lengths):
    _, reference, exported, _ = routed_export
    new_tokens = 8
    prompts, mask = left_padded(lengths, seed=len(lengths))
    reference.reset_routing_counters()
    expected = torchtune_greedy(reference, prompts, new_tokens)
    expected_fractions = reference.executed_fractions()
    exported.reset_routing_counters()
    with torch.no_grad():
        got = exported.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(got, expected), (got, expected)
    # Same tokens through the same routed layers: the counters saw the same decisions.
    assert exported.executed_fractions() == pytest.approx(expected_fractions, abs=1e-9)
    # The selective cache is the model's: after generate the wrapper still runs a plain forward unchanged.
    with torch.no_grad():
        torch.testing.assert_close(exported(prompts[:1]).logits, reference(prompts[:1]), atol=1e-5, rtol=0)


def test_routed_export_refuses_what_a_selective_cache_cannot_do(routed_export):
    _, _, exported, _ = routed_export
    prompts, mask = left_padded((5, 5), seed=0)
    with pytest.raises(NotImplementedError, match="reordered"):
        exported.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=2, num_beams=2, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match="position_ids"):
        exported(prompts, position_ids=torch.arange(5)[None])
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch"):
        exported(prompts, attention_mask=mask[:, :3])


def test_export_command_takes_overrides_and_notes(assets, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(assets)  # generate_stt.yaml's paths are relative: ./tiny_qwen2_5_hf, ./qwen2_5_tokenizer
    notes = tmp_path / "notes.md"
    notes.write_text("Held-out loss 3.21 vs dense 3.02 (made up for this test).")
    summary = export_main(["--config", str(REPO / "configs" / "tiny" / "generate_stt.yaml"), "--out",
                           str(tmp_path / "out"), "--notes", str(notes), "model.student_threshold=0.4"])
    assert summary["kind"] == "routed (remote code)" and summary["max_abs_logit_difference"] <= 1e-5
    assert json.loads(capsys.readouterr().out)["out"] == str(tmp_path / "out")
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["torchtune_model"]["student_threshold"] == 0.4
    assert "Held-out loss 3.21 vs dense 3.02" in (tmp_path / "out" / "README.md").read_text()


def test_export_refuses_a_batch_dependent_student(assets, tmp_path):
    cfg = generate_config(assets, **{"model.student_routing_mode": "topk", "model.student_threshold": None})
    with pytest.raises(ValueError, match="student_routing_mode 'topk'"):
        export(cfg, Path(cfg.checkpointer.checkpoint_dir), tmp_path / "out", config_path="x")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dropped", [[1, 2], []], ids=["layer_dropping", "dense"])
def test_models_without_routing_export_as_stock_qwen2(assets, tmp_path, dropped):
    cfg = generate_config(assets)
    if dropped:
        cfg.model = {"_component_": "torchtune_dtf.models.qwen2_5.routed_qwen2", "variant": "layerdrop",
                     **QWEN2_5_SHAPES["tiny"], "vocab_size": VOCAB, "max_seq_len": 256, "dropped_layers": dropped,
                     "skip_update": "none"}
    else:
        cfg.model = {"_component_": "torchtune_dtf.models.qwen2_5.dense_qwen2_5_tiny", "vocab_size": VOCAB,
                     "max_seq_len": 256}
    summary = export(cfg, Path(cfg.checkpointer.checkpoint_dir), tmp_path / "out", config_path="stock")
    assert summary["kind"] == "stock Qwen2ForCausalLM" and summary["dropped_layers"] == dropped
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["num_hidden_layers"] == 4 - len(dropped) and "auto_map" not in hf_config
    assert not list((tmp_path / "out").glob("*.py"))
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(stock).__name__ == "Qwen2ForCausalLM" and len(stock.model.layers) == 4 - len(dropped)
    reference = load_trained(cfg, Path(cfg.checkpointer.checkpoint_dir))
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(stock(tokens).logits, reference(tokens), atol=1e-5, rtol=0)
        if dropped:  # dropping the two middle layers is not the dense model: the export really removed them
            dense = AutoModelForCausalLM.from_pretrained(cfg.checkpointer.checkpoint_dir, dtype=torch.float32).eval()
            assert (dense(tokens).logits - reference(tokens)).abs().max() > 1e-3


def test_export_refuses_a_used_folder_and_a_checkpoint_of_another_shape(assets, tmp_path, capsys):
    cfg = generate_config(assets)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export(cfg, Path(cfg.checkpointer.checkpoint_dir), tmp_path / "used", config_path="x")
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"
    other_vocabulary = generate_config(assets, **{"model.vocab_size": 1024})
    with pytest.raises(ValueError, match="(?i)shape|size"):
        export(other_vocabulary, Path(cfg.checkpointer.checkpoint_dir), tmp_path / "other_vocabulary", config_path="x")


# ------------------------------------------------------------------------------------------------
# lm-eval's hf backend on the exported folder scores what torchtune's eleuther_eval scores
# ------------------------------------------------------------------------------------------------
TASKS = ("tiny_routed_mc", "tiny_routed_gen")


def test_exported_tokenizer_encodes_as_the_torchtune_tokenizer(routed_export, assets):
    from torchtune import config as tt_config
    from transformers import AutoTokenizer

    _, _, _, out = routed_export
    hf = AutoTokenizer.from_pretrained(out)
    torchtune_tokenizer = tt_config.instantiate(generate_config(assets).tokenizer)
    for text in ("Question: Why do routed layers skip blocks?\nAnswer: ", "naïve café — 12345 tokens.\n\n<|endoftext|>",
                 "   leading spaces\tand 中文 🙂"):
        assert hf(text, add_special_tokens=False)["input_ids"] == torchtune_tokenizer.encode(text, add_bos=False,
                                                                                           add_eos=False)
    assert hf.eos_token_id == torchtune_tokenizer.eos_id and hf.pad_token_id == torchtune_tokenizer.pad_id


def lm_eval_samples(lm, root: Path):
    """lm-eval's results and per-document samples of ``TASKS`` (local tasks, data paths relative to ``root``)."""
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    task_dict = get_task_dict(list(TASKS), TaskManager(include_path=str(root / "lm_eval_tasks")))
    output = evaluate(lm, task_dict, log_samples=True)
    return output["results"], output["samples"]


@pytest.fixture
def eval_root(tmp_path, monkeypatch):
    from torchtune_dtf.offline.lm_eval_standin import write_gpt2_standin_in_workdir

    shutil.copytree(REPO / "tests" / "assets" / "lm_eval_tasks", tmp_path / "lm_eval_tasks")
    write_gpt2_standin_in_workdir(tmp_path)  # the `gpt2` that torchtune's eval wrapper names, never downloaded
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return tmp_path


def test_lm_eval_hf_backend_scores_the_export_as_torchtune_eleuther_eval(routed_export, assets, eval_root):
    """Per request, not only per metric: every choice's log-likelihood within 1e-4 and every generation equal."""
    import importlib.util

    from lm_eval.models.huggingface import HFLM
    from torchtune import config as tt_config

    from tests.conftest import load_script

    _, reference, _, out = routed_export
    locations = importlib.util.find_spec("recipes").submodule_search_locations
    eleuther = load_script(Path(list(locations)[0]) / "eleuther_eval.py", "_torchtune_recipe_eleuther_eval")
    tokenizer = tt_config.instantiate(generate_config(assets).tokenizer)

    class StockWrapper(eleuther._LLMEvalWrapper):
        # The stock wrapper always generates 256 tokens and lm-eval cuts the text at the task's stop strings; the
        # hf backend generates the task's max_gen_toks (8). Equal budgets make the two generations comparable
        # token for token (and keep the tiny model inside its 256-position RoPE table).
        max_gen_toks = property(lambda self: 8)

    ours = StockWrapper(reference, tokenizer, device=torch.device("cpu"), max_seq_length=256, batch_size=4)
    theirs = HFLM(pretrained=str(out), trust_remote_code=True, batch_size=4, device="cpu", dtype="float32")
    assert type(theirs.model).__name__ == "RoutedQwen2ForCausalLM"
    ours_results, ours_samples = lm_eval_samples(ours, eval_root)
    theirs_results, theirs_samples = lm_eval_samples(theirs, eval_root)
    for task in TASKS:
        assert len(ours_samples[task]) == len(theirs_samples[task]) > 0
        for mine, hf in zip(ours_samples[task], theirs_samples[task]):
            if task == "tiny_routed_mc":
                mine_ll = [ll for ll, _ in mine["filtered_resps"]]
                hf_ll = [ll for ll, _ in hf["filtered_resps"]]
                assert hf_ll == pytest.approx(mine_ll, abs=1e-4)
                assert len(set(round(ll, 3) for ll in mine_ll)) > 1  # the choices are told apart
            else:
                assert hf["filtered_resps"] == mine["filtered_resps"]
        if task == "tiny_routed_gen":
            assert any(str(sample["filtered_resps"][0]).strip() for sample in ours_samples[task])  # text came out
        for metric, value in ours_results[task].items():
            if metric.startswith(("acc", "exact_match")):
                assert theirs_results[task][metric] == pytest.approx(value), (task, metric)


def test_lm_eval_command_line_scores_the_exported_folder_offline(routed_export, eval_root):
    import os
    import subprocess
    import sys

    _, _, _, out = routed_export
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": str(REPO)}
    lm_eval_cli = Path(sys.executable).with_name("lm_eval")
    proc = subprocess.run(
        [str(lm_eval_cli), "--model", "hf", "--model_args", f"pretrained={out},trust_remote_code=True,dtype=float32",
         "--tasks", "tiny_routed_mc", "--include_path", "lm_eval_tasks", "--device", "cpu", "--batch_size", "4"],
        cwd=eval_root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|tiny_routed_mc")]
    assert rows and "|acc" in rows[0], proc.stdout[-2000:]


def test_model_card_says_what_the_run_recorded(tmp_path):
    from torchtune_dtf.export import model_card, training_provenance

    run = tmp_path / "run"
    (run / "epoch_0").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "epoch_0" / "checkpoint.json").write_text(json.dumps({"global_step": 4}))
    OmegaConf.save(OmegaConf.create({
        "checkpointer": {"checkpoint_dir": "base_model_hf"}, "dataset": {"data_files": "corpus/train.jsonl"},
        # relative to where training ran, not to here: found beside the epoch folder
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": "elsewhere/logs"},
    }), run / "torchtune_config.yaml")
    (run / "logs" / "log_1.txt").write_text(
        "Step 4 | summary/steps:4.0 summary/val_lm_loss_student:3.5 summary/val_lm_loss_teacher:3.25 loss:9.0\n")
    provenance = training_provenance(run / "epoch_0")
    assert provenance["base_model"] == "base_model_hf" and provenance["global_step"] == 4
    assert provenance["summary"] == {"steps": 4.0, "val_lm_loss_student": 3.5, "val_lm_loss_teacher": 3.25}
    card = model_card(config_path="eval.yaml", checkpoint_dir=run / "epoch_0", model_cfg={"_component_": "x.stt",
                      "variant": "stt", "routed_layers": [1, 3], "capacity": 0.5, "student_routing_mode": "threshold",
                      "student_threshold": 0.5}, routed=True, dropped=[], flop_ratio=0.8, notes=None,
                      provenance=provenance)
    assert "base model: `base_model_hf`" in card and "student (deployed) 3.500, teacher 3.250" in card
    assert "huggingface-cli upload" in card and "trust_remote_code=True" in card
