"""torchtune_dtf.evaluation.{routing_plots, routing_report} on tiny trained runs: every PNG, the heat map's data,
config overrides, and base (never routed, stock HF) checkpoints."""

import math
import os
from pathlib import Path

import pytest
import torch
from torchtune import config as tt_config

from tests.test_recipe import TINY, load_config, run_recipe, train_assets  # noqa: F401  (session fixture)
from torchtune_dtf.modules import RoutingContext
from torchtune_dtf.evaluation import routing_plots, routing_report
from torchtune_dtf.training.checkpointer import hf_weight_files
from torchtune_dtf.evaluation.routing_report import heldout_windows, load_config as load_run_config, load_trained

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VARIANTS = ("stt", "mod", "dense")
#: The held-out text of these tests is the tiny corpus; small windows keep the evaluation fast.
SMALL = ["--heldout", "corpus.jsonl", "--windows", "2", "--seq-len", "24", "--passage-tokens", "32", "--batch-size", "2"]


@pytest.fixture(scope="module")
def runs(train_assets, tmp_path_factory):  # noqa: F811
    """One tiny training per variant (4 steps, validation every 2) in ``<root>/<variant>_run``."""
    root = tmp_path_factory.mktemp("plots")
    for name in ("qwen2_5_tokenizer", "tiny_qwen2_5_hf", "corpus.jsonl"):
        os.symlink(train_assets / name, root / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # the configs' paths are relative to the working directory
        for variant in VARIANTS:
            run_recipe(load_config(f"{variant}_train", output_dir=f"./{variant}_run", save_every_n_steps=1000))
        # The same STT run logged through torchtune's TensorBoardLogger instead of its DiskLogger.
        run_recipe(load_config("stt_train", output_dir="./stt_tensorboard_run", save_every_n_steps=1000,
                               metric_logger={"_component_": "torchtune.training.metric_logging.TensorBoardLogger",
                                              "log_dir": "./stt_tensorboard_run/logs"}))
    return root


@pytest.fixture
def at_runs(runs, monkeypatch):
    monkeypatch.chdir(runs)
    return runs


def assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height >= 200 and width >= 500 and image.shape[2] in (3, 4), (path, image.shape)
    assert float(image[..., :3].max() - image[..., :3].min()) > 0.5, f"{path} is blank"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_plot_is_written(variant, at_runs, tmp_path, capsys):
    out = tmp_path / "plots"
    result = routing_plots.main(["--config", f"{variant}_run/torchtune_config.yaml", "--out", str(out), *SMALL])
    assert result["files"] == [out / name for name in routing_plots.PLOTS]
    for path in result["files"]:
        assert_png(path)
    printed = capsys.readouterr().out
    assert all(str(path) in printed for path in result["files"])
    # Defaults: the run's newest checkpoint and its DiskLogger folder.
    assert result["checkpoint"] == Path(f"{variant}_run/epoch_0") and result["log_dir"] == Path(f"{variant}_run/logs")
    assert result["routing"] == {"stt": "STT", "mod": "MoD", "dense": "dense"}[variant]
    heat = result["heatmap"]
    assert heat.layers == ([] if variant == "dense" else [1, 3])
    assert heat.executed.shape == (len(heat.layers), 32) and len(heat.labels) == 32
    if variant != "dense":
        assert sorted(result["heldout_layers"]) == [1, 3]


#: Logged values that measure the machine, not the run (they differ between two runs of one config).
TIMING = ("tokens_per_second", "seconds", "_time", "memory", "wall_s", "_s_per")


def test_tensorboard_logs_hold_what_the_disk_logger_wrote(at_runs):
    from torchtune_dtf.evaluation.metric_logs import parse_disk_logs, parse_tensorboard_logs

    disk = parse_disk_logs(Path("stt_run/logs"))
    board = parse_tensorboard_logs(Path("stt_tensorboard_run/logs"))
    assert list(board) == list(disk) and len(disk) >= 4
    for step, row in disk.items():
        assert sorted(board[step]) == sorted(row), step
        for key, value in row.items():
            if not any(word in key for word in TIMING):
                assert board[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert any(key.startswith("routing/layer_1/") for row in board.values() for key in row)


def test_plots_read_a_tensorboard_run(at_runs, tmp_path):
    result = routing_plots.main(["--config", "stt_tensorboard_run/torchtune_config.yaml", "--out", str(tmp_path), *SMALL])
    assert result["log_dir"] == Path("stt_tensorboard_run/logs")
    for path in result["files"]:
        assert_png(path)
    with pytest.raises(ValueError, match="cannot be read back"):
        routing_plots.main(["--config", "stt_run/torchtune_config.yaml", "--out", str(tmp_path), *SMALL,
                            "metric_logger._component_=torchtune.training.metric_logging.StdoutLogger"])


def test_default_output_folder_is_beside_the_run(at_runs):
    result = routing_plots.main(["--config", "stt_run/torchtune_config.yaml", *SMALL])
    assert {p.parent for p in result["files"]} == {Path("stt_run/plots")}


def test_heatmap_is_the_students_selection_on_the_passage(at_runs):
    cfg = load_run_config(Path("stt_run/torchtune_config.yaml"))
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    passage = heldout_windows(tokenizer, Path("corpus.jsonl"), 32, 1)[0]
    model = load_trained(cfg, Path("stt_run/epoch_0"))
    heat = routing_plots.student_heatmap(model, tokenizer, passage)

    routing = RoutingContext(mode="student")
    with torch.no_grad():
        model(passage[None], routing=routing)
    assert heat.layers == sorted(routing.layers) == [1, 3]
    for row, layer in enumerate(heat.layers):
        assert torch.equal(heat.executed[row], routing.layers[layer].selected_mask[0])
    assert 0 < heat.executed.sum() < heat.executed.numel()  # a real selection, not all or nothing
    # The labels are the passage's tokens, one each, whitespace made visible.
    assert heat.tokens == passage.tolist()
    shown = "".join(heat.labels)
    for char, visible in routing_plots.VISIBLE_WHITESPACE.items():
        shown = shown.replace(visible, char)
    assert shown == tokenizer.decode(passage.tolist(), skip_special_tokens=False)
    # The command draws exactly this data.
    assert torch.equal(routing_plots.main(["--config", "stt_run/torchtune_config.yaml", *SMALL])["heatmap"].executed,
                       heat.executed)


def test_overrides_are_applied_as_tune_run_applies_them(at_runs):
    # The shipped config plus the run's output_dir: the logs and checkpoint of that run (./outputs does not exist);
    # a student threshold τ ≈ 0 makes every routed layer run every token.
    result = routing_plots.main(["--config", str(TINY / "stt_train.yaml"), *SMALL, "output_dir=./stt_run",
                                 "model.student_threshold=0.000001"])
    assert result["checkpoint"] == Path("stt_run/epoch_0") and result["log_dir"] == Path("stt_run/logs")
    assert result["heatmap"].executed.all()
    assert all(row["student/selected_fraction"] == 1.0 for row in result["heldout_layers"].values())

    cfg = load_run_config(TINY / "stt_train.yaml", ["~model.gate_threshold", "model.capacity=0.25", "seed=None",
                                                    "model=torchtune_dtf.models.qwen2_5.sdt_qwen2_5_tiny"])
    assert "gate_threshold" not in cfg.model and cfg.model.capacity == 0.25 and cfg.seed is None
    assert cfg.model._component_ == "torchtune_dtf.models.qwen2_5.sdt_qwen2_5_tiny"  # `model=` names the builder
    # tune run refuses to remove a component (its message then says it cannot find the key); so does this.
    with pytest.raises(ValueError, match="dataset_val"):
        load_run_config(TINY / "stt_train.yaml", ["~dataset_val"])
    with pytest.raises(SystemExit):
        routing_plots.main(["--config", "stt_run/torchtune_config.yaml", *SMALL, "--no-such-option"])


def test_routing_report_takes_overrides_for_either_config(at_runs, capsys):
    assert routing_report.split_overrides(["a=1", "dense.b=2", "~dense.c", "~d", "dense_x=3"]) == (
        ["a=1", "~d", "dense_x=3"], ["b=2", "~c"])
    args = ["--dense", str(TINY / "dense_train.yaml"), "dense_run/epoch_0",
            "--routed", str(TINY / "stt_train.yaml"), "stt_run/epoch_0",
            "--heldout", "corpus.jsonl", "--windows", "2", "--seq-len", "24", "--batch-size", "2"]
    report = routing_report.main([*args, "model.student_threshold=0.000001"])
    assert all(row["student/selected_fraction"] == 1.0 for row in report["layers"].values())
    assert report["config"]["routing"]["student_threshold"] == 0.000001
    # A dense. override reaches the dense config only (the routed one would load fine).
    with pytest.raises(ValueError, match="QWEN2 only"):
        routing_report.main([*args, "dense.checkpointer.model_type=LLAMA2"])


def test_base_checkpoints_are_accepted(at_runs, tmp_path, capsys):
    from transformers import Qwen2ForCausalLM

    # A stock HF folder (model.safetensors): dense and routed models before any fine-tuning.
    report = routing_report.main([
        "--dense", str(TINY / "dense_train.yaml"), "tiny_qwen2_5_hf", "--routed", str(TINY / "stt_train.yaml"),
        "tiny_qwen2_5_hf", "--heldout", "corpus.jsonl", "--windows", "2", "--seq-len", "24", "--batch-size", "2",
    ])
    assert all(math.isfinite(v) for v in report["loss"].values()) and sorted(report["layers"]) == [1, 3]
    result = routing_plots.main(["--config", "stt_run/torchtune_config.yaml", "--checkpoint", "tiny_qwen2_5_hf",
                                 "--out", str(tmp_path / "base"), *SMALL])
    assert result["heatmap"].layers == [1, 3] and len(result["files"]) == len(routing_plots.PLOTS)

    # A sharded stock folder: its index names the shards, and the weights are the same.
    sharded = tmp_path / "sharded"
    Qwen2ForCausalLM.from_pretrained("tiny_qwen2_5_hf").save_pretrained(sharded, max_shard_size="20MB")
    files = hf_weight_files(sharded)
    assert len(files) > 1 and all(f.startswith("model-") and f.endswith(".safetensors") for f in files)
    cfg = load_run_config(TINY / "dense_train.yaml")
    single, shards = load_trained(cfg, Path("tiny_qwen2_5_hf")), load_trained(cfg, sharded)
    assert all(torch.equal(a, b) for a, b in zip(single.state_dict().values(), shards.state_dict().values()))

    # The checkpointer's own folders: the index lists the shard, not routing.safetensors beside it.
    assert hf_weight_files(Path("stt_run/epoch_0")) == ["model-00001-of-00001.safetensors"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no model weights"):
        load_trained(cfg, tmp_path / "empty")
