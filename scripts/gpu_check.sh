#!/usr/bin/env bash
# The CUDA path checked in one run (issue #20): a thin wrapper around `python -m adapt.bench.gpu_check`.
#
#   bash scripts/gpu_check.sh --out "$OUT"                        # on the device machine (see below)
#   bash scripts/gpu_check.sh --device cpu --quick --out /tmp/gpu # the CPU-runnable parts, < 1 min
#
# Every argument goes to the Python module (`python -m adapt.bench.gpu_check --help`); --out
# defaults to results/gpu. The wrapper:
# - picks the Python: $PYTHON, else .venv/bin/python when it imports torch, else python3 (the
#   device machine's python3 holds torch, triton and transformers; .venv does not travel there);
# - installs wheels carried in .whl/ (pydantic for the replay section, which the device image
#   lacks) into a scratch folder on PYTHONPATH, as /work/.library/device/README.md describes;
# - runs the module under `timeout` (GPU_CHECK_TIMEOUT seconds, default 330) and hands the
#   module a budget 25 s shorter, so it skips sections that cannot finish instead of being killed
#   mid-section; each section writes OUT/<section>.json as it ends, OUT/summary.json after each.
#
# On the device machine, with the `run` tool (15 minutes of device time in all; a machine's start
# costs 1-2 of them): command `bash scripts/gpu_check.sh --out $OUT`, timeout_s 360, which leaves
# room for one rerun on the still-warm machine. The 8 files under $OUT come back (the tool's limit
# is 8); copy them to results/gpu/ and commit them.
set -u -o pipefail
cd "$(dirname "$0")/.."

args=("$@")
has_out=0
for a in "${args[@]}"; do
    [[ "$a" == "--out" || "$a" == --out=* ]] && has_out=1
done
[[ $has_out == 1 ]] || args+=(--out results/gpu)

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then
        py=.venv/bin/python
    else
        py=python3
    fi
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    site=/tmp/gpu_check_site
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_check.sh: installing .whl/*.whl failed" >&2; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

limit="${GPU_CHECK_TIMEOUT:-330}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
echo "gpu_check.sh: $py, timeout ${limit} s, args: ${args[*]}"
timeout -k 10 "$limit" "$py" -m adapt.bench.gpu_check --budget-s "$((limit - 25))" "${args[@]}"
rc=$?
[[ $rc == 124 || $rc == 137 ]] && echo "gpu_check.sh: stopped at the ${limit} s limit; finished sections kept their JSON" >&2
exit $rc
