#!/usr/bin/env bash
# Speed of an earlier commit ("before", in a git worktree, with its own models) against this
# checkout ("after"), alternately, on held-out chat prompts and the mixed workload (smollm2 pair).
#   bash scripts/speed_before_after.sh 224fc56 results/speed-smollm2-17
set -euo pipefail
REV=${1:?usage: speed_before_after.sh REV OUT}
OUT=$(realpath -m "${2:?usage: speed_before_after.sh REV OUT}")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
BEFORE=$(mktemp -d)/before
git -C "$ROOT" worktree add -q "$BEFORE" "$REV"
trap 'git -C "$ROOT" worktree remove --force "$BEFORE"' EXIT
mkdir -p "$OUT"
run() {  # checkout name workload-args...
  local dir=$1 name=$2; shift 2
  (cd "$dir" && "$PY" -m adapt.cli bench speed --pair smollm2 --rows adapt-ar,adapt-suffix,adapt-policy \
      --batch-sizes 1,8 --max-tokens 128 --num-prompts 8 --max-groups 4 --rounds 3 --compile off --threads 2 \
      "$@" --out "$OUT/$name") > "$OUT/$name.log" 2>&1
}
run "$BEFORE" chat-before --prompts "$ROOT/models/smollm2/heldout_prompts.jsonl"
run "$ROOT" chat-after --prompts "$ROOT/models/smollm2/heldout_prompts.jsonl"
run "$BEFORE" mixed-before --workload mixed
run "$ROOT" mixed-after --workload mixed
