"""Shared fixtures: tiny routed Qwen2 models with fixed initialisation."""

import importlib.util
from pathlib import Path

import pytest
import torch

from torchtune_dtf.models import qwen2_5

VOCAB = 512
#: The tiny builders require it; the tiny HF checkpoints of the tests have max_position_embeddings 256.
MAX_SEQ_LEN = 256

MOD_ROUTING = dict(
    routed_layers="every_other",
    capacity=0.5,
    student_routing_mode="threshold",
    student_threshold=0.5,
    student_window=None,
    causal_router_input="current",
    causal_router_hidden_dim=16,
    routing_init_std=0.02,
    gate="scaled",
    always_run_first_token=False,
    allow_noncausal_student_topk=False,
    skipped_tokens_write_kv=False,
    skip_update="none",
    dropped_layers=[],
)
SURPRISE_ROUTING = dict(
    MOD_ROUTING,
    causal_router_input="current_previous",
    prior_factor=0.0625,
    ma_window=4,
    o_ce_init=1.025,
    m_cu_init=1.1,
    teacher_selection="topk",
    gate_threshold=None,
)
RANDOM_ROUTING = dict(routed_layers="every_other", capacity=0.5, always_run_first_token=False, skipped_tokens_write_kv=False,
                      skip_update="none", dropped_layers=[])
ROUTING = {
    "dense": {},
    "layerdrop": dict(dropped_layers=[1, 2], skip_update="none"),
    "random": RANDOM_ROUTING,
    "mod": MOD_ROUTING,
    "sdt": SURPRISE_ROUTING,
    "stt": SURPRISE_ROUTING,
}
ROUTED_VARIANTS = ("mod", "sdt", "stt")


def routing_kwargs(variant: str, **overrides):
    return {**ROUTING[variant], **overrides}


def tiny_architecture():
    from torchtune_dtf.models.qwen2_5._model_builders import QWEN2_5_SHAPES

    return {**QWEN2_5_SHAPES["tiny"], "vocab_size": VOCAB, "max_seq_len": MAX_SEQ_LEN}


def build_tiny(variant: str, seed: int = 0, **overrides):
    """Tiny model of ``variant`` with fixed random weights (same backbone for the same seed)."""
    torch.manual_seed(seed)
    model = qwen2_5.routed_qwen2(variant, **tiny_architecture(), **routing_kwargs(variant, **overrides))
    # Backbone weights from a dense model with the same seed, so every variant shares them.
    torch.manual_seed(seed)
    dense = qwen2_5.dense_qwen2_5_tiny(vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN)
    _perturb_norms(dense, seed)
    model.load_state_dict(dense.state_dict(), strict=False)
    return model.eval()


def _perturb_norms(model, seed):
    # RMSNorm scales start at 1; make them non-trivial so a mis-wired norm cannot go unnoticed.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


@pytest.fixture
def small_query_chunks(monkeypatch):
    """Attention in chunks of 4 selected queries (the library cuts chunks of 64), so the tiny sequences of the
    tests attend chunk by chunk over a prefix of the keys, as long sequences do."""
    from torchtune_dtf.modules import routed_block

    monkeypatch.setattr(routed_block, "_MIN_QUERIES_PER_CHUNK", 4)


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(7))


def load_script(path: Path, name: str):
    """The Python file at ``path`` (an experiment script, not a package module) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
