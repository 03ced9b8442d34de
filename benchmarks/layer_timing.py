"""Where one real training step's time goes, per decoder layer, for dense and routed models.

    python -m benchmarks.layer_timing                       # 0.5B shape, T = 512, dense vs MoD, subnormals flushed
    python -m benchmarks.layer_timing --variants mod sdt --keep-denormals

Unlike ``run.py``'s breakdown (parts timed alone), this times the parts *inside* whole training steps (the
recipe's loss, backward, fused AdamW, as in ``run.section_train``): forward pre/post hooks stamp each layer's
forward, and gradient hooks on each layer's output and input stamp the start and end of its backward. What is
left of the forward and backward outside the layers is the embedding, the LM head and the loss. The hooks
only read the clock; the computation is the one the models run.
"""

import argparse
import os
import sys
import time
from typing import Dict, List

if __name__ == "__main__":
    # Threads first: importing benchmarks.run imports torch, which reads them when it starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    from benchmarks.run import MALLOC_REUSE  # same allocator setting as the suite

    if any(os.environ.get(k) != v for k, v in MALLOC_REUSE.items()):
        os.environ.update(MALLOC_REUSE)
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.layer_timing", *sys.argv[1:]])

import torch

from torchtune_dtf import closed_form as cf
from benchmarks.common import build_dense, build_like, median, routing_for, subnormals_flushed
from benchmarks.run import GAMMA, prepare_training, timed_train_step


class LayerClock:
    """Stamps forward start/end and backward start/end of every layer of ``model``."""

    def __init__(self, model) -> None:
        self.stamps: Dict[tuple, float] = {}
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(self._pre(i), with_kwargs=True)
            layer.register_forward_hook(self._post(i), with_kwargs=True)

    def _stamp(self, key) -> None:
        self.stamps[key] = time.perf_counter()

    def _pre(self, i):
        def hook(module, args, kwargs):
            self._stamp(("fwd", i, "start"))
            x = args[0] if args else kwargs["x"]
            if x.requires_grad:  # its gradient is the last thing this layer's backward produces
                x.register_hook(lambda grad: self._stamp(("bwd", i, "end")))
        return hook

    def _post(self, i):
        def hook(module, args, kwargs, out):
            self._stamp(("fwd", i, "end"))
            out.register_hook(lambda grad: self._stamp(("bwd", i, "start")))
        return hook

    def layer_seconds(self, num_layers: int) -> Dict[str, List[float]]:
        s = self.stamps
        out = {"fwd": [], "bwd": []}
        for i in range(num_layers):
            out["fwd"].append(s[("fwd", i, "end")] - s[("fwd", i, "start")])
            # Every layer's input requires grad (layer 0's through the embedding weight), so both stamps exist.
            out["bwd"].append(s[("bwd", i, "end")] - s[("bwd", i, "start")])
        return out


def measure(size: str, variants: List[str], batch: int, seq_len: int, steps: int, warmup: int) -> Dict:
    dense = build_dense(size)
    models = {"dense": dense}
    for variant in variants:
        models[variant] = build_like(dense, variant, size, **routing_for(variant, capacity=GAMMA))
    loss_fn, optimizer = prepare_training(models)
    clocks = {name: LayerClock(m) for name, m in models.items()}
    tokens = torch.randint(0, cf.model_shape(size).vocab_size, (batch, seq_len))
    records: Dict[str, List[Dict]] = {name: [] for name in models}
    for step in range(warmup + steps):
        for name, model in models.items():  # interleaved, as run.section_train
            phases = timed_train_step(model, name, tokens, loss_fn, optimizer)
            if step < warmup:
                continue
            layers = clocks[name].layer_seconds(len(model.layers))
            records[name].append(dict(
                fwd_layers=layers["fwd"], bwd_layers=layers["bwd"],
                fwd_outside=phases["fwd"] - sum(layers["fwd"]), bwd_outside=phases["bwd"] - sum(layers["bwd"]),
                opt=phases["opt"], step=phases["step"]))
    result = {}
    for name, recs in records.items():
        num_layers = len(models[name].layers)
        result[name] = dict(
            fwd_layers=[median(r["fwd_layers"][i] for r in recs) for i in range(num_layers)],
            bwd_layers=[median(r["bwd_layers"][i] for r in recs) for i in range(num_layers)],
            **{k: median(r[k] for r in recs) for k in ("fwd_outside", "bwd_outside", "opt", "step")})
    return result


def render(result: Dict) -> str:
    names = list(result)
    lines = ["| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    num_layers = len(result["dense"]["fwd_layers"])
    for i in range(num_layers):
        for phase in ("fwd", "bwd"):
            lines.append(f"| layer {i} {phase} | " + " | ".join(f"{result[n][f'{phase}_layers'][i]:.3f}" for n in names) + " |")
    for key in ("fwd_outside", "bwd_outside", "opt", "step"):
        lines.append(f"| {key} | " + " | ".join(f"{result[n][key]:.3f}" for n in names) + " |")
    dense = result["dense"]
    lines.append("")
    for n in names[1:]:
        r = result[n]
        lines.append(f"{n}/dense: step {r['step'] / dense['step']:.3f}; decoder layers forward "
                     f"{sum(r['fwd_layers']) / sum(dense['fwd_layers']):.3f}, backward "
                     f"{sum(r['bwd_layers']) / sum(dense['bwd_layers']):.3f}; outside the layers forward "
                     f"{r['fwd_outside'] / dense['fwd_outside']:.3f}, backward {r['bwd_outside'] / dense['bwd_outside']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0_5b", choices=("0_5b", "tiny"))
    parser.add_argument("--variants", nargs="+", default=["mod"], choices=("mod", "sdt", "stt"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--keep-denormals", action="store_true", help="compute with subnormal floats (see benchmarks/README.md)")
    args = parser.parse_args(argv)
    with subnormals_flushed(not args.keep_denormals) as flush:
        torch.manual_seed(0)
        result = measure(args.size, args.variants, args.batch, args.seq_len, args.steps, args.warmup)
    print(f"b = {args.batch}, T = {args.seq_len}, {torch.get_num_threads()} thread(s), subnormals "
          f"{'flushed' if flush else 'kept'}; seconds, median of {args.steps} steps")
    print(render(result))
    return result


if __name__ == "__main__":
    main()
