#!/usr/bin/env bash
# CUDA recipe checks (run on a GPU machine from the repo root): single-GPU bf16 training of each tiny config, FSDP2
# over NCCL (1 process) with save and an `extend` resume. ASSETS (default .gpu_assets) must hold qwen2_5_tokenizer/
# (python -m torchtune_dtf.offline.tokenizer_assets --output-dir ASSETS/qwen2_5_tokenizer) and corpus.jsonl
# (tests/assets/tiny_corpus.jsonl); the tiny checkpoint is written here with transformers, as tests/test_recipe.py does.

set -u
REPO=$PWD; W=/tmp/recipe_work; rm -rf $W; mkdir -p $W
ASSETS=${ASSETS:-.gpu_assets}; cp -r $ASSETS/qwen2_5_tokenizer $ASSETS/corpus.jsonl $W/
python3 - <<'PY' || { echo "FAIL tiny checkpoint"; exit 1; }
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0)
c = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
    torch_dtype="float32")
Qwen2ForCausalLM(c).save_pretrained("/tmp/recipe_work/tiny_qwen2_5_hf", safe_serialization=True)
PY
cd $W
for name in dense_train mod_train sdt_train stt_train lora_stt_train; do
  rm -rf outputs
  if timeout 120 python3 $REPO/torchtune_dtf/recipes/routed_finetune.py --config $REPO/configs/tiny/$name.yaml device=cuda dtype=bf16 > $W/$name.log 2>&1; then
    echo "PASS single-GPU bf16 $name: $(grep -o 'Loss: [0-9.]*' $W/$name.log | tail -1)"
  else echo "FAIL single-GPU bf16 $name"; tail -25 $W/$name.log; fi
done
rm -rf outputs
if timeout 150 python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29517 $REPO/torchtune_dtf/recipes/routed_finetune.py --config $REPO/configs/tiny/stt_train.yaml device=cuda dtype=bf16 > $W/fsdp.log 2>&1; then
  echo "PASS FSDP2 NCCL 1-process bf16 stt_train: $(grep -o 'Loss: [0-9.]*' $W/fsdp.log | tail -1); saved: $(ls outputs/epoch_0 | tr '\n' ' ')"
else echo "FAIL FSDP2 NCCL"; tail -40 $W/fsdp.log; fi
if timeout 150 python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29518 $REPO/torchtune_dtf/recipes/routed_finetune.py --config $REPO/configs/tiny/stt_train.yaml device=cuda dtype=bf16 resume_from_checkpoint=extend max_steps_per_epoch=6 > $W/fsdp_resume.log 2>&1; then
  echo "PASS FSDP2 NCCL resume to step 6: $(grep -o 'Loss: [0-9.]*' $W/fsdp_resume.log | tail -1)"
else echo "FAIL FSDP2 NCCL resume"; tail -30 $W/fsdp_resume.log; fi
