"""Runs vLLM's CPU build for `adapt bench speed`, in vLLM's own virtual environment.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \\
        /work/vllm-venv/bin/python adapt/bench/vllm_runner.py '{"model": "models/demo/target", ...}'

This file is executed by another interpreter (the one vLLM is installed in), so it imports only
the standard library and vLLM: never `adapt`, `workers` or `kernels`.

Protocol (JSON, one object per line). The first argument configures the engine:
`{"model": DIR, "dtype": "bfloat16", "speculative_config": {...} | null, "max_model_len": 1024,
"max_num_seqs": 8, "seed": 0, "enable_prefix_caching": false}`. Prefix caching is off unless the
configuration turns it on: a benchmark's rounds send the same prompts again, so a cache of their
KV blocks would skip all but the first round's prefills (8 chat prompts, 952 tokens: 0.29 s cached
against 0.60 s computed, of a 3.1 s batch), which our engine, without a prefix cache, computes
every time. The runner loads the model and prints
`@@RESULT {"event": "ready", "load_s": ..., "vllm": VERSION}`. It then reads requests on stdin,
`{"prompts": [[token ids], ...], "batch": B, "max_tokens": N}`, and answers each with
`@@RESULT {"tokens": ..., "seconds": ..., "steps": ..., "outputs": [[ids], ...], ...}`:
the prompts run in groups of `B` (one `LLM.generate` call per group, all of the group batched),
greedy, `ignore_eos`, and `seconds` is measured around the `generate` calls only (`group_seconds`
and `group_steps` hold each call's share). `steps` counts engine steps (one model forward each),
so tokens per sequence per step is the τ that the other rows report. An empty line or end of
input ends the runner. Only lines starting with `@@RESULT` belong to the protocol; vLLM's own
logging may share stdout.
"""

from __future__ import annotations

import json
import sys
import time

MARKER = "@@RESULT "


def emit(obj: dict) -> None:
    sys.stdout.write(MARKER + json.dumps(obj) + "\n")
    sys.stdout.flush()


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens), summed."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics are optional extras; the timing does not depend on them
        return totals
    for metric in metrics:
        key = names.get(metric.name.removesuffix("_total"))
        if key is not None and hasattr(metric, "value"):
            totals[key] += int(metric.value)
    return totals


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_runner.py CONFIG_JSON", file=sys.stderr)
        return 2
    config = json.loads(argv[1])
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=config["model"],
        dtype=config.get("dtype", "bfloat16"),
        max_model_len=int(config.get("max_model_len", 1024)),
        max_num_seqs=int(config.get("max_num_seqs", 8)),
        seed=int(config.get("seed", 0)),
        skip_tokenizer_init=True,
        disable_log_stats=False,
        enforce_eager=bool(config.get("enforce_eager", False)),
        enable_prefix_caching=bool(config.get("enable_prefix_caching", False)),
    )
    if config.get("speculative_config"):
        kwargs["speculative_config"] = config["speculative_config"]
    llm = LLM(**kwargs)

    steps = [0]
    engine_step = llm.llm_engine.step

    def counted_step(*args, **kw):
        steps[0] += 1
        return engine_step(*args, **kw)

    llm.llm_engine.step = counted_step
    emit({"event": "ready", "load_s": time.perf_counter() - t0, "vllm": vllm.__version__})

    for line in sys.stdin:
        line = line.strip()
        if not line:
            break
        request = json.loads(line)
        prompts = request["prompts"]
        batch = int(request["batch"])
        params = SamplingParams(
            temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=True, detokenize=False
        )
        before = spec_counters(llm)
        steps[0] = 0
        outputs: list[list[int]] = []
        group_seconds: list[float] = []
        group_steps: list[int] = []
        for start in range(0, len(prompts), batch):
            group = [{"prompt_token_ids": ids} for ids in prompts[start : start + batch]]
            t = time.perf_counter()
            results = llm.generate(group, params, use_tqdm=False)
            group_seconds.append(time.perf_counter() - t)
            group_steps.append(steps[0] - sum(group_steps))
            outputs.extend(list(r.outputs[0].token_ids) for r in results)
        after = spec_counters(llm)
        emit({
            "tokens": sum(len(o) for o in outputs),
            "seconds": sum(group_seconds),
            "group_seconds": group_seconds,
            "group_steps": group_steps,
            "steps": steps[0],
            "groups": (len(prompts) + batch - 1) // batch,
            "spec": {k: after[k] - before[k] for k in after},
            "outputs": outputs,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
