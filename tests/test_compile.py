"""torch.compile over routed models, layer by layer as torchtune's ``training.compile_model`` applies it.

Top-k routing has static shapes by construction (⌊γ·n⌋ tokens per sequence, ⌊γ·b⌋ rows per decode step), so
each routed layer must compile to one whole graph (``fullgraph=True``: any host read or graph break fails)
for the cached prefill, the decode step and the training forward/backward, and give what eager gives:
logits, decisions, cache contents and gradients. Threshold routing has a data-dependent count: its graphs
must stay few over a long decode. ``aot_eager`` traces forward and backward through AOTAutograd (what
inductor compiles) without generating C++, so the matrix runs in seconds; one test runs inductor itself.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.common_utils import delete_kv_caches

from tests.conftest import ROUTED_VARIANTS, VOCAB, build_tiny
from torchtune_dtf.modules import DroppedLayer, RoutedSelfAttentionLayer, RoutingContext
from torchtune_dtf.training.calibration import calibratable_layers, calibrate_student_routers
from torchtune_dtf.training.compile import compile_layers, routes_with_static_shapes

BATCH, PROMPT, NEW, MAX_LEN = 4, 16, 6, 32

#: The papers' setting, and the shape of the study's recommended recipes (a dropped layer, routed layers
#: whose skipped tokens keep writing K/V, a skip bias or the variant's forecast on the skip path).
SHAPES = {
    "papers": {},
    "recommended": dict(skipped_tokens_write_kv=True, skip_update="bias", always_run_first_token=True),
    "forecast": dict(skipped_tokens_write_kv=True, skip_update="predicted"),
    "linear": dict(skipped_tokens_write_kv=True, skip_update="linear", always_run_first_token=True),
}
DROPPED = {"mod": dict(dropped_layers=[2]), "stt": dict(dropped_layers=[2]), "sdt": dict(routed_layers=[3], dropped_layers=[1])}


def build(variant, shape, **overrides):
    kwargs = dict(SHAPES[shape], **overrides)
    if shape != "papers":
        kwargs.update(DROPPED[variant])
    model = build_tiny(variant, **kwargs)
    if shape == "linear":  # maps that are not zero (their start), so what they add is compared too
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".skip_linear." in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3 / param.shape[-1] ** 0.5)
    return model


def causal_masks(max_len=MAX_LEN):
    return torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))[None].expand(BATCH, -1, -1)


def generate_greedy(model, prompt):
    """Cached prefill of ``prompt [b, PROMPT]`` and NEW greedy decode steps with static caches. Returns
    (logits of every step ``[b, PROMPT + NEW, v]``, per routed layer the executed mask ``[b, PROMPT + NEW]``,
    the routed layers' cache buffers)."""
    model.use_static_kv_caches()
    model.setup_caches(batch_size=BATCH, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    masks = causal_masks()
    ctx = RoutingContext(mode="student")
    with torch.no_grad():
        logits = [model(prompt, mask=masks[:, :PROMPT], input_pos=torch.arange(PROMPT), routing=ctx)]
        executed = {i: [r.selected_mask] for i, r in ctx.layers.items()}
        token = logits[-1][:, -1:].argmax(-1)
        for t in range(PROMPT, PROMPT + NEW):
            ctx = RoutingContext(mode="student")
            logits.append(model(token, mask=masks[:, t : t + 1], input_pos=torch.full((BATCH,), t), routing=ctx))
            for i, r in ctx.layers.items():
                executed[i].append(r.selected_mask)
            token = logits[-1][:, -1:].argmax(-1)
    caches = {
        layer.layer_idx: {name: buf.clone() for name, buf in layer.attn.kv_cache.named_buffers()}
        for layer in model.layers if isinstance(layer, RoutedSelfAttentionLayer)
    }
    delete_kv_caches(model)
    return torch.cat(logits, dim=1), {i: torch.cat(m, dim=1) for i, m in executed.items()}, caches


def train_step_grads(model, tokens, beta):
    """One teacher-mode forward/backward (LM + causal-router losses); gradients by parameter name."""
    model.train()
    ctx = RoutingContext(mode="teacher", beta_ce=beta, beta_cu=beta)
    logits = model(tokens, routing=ctx)
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
    causal = sum(r.causal_loss for r in ctx.layers.values() if r.causal_loss is not None)
    (lm + causal).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    return lm.detach(), grads, {i: r.selected_mask for i, r in ctx.layers.items()}


def assert_same_run(eager, compiled, tokens, atol):
    prompt = tokens[:, :PROMPT]
    eager_logits, eager_ran, eager_caches = generate_greedy(eager, prompt)
    compiled_logits, compiled_ran, compiled_caches = generate_greedy(compiled, prompt)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=atol, atol=atol)
    assert eager_ran.keys() == compiled_ran.keys() and eager_ran
    for idx, ran in eager_ran.items():
        assert torch.equal(compiled_ran[idx], ran), f"layer {idx} ran other tokens when compiled"
        assert 0 < ran.sum() < ran.numel(), f"routed layer {idx} ran all tokens or none: proves nothing"
    for idx, buffers in eager_caches.items():
        assert torch.equal(compiled_caches[idx]["fill"], buffers["fill"])
        filled = int(buffers["fill"].max())
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(compiled_caches[idx][name][:, :, :filled], buffers[name][:, :, :filled], rtol=atol, atol=atol)
        assert torch.equal(compiled_caches[idx]["entry_slots"][:, :filled], buffers["entry_slots"][:, :filled])
    # Two β values, as the schedule moves β every step: the second step must reuse the graphs.
    for beta in (100.0, 37.5):
        eager_loss, eager_grads, eager_sel = train_step_grads(eager, tokens, beta)
        compiled_loss, compiled_grads, compiled_sel = train_step_grads(compiled, tokens, beta)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=atol, atol=atol)
        assert eager_grads.keys() == compiled_grads.keys()
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=atol, atol=atol, msg=lambda m: f"{name}: {m}")
        for idx, sel in eager_sel.items():
            assert torch.equal(compiled_sel[idx], sel)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# The forecast on the skip path exists for STT only (its TPN predicts the block's own update).
CASES = [(variant, shape) for variant in ROUTED_VARIANTS for shape in ("papers", "recommended")] + [
    ("stt", "forecast"), ("stt", "linear")]


@pytest.mark.parametrize("variant, shape", CASES)
def test_topk_routed_layers_compile_whole_and_match_eager(variant, shape, fresh_dynamo, small_query_chunks):
    overrides = dict(student_routing_mode="topk", student_threshold=None)
    eager = build(variant, shape, **overrides)
    compiled = compile_layers(build(variant, shape, **overrides), backend="aot_eager")
    assert routes_with_static_shapes(compiled)  # so compile_layers refused graph breaks (fullgraph=True)
    tokens = torch.randint(0, VOCAB, (BATCH, 24), generator=torch.Generator().manual_seed(3))
    assert_same_run(eager, compiled, tokens, atol=1e-5)
    # fullgraph=True already fails on any break; also no layer kind needed a graph per layer or per step:
    # prefill, decode, training with grad (two β) and, per kind, no more.
    kinds = {type(m) for m in compiled.modules() if isinstance(m, TransformerSelfAttentionLayer)}
    assert counters["stats"]["unique_graphs"] <= 4 * len(kinds), dict(counters["stats"])
    # Every layer is compiled but a dropped one, which runs one add at most (compiled, its call costs more).
    for layer in compiled.layers:
        assert (layer._compiled_call_impl is None) == isinstance(layer, DroppedLayer), type(layer).__name__


@pytest.mark.parametrize("student", [dict(student_threshold=0.5),
                                     dict(student_routing_mode="window_topk", student_threshold=None, student_window=8)])
def test_threshold_decode_keeps_its_graphs_bounded_over_200_steps(student, fresh_dynamo):
    # Threshold and window top-k routing decide a data-dependent number of rows per step: one host read per
    # routed layer, hence graph breaks, but the graphs must not grow with the number of steps.
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = build_tiny("stt", **student)
    eager = build_tiny("stt", **student)
    compile_layers(model, backend=counting_backend, fullgraph=False)
    max_len, steps = 224, 200
    masks = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))[None].expand(BATCH, -1, -1)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(5))
    outputs = []
    for m in (eager, model):
        m.use_static_kv_caches()
        m.setup_caches(batch_size=BATCH, dtype=torch.float32, decoder_max_seq_len=max_len)
        m.reset_routing_counters()
        with torch.no_grad():
            logits = [m(prompt, mask=masks[:, :PROMPT], input_pos=torch.arange(PROMPT))]
            after_prefill = len(graphs)
            for t in range(PROMPT, PROMPT + steps):
                if t == PROMPT + 1:
                    after_first_step = len(graphs)
                token = logits[-1][:, -1:].argmax(-1)
                logits.append(m(token, mask=masks[:, t : t + 1], input_pos=torch.full((BATCH,), t)))
        outputs.append((torch.cat(logits, dim=1), m.executed_fractions()))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=1e-5, atol=1e-5)
    assert outputs[1][1] == outputs[0][1]
    assert any(0.05 < f < 0.95 for f in outputs[0][1].values()), outputs[0][1]
    # Each piece of a decode step specialises on how many of the BATCH rows run (0 … BATCH): the graphs are
    # bounded by that, not by the number of steps (200 steps would otherwise compile far more).
    per_step = after_first_step - after_prefill
    assert 0 < per_step and len(graphs) - after_prefill <= (BATCH + 1) * per_step, (after_prefill, after_first_step, len(graphs))


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
@pytest.mark.parametrize("student", [dict(student_threshold=0.5),
                                     dict(student_routing_mode="window_topk", student_threshold=None, student_window=8)])
def test_threshold_students_read_the_device_once_per_routed_layer_and_not_in_training(variant, student, fresh_dynamo):
    # A threshold decode step decides a data-dependent number of rows, read once per routed layer; made in the
    # layer's own frame, the read is the step's only graph break per routed layer (read in a nested call, every
    # frame down to it broke too: four breaks, five graphs per layer and step, each a guard check on the CPU).
    # A whole sequence reads its row counts once; a training forward, which only records the student's mask,
    # reads nothing.
    model = build("stt" if variant == "stt" else variant, "recommended", **student)
    model.use_static_kv_caches()
    model.setup_caches(batch_size=BATCH, dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    masks = causal_masks()
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(prompt, mask=masks[:, :PROMPT], input_pos=torch.arange(PROMPT))
        # Each routed layer as compile_layers compiles it: its own forward is the frame.
        for layer in model.routed_layers():
            x = torch.randn(BATCH, 1, layer.attn.embed_dim, generator=torch.Generator().manual_seed(layer.layer_idx))
            explained = torch._dynamo.explain(layer)(
                x, mask=masks[:, PROMPT : PROMPT + 1], input_pos=torch.full((BATCH,), PROMPT),
                routing=RoutingContext(mode="student").for_layer(layer.layer_idx),
            )
            reasons = [r.reason[:120] for r in explained.break_reasons]
            assert explained.graph_break_count == 1 and "_local_scalar_dense" in reasons[0], (layer.layer_idx, reasons)
            assert explained.break_reasons[0].user_stack[-1].filename.endswith("modules/layers.py")
    delete_kv_caches(model)
    tokens = torch.randn(BATCH, PROMPT, model.routed_layers()[0].attn.embed_dim, generator=torch.Generator().manual_seed(4))
    for layer in model.routed_layers():
        # A whole sequence without a cache (evaluation): the same one read, the row counts' extremes.
        with torch.no_grad():
            explained = torch._dynamo.explain(layer)(tokens, routing=RoutingContext(mode="student").for_layer(0))
        assert explained.graph_break_count == 1, [r.reason[:120] for r in explained.break_reasons]
    # Training (teacher mode) records what the student would run as a mask: no read at all, so the layers
    # compile whole (fullgraph refuses any break) for the forward and the backward.
    compile_layers(model, backend="aot_eager", fullgraph=True)
    token_ids = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(6))
    loss, grads, _ = train_step_grads(model, token_ids, 100.0)
    assert torch.isfinite(loss) and grads


COUNTED_STUDENTS = {
    "threshold": dict(student_threshold=0.5),
    "window_topk": dict(student_routing_mode="window_topk", student_threshold=None, student_window=8),
}


BATCH1_CASES = [
    (variant, shape, student, "aot_eager")
    for variant in ROUTED_VARIANTS for shape in ("papers", "recommended") for student in sorted(COUNTED_STUDENTS)
] + [
    # STT's forecast, computed in the skip branch only, reads the output the cache carries from the step before.
    ("stt", "forecast", student, "aot_eager") for student in sorted(COUNTED_STUDENTS)
] + [
    # The skip linear map of the token's own input, computed in the skip branch only.
    ("stt", "linear", student, "aot_eager") for student in sorted(COUNTED_STUDENTS)
] + [
    # Inductor itself: the branching step reads and overwrites the router's carried term in one graph, the
    # pattern its CPU fusion failed on (pytorch/pytorch#188228) unless the read goes through ``carried_copy``.
    pytest.param("stt", "papers", "threshold", "inductor", marks=pytest.mark.slow),
    pytest.param("stt", "recommended", "window_topk", "inductor", marks=pytest.mark.slow),
    pytest.param("stt", "forecast", "threshold", "inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant,shape,student,backend", BATCH1_CASES)
def test_batch1_counted_decode_step_compiles_whole_and_matches_eager(variant, shape, student, backend, fresh_dynamo):
    # At batch 1 a threshold or window top-k decode step runs the block or skips it. Compiled, that choice is a
    # branch on the device (torch.cond), not a host read: the step is one graph per layer (no break), and 40 decode
    # steps give what eager gives, token by token: logits, which steps ran the block
    # (each layer both ran and skipped, or the comparison proves little), the cache fill and its stored K/V.
    # One graph per layer, and so one graph for a whole decode step compiled at once (compiled_decode_step: a
    # CUDA graph on a GPU), which a host read would split at every routed layer.
    overrides = COUNTED_STUDENTS[student]
    eager, compiled = build(variant, shape, **overrides), build(variant, shape, **overrides)
    max_len, prompt_len, steps = 64, 16, 40
    masks = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))[None]
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(5))
    # Decode steps read a fixed random stream: a random model's own greedy tokens repeat, and so would its choices.
    stream = torch.randint(0, VOCAB, (1, steps), generator=torch.Generator().manual_seed(6))
    if student == "threshold":  # an untrained router's logits sit on one side of τ: hold it to half the tokens
        calibration = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))
        targets = {layer.layer_idx: 0.5 for layer in calibratable_layers(eager)}
        calibrate_student_routers(eager, [{"tokens": calibration}], targets, rounds=2)
        compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled, backend=backend, fullgraph=False)  # the prefill still reads its row counts
    runs = []
    for model in (eager, compiled):
        model.use_static_kv_caches()
        model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=max_len)
        ran = {}
        with torch.no_grad():
            logits = [model(prompt, mask=masks[:, :prompt_len], input_pos=torch.arange(prompt_len))]
            for t in range(prompt_len, prompt_len + steps):
                ctx = RoutingContext(mode="student")
                token = stream[:, t - prompt_len, None]
                logits.append(model(token, mask=masks[:, t : t + 1], input_pos=torch.full((1,), t), routing=ctx))
                for idx, record in ctx.layers.items():
                    ran.setdefault(idx, []).append(record.selected_mask)
        caches = {layer.layer_idx: {name: buf.clone() for name, buf in layer.attn.kv_cache.named_buffers()}
                  for layer in model.routed_layers()}
        runs.append((torch.cat(logits, dim=1), {i: torch.cat(m, dim=1) for i, m in ran.items()}, caches))
    (eager_logits, eager_ran, eager_caches), (compiled_logits, compiled_ran, compiled_caches) = runs
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert eager_ran.keys() == compiled_ran.keys() and eager_ran
    for idx, ran in eager_ran.items():
        assert 0 < ran.sum() < ran.numel(), f"routed layer {idx} ran {ran.float().mean():.2f} of the steps: proves little"
        assert torch.equal(compiled_ran[idx], ran), f"layer {idx} ran other steps when compiled"
        assert torch.equal(compiled_caches[idx]["fill"], eager_caches[idx]["fill"])
        filled = int(eager_caches[idx]["fill"].max())
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(compiled_caches[idx][name][:, :, :filled], eager_caches[idx][name][:, :, :filled],
                                       rtol=1e-5, atol=1e-5)
        assert torch.equal(compiled_caches[idx]["entry_slots"][:, :filled], eager_caches[idx]["entry_slots"][:, :filled])
        # What the next token's forecast reads: the last routed output before its own forecast.
        torch.testing.assert_close(compiled_caches[idx]["last_output"], eager_caches[idx]["last_output"],
                                   rtol=1e-5, atol=1e-5)
    # One more decode step of each routed layer (the eager model's, its cache set up), traced as compile_layers
    # compiles it: no break at all.
    for layer in eager.routed_layers():
        x = torch.randn(1, 1, layer.attn.embed_dim, generator=torch.Generator().manual_seed(layer.layer_idx))
        with torch.no_grad():
            explained = torch._dynamo.explain(layer)(
                x, mask=masks[:, max_len - 1 : max_len], input_pos=torch.full((1,), max_len - 1),
                routing=RoutingContext(mode="student").for_layer(layer.layer_idx),
            )
        assert explained.graph_count == 1 and explained.graph_break_count == 0, [r.reason[:120] for r in explained.break_reasons]
    # And the whole model's decode step, as compiled_decode_step compiles it: one graph for every layer.
    token = torch.randint(0, VOCAB, (1, 1), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        explained = torch._dynamo.explain(eager)(token, mask=masks[:, max_len - 1 : max_len],
                                                 input_pos=torch.full((1,), max_len - 1))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, [r.reason[:120] for r in explained.break_reasons]
    delete_kv_caches(compiled)


@pytest.mark.slow
@pytest.mark.parametrize("shape,student", [("recommended", "topk"), ("papers", "topk"), ("papers", "threshold")])
def test_inductor_compiled_stt_matches_eager(shape, student, fresh_dynamo):
    # The real compiler (C++ codegen on the CPU). A top-k student's decode step reads and rewrites the causal
    # router's carried term in one graph, which inductor's CPU outer-loop fusion failed on (KeyError 'bufN',
    # pytorch/pytorch#188228) until the read went through ``routers.carried_copy``; a threshold student reads the
    # device in between, so it stores the term in the graph after the read and reads it without the copy.
    overrides = dict(student_routing_mode="topk", student_threshold=None) if student == "topk" else {}
    eager = build("stt", shape, **overrides)
    compiled = compile_layers(build("stt", shape, **overrides), backend="inductor")
    tokens = torch.randint(0, VOCAB, (BATCH, 24), generator=torch.Generator().manual_seed(3))
    assert_same_run(eager, compiled, tokens, atol=1e-4)


def test_compiled_inference_reads_exact_key_bounds_inside_the_attention_operator(fresh_dynamo, small_query_chunks, monkeypatch):
    """A compiled layer whose skipped tokens keep their K/V cannot read the selected positions in its graph, so its
    chunks of queries would attend over the worst case's keys. Inference on the CPU reads the exact bounds inside the
    opaque attention operator instead: whole graph (``fullgraph=True``), the eager forward's logits, and bounds that
    stop short of the keys the worst case would take. Training keeps the static bounds (no read in its graph)."""
    from torchtune_dtf.modules import routed_block

    reads, attend = [], routed_block._attention_by_chunks

    def recording(q, key, value, attn_mask, is_causal, chunks, key_bounds, dropout_p, enable_gqa):
        if attn_mask is not None and attn_mask.is_floating_point():  # the operator's additive mask
            reads.append((list(key_bounds), key.shape[2]))
        return attend(q, key, value, attn_mask, is_causal, chunks, key_bounds, dropout_p, enable_gqa)

    monkeypatch.setattr(routed_block, "_attention_by_chunks", recording)
    overrides = dict(student_routing_mode="topk", student_threshold=None, allow_noncausal_student_topk=True)
    eager = build("stt", "forecast", **overrides)
    compiled = compile_layers(build("stt", "forecast", **overrides), backend="aot_eager")
    assert routes_with_static_shapes(compiled)
    tokens = torch.randint(0, VOCAB, (BATCH, MAX_LEN), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = eager(tokens)
        reads.clear()
        got = compiled(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    routed = [layer for layer in compiled.layers if isinstance(layer, RoutedSelfAttentionLayer)]
    assert len(reads) == len(routed), reads  # one call of the operator per routed layer
    for bounds, num_keys in reads:
        # 16 of 32 selected, chunks of 4: the worst case bounds chunk j by 16 + 4(j + 1) keys.
        worst = [num_keys - 16 + 4 * (j + 1) for j in range(len(bounds))]
        assert all(b <= w for b, w in zip(bounds, worst)) and bounds != worst, (bounds, worst)
    reads.clear()
    compiled.train()
    compiled(tokens, routing=RoutingContext(mode="student")).sum().backward()
    assert not reads, "a training graph called the inference operator"


def test_attention_operator_off_the_cpu_gets_no_counts_and_keeps_the_static_bounds():
    """Only the operator's CPU kernel reads exact key counts; a graph on any other device hands it an empty tensor
    (no counts computed for nobody) and its default kernel attends over the static worst-case bounds. Both kernels
    give the masked attention a full computation gives."""
    from torchtune_dtf.modules import routed_block

    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, selected, num_keys, head_dim = 2, 4, 2, 8, 16, 8
    q = torch.randn(rows, heads, selected, head_dim, generator=gen)
    key = torch.randn(rows, kv_heads, num_keys, head_dim, generator=gen)
    value = torch.randn(rows, kv_heads, num_keys, head_dim, generator=gen)
    # Each selected query's own position (its last key), ascending, 8 of 16 per row, not the first 8.
    last_key = torch.stack([torch.randperm(num_keys, generator=gen)[:selected].sort().values for _ in range(rows)])
    allowed = torch.arange(num_keys)[None, None, None, :] <= last_key[:, None, :, None]
    attn_bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    chunk_ends = [2, 4, 6, 8]
    static_bounds = [num_keys - selected + end for end in chunk_ends]
    exact = routed_block._exact_key_bounds(chunk_ends, last_key, num_keys)
    assert exact.tolist() != static_bounds

    assert torch.equal(routed_block._operator_key_bounds(chunk_ends, last_key, num_keys), exact)
    assert routed_block._operator_key_bounds(chunk_ends, last_key.to("meta"), num_keys).numel() == 0

    reference = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=allowed, enable_gqa=True)
    on_cpu = torch.ops.torchtune_dtf.selected_attention_by_chunks(
        q, key, value, attn_bias, exact, chunk_ends, static_bounds, True)
    elsewhere = routed_block.selected_attention_by_chunks._init_fn(  # the default kernel, as a GPU runs it
        q, key, value, attn_bias, last_key.new_empty(0), chunk_ends, static_bounds, True)
    torch.testing.assert_close(on_cpu, reference)
    torch.testing.assert_close(elsewhere, reference)
