"""An exported folder against the torchtune model it came from, on real text: logits, greedy generations of a
left-padded batch, and executed fractions.

    python -m benchmarks.export_parity --exported quickstart_work/exported/recommended_0_81_linear \\
        --config configs/quickstart/generate_recommended_0_81_linear_smollm2.yaml \\
        --checkpoint-dir quickstart_work/recommended_0_81_linear/epoch_0 --heldout quickstart_work/corpus/test.jsonl

Run it from the folder the config's relative paths start from (``quickstart_work/`` for the quickstart's configs).
Prints one JSON object; ``tests/test_export.py`` asserts the same on the tiny model.
"""

import argparse
import json
from pathlib import Path

import torch
from torchtune import config as tt_config
from torchtune.generation import generate as torchtune_generate
from torchtune.modules.common_utils import local_kv_cache

from torchtune_dtf.evaluation.routing_report import command_line_overrides, heldout_windows, load_config, load_trained

PROMPTS = ("The king", "Of man's first disobedience, and the fruit", "To be, or not to be: that is")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.export_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--exported", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--heldout", required=True, help="JSONL with a 'text' field")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    args, overrides = command_line_overrides(parser, argv)
    from transformers import AutoModelForCausalLM

    cfg = load_config(Path(args.config), overrides)
    ours = load_trained(cfg, Path(args.checkpoint_dir)).float()
    theirs = AutoModelForCausalLM.from_pretrained(args.exported, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    result = {"exported": args.exported, "checkpoint": args.checkpoint_dir}

    windows = heldout_windows(tokenizer, Path(args.heldout), args.seq_len, args.windows, spread=True)
    ours.reset_routing_counters()
    theirs.reset_routing_counters()
    with torch.no_grad():
        difference = max(float((ours(w[None]) - theirs(w[None]).logits).abs().max()) for w in windows)
    result["heldout_logits_max_abs_difference"] = difference
    result["heldout_executed_fraction"] = {"torchtune": ours.executed_fractions(), "hf": theirs.executed_fractions()}

    encoded = [tokenizer.encode(p, add_bos=False, add_eos=False) for p in PROMPTS]
    width = max(map(len, encoded))
    prompts = torch.zeros(len(encoded), width, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for row, ids in enumerate(encoded):
        prompts[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    new = args.new_tokens
    ours.reset_routing_counters()
    with torch.no_grad(), local_kv_cache(ours, batch_size=len(encoded), device=torch.device("cpu"),
                                         dtype=torch.float32, decoder_max_seq_len=width + new):
        expected, _ = torchtune_generate(ours, prompts, max_generated_tokens=new, pad_id=0, temperature=0.0,
                                         stop_tokens=None)
    theirs.reset_routing_counters()
    with torch.no_grad():
        got = theirs.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    result["generate"] = {
        "prompts": len(PROMPTS), "new_tokens": new, "left_padded_to": width,
        "tokens_equal": bool(torch.equal(got, expected)),
        "rows_equal": [bool(torch.equal(a, b)) for a, b in zip(got, expected)],
        "executed_fraction": {"torchtune": ours.executed_fractions(), "hf": theirs.executed_fractions()},
        "hf_text": [tokenizer.decode(row[width:].tolist()) for row in got],
    }
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return result


if __name__ == "__main__":
    main()
