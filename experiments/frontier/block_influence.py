"""Which whole layers static layer dropping removes: the layers that change the residual stream least.

Block influence (ShortGPT's measure) of layer l on text: BI_l = 1 − E_t[cos(x_t^(l−1), x_t^(l))], the
mean over tokens of how much the layer turns each token's hidden state. Measured here on the pretrained
model and the *training* split (never the held-out works the study evaluates on), it ranks the layers;
the study's layer-dropping baseline removes the k lowest-ranked layers, never the first or the last — the
strongest static baseline we know at equal FLOPs, rather than an arbitrary stride.

    python experiments/frontier/block_influence.py --config configs/quickstart/dense_smollm2.yaml \
        --text quickstart_work/corpus/train.jsonl --windows 16 --seq-len 256 --json experiments/frontier/block_influence.json
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import config

from torchtune_dtf.evaluation.routing_report import heldout_windows, load_trained


@torch.no_grad()
def block_influence(model, windows: torch.Tensor, batch_size: int = 4):
    """Per layer, 1 − mean cosine between each token's input and output hidden state; list of floats."""
    totals = torch.zeros(len(model.layers), dtype=torch.float64)
    count = 0
    for batch in windows.split(batch_size):
        h = model.tok_embeddings(batch)
        for i, layer in enumerate(model.layers):
            out = layer(h)
            totals[i] += (1 - F.cosine_similarity(h.float(), out.float(), dim=-1)).double().sum()
            h = out
        count += batch.numel()
    return (totals / count).tolist()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the dense training config (model, tokenizer, checkpointer)")
    parser.add_argument("--text", type=Path, required=True, help="JSONL with a 'text' field (training split)")
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    model = load_trained(cfg, cfg.checkpointer.checkpoint_dir)  # the stock pretrained folder
    windows = heldout_windows(config.instantiate(cfg.tokenizer), args.text, args.seq_len, args.windows)
    influence = block_influence(model, windows)
    inner = sorted(range(1, len(influence) - 1), key=lambda i: influence[i])
    print("layer  block influence")
    for i, value in enumerate(influence):
        print(f"{i:5d}  {value:.4f}")
    print("inner layers, least influential first:", inner)
    if args.json:
        args.json.write_text(json.dumps({"config": args.config, "text": str(args.text), "windows": args.windows,
                                         "seq_len": args.seq_len, "block_influence": influence,
                                         "inner_layers_by_influence": inner}, indent=1))


if __name__ == "__main__":
    main()
