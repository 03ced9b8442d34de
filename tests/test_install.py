"""The installable plugin (issue 49 §4): the wheel carries the recipes and configs, and from a directory outside the
checkout ``python -m torchtune_dtf ls`` lists them, ``cp`` copies one and ``run`` fine-tunes with the copy."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from torchtune_dtf import _cli

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_config_is_listed_under_the_recipe_that_runs_it():
    grouped = _cli.configs_by_recipe()
    shipped = sorted(p.relative_to(REPO / "configs").with_suffix("").as_posix()
                     for p in (REPO / "configs").rglob("*.yaml"))
    assert sorted(sum(grouped.values(), [])) == shipped
    assert "stt_qwen0_5b" in grouped["routed_finetune"] and "tiny/stt_train" in grouped["routed_finetune"]
    assert "eval/stt_qwen0_5b" in grouped["routed_eval"] and "quickstart/eval_dense_smollm2" in grouped["routed_eval"]
    assert "tiny/generate_stt" in grouped["routed_generate"]
    # the classification agrees with what the configs are: eval configs name tasks, generate configs a prompt
    import yaml

    for recipe, keys in (("routed_eval", "tasks"), ("routed_generate", "prompt"), ("routed_finetune", "optimizer")):
        for name in grouped[recipe]:
            assert keys in yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text()), (recipe, name)


def test_run_resolves_our_names_and_passes_everything_else_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("seed: 1\n")
    resolved = _cli.resolve_run_arguments(
        ["--nproc_per_node", "2", "routed_finetune", "--config", "quickstart/stt_smollm2", "seed=3"])
    assert resolved == ["--nproc_per_node", "2", "torchtune_dtf/recipes/routed_finetune.py", "--config",
                        str(_cli.CONFIG_DIR / "quickstart" / "stt_smollm2.yaml"), "seed=3"]
    # a file in the working directory wins over a shipped name; torchtune's own recipe names pass unchanged
    assert _cli.resolve_run_arguments(["eleuther_eval", "--config", "mine.yaml"]) == ["eleuther_eval", "--config",
                                                                                      "mine.yaml"]


def test_cp_copies_like_tune_cp(tmp_path, capsys):
    target = _cli.copy("tiny/stt_train", str(tmp_path / "my_stt"))
    assert target == tmp_path / "my_stt.yaml"
    assert target.read_text() == (REPO / "configs" / "tiny" / "stt_train.yaml").read_text()
    assert _cli.copy("routed_eval", str(tmp_path)) == tmp_path / "routed_eval.py"
    target.write_text("edited")
    _cli.copy("tiny/stt_train", str(target), no_clobber=True)
    assert target.read_text() == "edited"
    with pytest.raises(ValueError, match="does not exist"):
        _cli.copy("tiny/stt_train", str(tmp_path / "missing" / "x.yaml"))
    with pytest.raises(ValueError, match="neither a recipe nor a config"):
        _cli.copy("stt_qwen9b", str(tmp_path))


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_outside_the_checkout(tmp_path):
    from tests.test_recipe import write_tiny_hf_checkpoint
    from torchtune_dtf.offline.tokenizer_assets import write_qwen2_5_tokenizer_files

    # 1. the wheel, built with the installed build tools (no index) from a copy of what it is made of: a build in
    #    the checkout would leave build/ behind, whose stale files a later build packs again
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "torchtune_dtf", source / "torchtune_dtf", ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(wheels), str(source)], check=True, timeout=600)
    (wheel,) = wheels.glob("torchtune_dtf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "torchtune_dtf/configs/tiny/stt_train.yaml" in names and "torchtune_dtf/recipes/routed_finetune.py" in names
    assert "torchtune_dtf/configs/stt_qwen0_5b.yaml" in names and not any(n.startswith(("tests/", "experiments/"))
                                                                         for n in names)

    # 2. a fresh venv that sees the pinned dependencies already installed here (a .pth line, not this package's
    #    editable finder, whose .pth is not processed from there), the wheel installed from the file alone
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    fresh_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    (fresh_site / "_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", "--no-deps",
                    "--ignore-installed", str(wheel)], check=True, timeout=600)

    # 3. outside the checkout: ls, cp, and a tiny fine-tune of the copied config
    work = tmp_path / "work"
    work.mkdir()
    write_qwen2_5_tokenizer_files(work / "qwen2_5_tokenizer")
    write_tiny_hf_checkpoint(work / "tiny_qwen2_5_hf")
    shutil.copy(REPO / "tests" / "assets" / "tiny_corpus.jsonl", work / "corpus.jsonl")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"))

    def cli(*args, timeout=120):
        proc = subprocess.run([str(python), "-m", "torchtune_dtf", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc.stdout

    where = subprocess.run([str(python), "-c", "import torchtune_dtf; print(torchtune_dtf.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # the wheel's copy, not this checkout
    listing = cli("ls")
    assert listing.splitlines()[0].split() == ["RECIPE", "CONFIG"]
    assert "routed_finetune" in listing and "tiny/stt_train" in listing and "quickstart/eval_dense_smollm2" in listing
    cli("cp", "tiny/stt_train", "my_stt.yaml")
    assert (work / "my_stt.yaml").is_file()
    out = cli("run", "routed_finetune", "--config", "my_stt.yaml", "max_steps_per_epoch=2", "save_every_n_steps=2",
              timeout=900)
    assert (work / "outputs" / "epoch_0" / "routing.safetensors").is_file(), out[-3000:]
