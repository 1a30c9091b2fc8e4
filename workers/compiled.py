"""Compiled forwards: a model's whole forward as one generated C++ program (CPU).

At decode sizes on a CPU every eager op costs a few µs of dispatch whatever its size, and a
forward of the demo target is ~400 of them (docs/engine.md, "Speed (CPU)"). `compile_forward`
hands the forward to `torch.compile` with inductor settings that together remove that cost:

- **freezing**: the weights become constants of the program, so inductor packs each linear's
  weight for oneDNN once (what `workers/linear.py` does by hand for the eager path);
- **cpp_wrapper**: the generated program calls its kernels from C++, not from Python;
- **dynamic shapes**: one program serves every batch size, query length, cache width and start
  position (sizes and ints equal to 0 or 1 are specialised by torch, so a call pattern has a few
  programs, not one per shape; `CompiledTarget` lists the target's six). Arguments that must
  stay constant (the captured layer indices) are bound once as attributes of a wrapper module,
  which dynamo treats as constants.

Inductor reads these settings when dynamo hands it a graph, inside a call rather than inside
`torch.compile`, so every call runs under `inductor_config.patch` (a few µs) and the settings
never leak into other compiled code of the process.

A **call pattern** is a path through the forward's Python branches (one start for all rows or
not, one new token or several, logits for all positions or some): each compiles on its first
call, 15-30 s on 2 cores (freezing bypasses inductor's on-disk cache: every process compiles anew).
`warm_up` compiles the ones the engine uses before serving. Numerics are inductor's: the same
math with its own fusion and reduction order, so logits differ from the eager forward by rounding
(exactness tests compare decoding within one forward mode).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from workers.request import COMPILE_CHOICES

INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True}
RECOMPILE_LIMIT = 64  # programs per compiled function (torch's default of 8 is too few)


def resolve_compile(value: bool | str, device: torch.device) -> bool:
    """An engine's `compile` setting as a bool: "auto" is on for CPU devices (where it is
    measured: docs/engine.md, "Compiled decode steps") and off elsewhere."""
    if isinstance(value, bool):
        return value
    if value not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)} (or a bool), got {value!r}")
    return value == "on" or (value == "auto" and torch.device(device).type == "cpu")


class _BoundArgs(nn.Module):
    """`module.<method>(*args, **kwargs, **bound)`: keyword arguments fixed once, as attributes."""

    def __init__(self, module: nn.Module, method: str, bound: dict):
        super().__init__()
        self.module, self.method, self.bound = module, method, bound

    def forward(self, *args, **kwargs):
        return getattr(self.module, self.method)(*args, **kwargs, **self.bound)


def compile_forward(module: nn.Module, method: str = "forward", **bound):
    """A callable equal to `module.<method>(*args, **kwargs, **bound)`, compiled as described
    above. `module` must be in eval mode with frozen weights, and is called without grad. The
    first call runs eagerly: it builds the lazily made tables (RoPE, eps) that the compiled
    programs then read as constants."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config
    from torch._inductor import config as inductor_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    wrapper = _BoundArgs(module, method, bound)
    compiled = torch.compile(wrapper, dynamic=True, fullgraph=True)
    primed = []

    def run(*args, **kwargs):
        if not primed:
            primed.append(True)
            return wrapper(*args, **kwargs)
        # no duck sizing: two sizes equal at the first call (batch 3, 3 new tokens) stay two symbols
        with inductor_config.patch(INDUCTOR_OPTIONS), fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return run


class CompiledTarget:
    """The target forward of a decoding engine, with `capture` bound, its decode steps compiled.

    Same signature and results as `TargetModel.forward(..., capture=capture)` (up to rounding).
    Decode calls fall into six patterns, a program each: one row or several, one new token or
    several, and for several rows one start for all (`start_value`) or per-row starts. Prefills
    (calls with `logits_index`: once per request, long, of any length) run eagerly.

    Per-row starts cost more compiled than one start: at 8 rows, one new token each, 2 threads,
    the compiled forward took 5.9 ms with per-row starts against 3.6 ms with one start (eager:
    6.8 / 6.1 ms): its attention carries a per-row mask, which inductor hands to the eager SDPA
    kernel instead of fusing it."""

    def __init__(self, target: nn.Module, capture: tuple[int, ...]):
        self.target, self.capture = target, capture
        self.compiled = compile_forward(target, capture=capture)

    def __call__(self, input_ids, start, cache, row0, width, logits_index=None, start_value=None):
        if logits_index is not None:
            return self.target(input_ids, start, cache, row0, width, self.capture, logits_index, start_value)
        return self.compiled(input_ids, start, cache, row0, width, start_value=start_value)


def warm_up(engine) -> dict:
    """Run the engine's decode steps on throwaway requests, so that the programs its decoding
    needs (the target forward's patterns, the drafter's pass) are compiled before real requests
    arrive: one row and two, equal and unequal lengths, steps without drafts and with drafts,
    a batch where only some rows draft.
    The engine's decision maker, trace sink and step count are set aside meanwhile. Returns
    {"seconds": ..., "steps": ...}."""
    from workers.decisions import StaticDecisions
    from workers.request import DecodeKnobs, SamplingParams

    t0 = time.perf_counter()
    decisions, sink, step_count = engine.decisions, engine.trace_sink, engine.step_count
    engine.decisions, engine.trace_sink = StaticDecisions(), None
    K, V, steps = engine.block, engine.vocab, 0
    draft_lens = (0,) if K == 0 else (0, K)

    def prompt(n: int, salt: int) -> list[int]:
        return [2 + (7 * i + salt) % (V - 2) for i in range(n)]

    def run(requests: list[tuple[int, int, int]]) -> int:
        """requests: (prompt length, draft length, steps), decoded together to the end."""
        for n, (length, k, s) in enumerate(requests):
            # greedy: draws nothing from the engine's seed sequence (the forward is the same for any sampling)
            engine.add_request(f"__warm_up_{n}", prompt(length, n), SamplingParams(max_tokens=4, ignore_eos=True),
                               DecodeKnobs(steps=s, draft_len=k))
        count = 0
        while engine.has_unfinished():
            engine.step()
            count += 1
        return count

    try:
        several = engine.config.max_batch >= 2
        for k in draft_lens:
            steps += run([(5, k, 1)])
            if several:
                steps += run([(6, k, 1), (9, k, 1)])  # unequal lengths
                steps += run([(7, k, 1), (7, k, 1)])  # equal lengths
        if several and K:  # some rows draft, others do not (the drafting rows' context is gathered)
            steps += run([(6, 0, 1), (9, K, 1)])
            if engine.config.max_batch >= 3:
                steps += run([(6, 0, 1), (9, K, 1), (8, K, 1)])
    finally:
        engine.decisions, engine.trace_sink, engine.step_count = decisions, sink, step_count
    return {"seconds": round(time.perf_counter() - t0, 2), "steps": steps}
