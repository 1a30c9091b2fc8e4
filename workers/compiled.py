"""Compiled forwards: a model's whole forward as one generated C++ program (CPU).

At decode sizes on a CPU every eager op costs a few µs of dispatch whatever its size, and a
forward of the demo target is ~400 of them (docs/cpu-performance.md). `compile_forward`
hands the forward to `torch.compile` with inductor settings that together remove that cost:

- **freezing**: the weights become constants of the program, so inductor packs each linear's
  weight for oneDNN once (what `workers/linear.py` does by hand for the eager path);
- **cpp_wrapper**: the generated program calls its kernels from C++, not from Python;
- **dynamic shapes**: one program serves every batch size, query length, cache width and start
  position (sizes and ints equal to 0 or 1 are specialised by torch, so a call pattern has a few
  programs, not one per shape; `CompiledTarget` lists the target's six). Arguments that must
  stay constant (the captured layer indices) are bound once as attributes of a wrapper module,
  which dynamo treats as constants.

Dynamo and inductor read these settings while they trace and compile, inside a call rather
than inside `torch.compile` (passed as `torch.compile(options=...)`, `freezing` is ignored), so
a call that needs a new program runs under `inductor_config.patch` and the settings never leak
into other compiled code of the process. A call that fits a program compiled before runs under
`set_stance("fail_on_recompile")` instead, without the patches (~50 µs a call).

**Static buffers.** With dynamic shapes every dimension of every input tensor becomes a symbol
that the program guards on and receives as an argument (the C++ wrapper turns each into a tensor,
~4 µs). Buffers whose shapes never change (the KV caches) are marked static (`mark_static`):
at batch 1 that took a decode forward from 1.91 to 1.68 ms, and the stance from 1.68 to 1.57.

**No guards on the modules.** The modules are frozen (their weights are constants of the
programs), so the programs do not guard on module attributes (`guard_filter_fn`), which dynamo
would otherwise check on every call. Programs are then told apart only by their arguments, so no
two compiled functions may share programs: dynamo keeps them per code object, and every compiled
function gets its own copy of the wrapper's code.

A **call pattern** is a path through the forward's Python branches (one start for all rows or
not, one new token or several, logits for all positions or some): each compiles on its first
call, 15-30 s on 2 cores (every process compiles anew: torch's on-disk caches refuse frozen graphs
and cannot store the packed oneDNN weights in them; docs/cpu-performance.md, "Why the compiled programs are not cached across processes").
`warm_up` compiles the ones the engine uses before serving. Numerics are inductor's: the same
math with its own fusion and reduction order, so logits differ from the eager forward by rounding
(exactness tests compare decoding within one forward mode).
"""

from __future__ import annotations

import time
import types

import torch
from torch import nn

INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True}
RECOMPILE_LIMIT = 64  # programs per compiled function (torch's default of 8 is too few)


def mark_static(*tensors: torch.Tensor) -> None:
    """Promise compiled programs that these tensors' shapes never change (buffers allocated once,
    such as KV caches), so their sizes are constants rather than symbolic arguments."""
    import torch._dynamo

    for t in tensors:
        torch._dynamo.mark_static(t)


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
    # dynamo keeps its programs and guards per code object: a copy of `forward`'s code for each
    # wrapper keeps every compiled function's programs apart (without guards on the modules, two
    # wrappers sharing one code object could run each other's programs)
    fn = _BoundArgs.forward
    wrapper.forward = types.MethodType(
        types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), wrapper)
    # the module is frozen: no guards on its attributes (they would be checked on every call)
    compiled = torch.compile(wrapper, dynamic=True, fullgraph=True,
                             options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    primed = []

    def run(*args, **kwargs):
        if not primed:
            primed.append(True)
            return wrapper(*args, **kwargs)
        try:  # a program compiled before fits: run it without the settings (patching costs ~50 µs a call)
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(*args, **kwargs)
        except RuntimeError as err:  # raised before anything ran: no program fits these arguments
            if "fail_on_recompile" not in str(err):
                raise
        # compile a new program. No duck sizing: two sizes equal at the first call (batch 3, 3 new
        # tokens) stay two symbols
        with inductor_config.patch(INDUCTOR_OPTIONS), fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return run


class CompiledTarget:
    """The target forward of a decoding engine, with `capture` bound, its decode steps compiled.

    Same signature and results as `TargetModel.forward(..., capture=capture)` (up to rounding).
    Decode calls fall into six patterns, a program each: one row or several, one new token or
    several, and for several rows one start for all (`start_value`) or per-row starts. Prefills
    (calls with `logits_index`: once per request, long, of any length) run eagerly.

    Per-row starts cost a little more than one start: at 8 rows, one new token each, 2 threads,
    2.35 against 2.19 ms (the per-row K/V writes go into the whole cache tensors, in place:
    `workers.target_model.write_kv`)."""

    def __init__(self, target: nn.Module, capture: tuple[int, ...]):
        self.target, self.capture = target, capture
        self.compiled = compile_forward(target, capture=capture)

    def __call__(self, input_ids, start, cache, row0, width, logits_index=None, start_value=None, packed=None,
                 packed_counts=None):
        if logits_index is not None or packed is not None:  # prefills and packed verification run eagerly
            return self.target(input_ids, start, cache, row0, width, self.capture, logits_index, start_value,
                               packed=packed, packed_counts=packed_counts)
        return self.compiled(input_ids, start, cache, row0, width, start_value=start_value)


def warm_up(engine) -> dict:
    """Run the engine's decode steps on throwaway requests, so that the programs its decoding
    needs (the target forward's patterns, the drafter's pass) are compiled before real requests
    arrive: one row and two, equal and unequal lengths, steps without drafts and with drafts,
    a batch where only some rows draft, rows that start drafting after steps without.
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

    def run(requests: list[tuple[int, int, int]], draft_from: int = 0) -> int:
        """requests: (prompt length, draft length, steps), decoded together to the end. With
        `draft_from`, every row decodes without drafts until that step, then drafts: its first
        drafting step writes the drafter context of several stashed positions at once."""
        names = [f"__warm_up_{n}" for n in range(len(requests))]
        for n, (length, k, s) in enumerate(requests):
            # greedy: draws nothing from the engine's seed sequence (the forward is the same for any sampling)
            engine.add_request(names[n], prompt(length, n), SamplingParams(max_tokens=4 + draft_from, ignore_eos=True),
                               DecodeKnobs(steps=s, draft_len=0 if draft_from else k))
        count = 0
        while engine.has_unfinished():
            if draft_from and count == draft_from:
                for name, (_, k, s) in zip(names, requests):
                    if name in engine.requests:
                        engine.set_knobs(name, DecodeKnobs(steps=s, draft_len=k))
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
        if K:  # rows start drafting after steps without: context of several positions, one start or per row
            steps += run([(5, K, 1)], draft_from=3)
            if several:
                steps += run([(6, K, 1), (9, K, 1)], draft_from=3)
                steps += run([(7, K, 1), (7, K, 1)], draft_from=3)
    finally:
        engine.decisions, engine.trace_sink, engine.step_count = decisions, sink, step_count
    return {"seconds": round(time.perf_counter() - t0, 2), "steps": steps}
