#!/usr/bin/env bash
# Regenerate the demo pair (models/demo/target, models/demo/drafter) and MANIFEST.json from a
# clean checkout. Seeded; about 2 hours on 2 CPU cores. Run from anywhere:
#     bash models/demo/build.sh            (PYTHON=/path/to/python to choose the interpreter)
# Both trainings checkpoint as they go; rerun with RESUME=1 to continue an interrupted build.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
RESUME_FLAG=""
if [ "${RESUME:-0}" = "1" ]; then RESUME_FLAG="--resume"; fi

# 1. The target: a 6-layer Llama (hidden 256, vocab 4096, context 512, tied embeddings) trained
#    from scratch on the Python standard library's source (held-out split: workers/training/corpus.py).
$PY -m workers.training.target --out models/demo/target --steps 2000 --batch 16 --hidden 256 --layers 6 --heads 4 --intermediate 768 --save-every 100 --seed 0 $RESUME_FLAG
#    Its held-out perplexity and the share of greedy continuations that loop (target_eval.json).
$PY -m workers.training.target_eval --target models/demo/target --out models/demo/target_eval.json

# 2. Its block-diffusion drafter, trained on the target's own continuations of training-split
#    prompts, then evaluated by exact speculative decoding on held-out prompts (drafter/eval.json).
$PY -m adapt.cli train-drafter --target models/demo/target --out models/demo/drafter --regenerate --num-sequences 6144 --prompt-len 64 --seq-len 384 --sample-frac 0.25 --steps 4500 --batch 8 --anchors 24 --layers 2 --block-size 16 --save-every 100 --seed 0 --threads 2 $RESUME_FLAG

# 3. The demo policy file (what `adapt serve` starts with): the adaptive policy with its acceptance
#    predictor fitted on `explore` traces of this pair (every serving worker profiles its own cost).
$PY -m adapt.cli bench policies --out results/policies/demo --seed 0
cp results/policies/demo/policy.json models/demo/policy.json

# 4. Shipped files only (checkpoints and the regenerated pool stay out), then the manifest.
rm -rf models/demo/target/checkpoint models/demo/drafter/checkpoint
$PY -m workers.training.manifest --root models/demo --build models/demo/build.sh
