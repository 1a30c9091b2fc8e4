"""How many torch operations a decode step runs on the host, per phase of the step and per line.

On this CPU a step's host time (everything but the target's and the drafter's compiled programs)
is about proportional to the small torch operations it runs: right after a model-sized forward
each costs ~5 µs instead of ~2 in a loop (its caches cold), and a faster operation saves
little of that; running fewer of them is what shortens the step. This script serves one live run
of the mixed workload (the `adapt bench ab` scenario) with one policy, counts every
operation dispatched during its decode steps (a `TorchDispatchMode`; views and `.item()` count
too) and attributes it to the phase of the step it ran in (the decision maker's calls, drafting,
verification and its host read, the row state, the step batch, the rest of the step) and, with
``--lines``, to the line of our code that called it. The phase is read off the Python stack at
each operation (the innermost frame of one of the calls in `PHASES`); nothing of the engine or
the policy is wrapped, and decode steps are counted by an observer (`Engine.observers`). Printed and written to ``--out``: operations
per decode step by phase, and the top lines. Counting slows the run, so its timings are not
reported; time a change with `adapt bench ab`. The engine reads a clock that advances
``--tick-ms`` per reading instead of the wall clock, and the policy prices steps by its policy
file's cost tables rather than a start-up profile (``--profile``), so that the run's decisions
(which read step times, lateness and costs) do not depend on the machine or on the counting's own
slowness: two versions of the code count the same steps. For the same reason the adaptive policy holds every plain decision it makes
(``hold_share`` 0: the default compares the decision's own CPU time with a step's, which varies
from run to run; on SmolLM2 at one request it held them all anyway). Example:

    python -m adapt.bench.instruments.host_ops --pair smollm2 --policy adaptive --load 1 --lines 40 --out runs/host-ops.json

``--setting KEY=VALUE`` sets an adaptive-policy setting over the policy file's (e.g.
``span_headroom=2``, to count what a setting's decisions cost).
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository

# (attribute path on the engine, method, phase): the calls whose operations each phase counts
# (an operation counts in the phase of the innermost of these calls on its stack; the target's
# forward counts as "target_forward", a prefill's operations as "prefill")
PHASES = (
    ("decisions", "before_draft", "decide.before_draft"),
    ("decisions", "after_draft", "decide.after_draft"),
    ("decisions", "observe", "decide.observe"),
    ("verifier", "verify", "verify"),
    ("verifier", "commit", "verify.commit"),
    ("verifier", "sample_next", "verify.sample_next"),
    ("drafting", "draft", "draft"),
    ("drafting", "stash", "draft.context"),
    ("drafting", "flush", "draft.context"),
    ("", "_row_state", "row_state"),
    ("", "_batch", "step_batch"),
    ("", "_conclude", "conclude"),
    ("", "_prefill", "prefill"),
)
# phases left out of the per-step counts: prefills, and this instrument's own observer (its digest
# reads the step record's tensors inside the engine's `_conclude`)
LEFT_OUT = ("prefill", "instrument")


class OpCounter:
    """Counts the torch operations dispatched while it is entered, by phase (``codes``: the
    innermost call of a phase on the operation's stack, ``"step"`` outside them; a `LEFT_OUT`
    phase anywhere on the stack wins) and, with ``lines``, by the line of our code that ran them."""

    def __init__(self, codes: dict, lines: bool):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.codes = codes
        self.by_phase: collections.Counter = collections.Counter()
        self.by_line: collections.Counter = collections.Counter()
        self.lines = lines

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.count()
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def phase_of(self, frame) -> str:
        """The phase of an operation called from ``frame`` (walking out to the stack's root)."""
        phase = None
        while frame is not None:
            found = self.codes.get(frame.f_code)
            if found in LEFT_OUT:
                return found
            if phase is None:
                phase = found
            frame = frame.f_back
        return phase or "step"

    def count(self) -> None:
        frame = sys._getframe(2)
        phase = self.phase_of(frame)
        self.by_phase[phase] += 1
        if self.lines:
            while frame is not None and (not frame.f_code.co_filename.startswith(str(ROOT))
                                         or "/.venv/" in frame.f_code.co_filename):
                frame = frame.f_back
            if frame is not None:
                path = Path(frame.f_code.co_filename).relative_to(ROOT)
                self.by_line[f"{phase} {path}:{frame.f_lineno} {frame.f_code.co_name}"] += 1


def _code(fn):
    """The code object a call of ``fn`` runs (decorators unwrapped), or None."""
    fn = inspect.unwrap(fn) if fn is not None else None
    return getattr(fn, "__code__", None)


def phase_codes(engine) -> dict:
    """{code object: phase} of `PHASES` as ``engine`` (its decision maker, verifier and drafter
    context as they are now) runs them, and of the target's forward (``"target_forward"``)."""
    codes = {}
    for owner, name, phase in PHASES:
        obj = getattr(engine, owner) if owner else engine
        code = _code(getattr(type(obj), name, None)) if obj is not None else None
        if code is not None:
            codes[code] = phase
    forward = engine.target_forward
    target = forward.func if isinstance(forward, functools.partial) else forward
    code = _code(getattr(type(target), "forward" if hasattr(type(target), "forward") else "__call__", None))
    if code is not None:
        codes[code] = "target_forward"
    return codes


class StepDigest:
    """An engine observer: counts decode steps and digests what each decided and accepted (the
    applied intent's sources and diffusion steps, the plan's draft lengths and rules, the
    accepted drafts per row); two versions of the code that decide alike write the same digest.
    The emitted tokens are not in a `StepRecord`, so they are not digested."""

    def __init__(self):
        self.steps = 0
        self.sha = hashlib.sha1()

    def on_step(self, record) -> None:
        self.steps += 1
        plan, intent = record.plan, record.intent
        self.sha.update(repr((intent.source.tolist(), intent.steps.tolist(), plan.draft_len_host if plan else None,
                              plan.rule_host if plan else None, record.outcome.accepted.tolist())).encode())

    def on_prefill(self, seconds: float, rows: int) -> None:
        return None

    def hexdigest(self) -> str:
        return self.sha.hexdigest()[:16]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--policy", default="adaptive", help="adaptive, or a baseline of `adapt bench policies` (ar, suffix, ...)")
    p.add_argument("--load", type=int, default=1)
    p.add_argument("--requests", type=int, default=12, help="requests served while counting")
    p.add_argument("--instance", type=int, default=0, help="the scenario instance (adapt.bench.interleave.scenario_instance)")
    p.add_argument("--compile", default="aot", choices=("off", "aot"))
    p.add_argument("--profile", action="store_true",
                   help="price steps by a start-up profile of the engine (as the benchmarks do; the counts then vary run to run)")
    p.add_argument("--tick-ms", type=float, default=5.0, help="what the engine's clock advances per reading")
    p.add_argument("--lines", type=int, default=0, help="print the top N lines of our code by operations")
    p.add_argument("--setting", action="append", default=[],
                   help="KEY=VALUE (JSON value): an adaptive-policy setting over the policy file's, e.g. span_headroom=2")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from adapt.bench.settings_text import parse_settings

    try:
        settings = parse_settings(args.setting)
    except ValueError as e:
        p.error(str(e))

    import torch

    from adapt.bench import write_json
    from adapt.bench.interleave import scenario_instance
    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.controller import build_policy, profile_engine
    from adapt.policy_file import load
    from adapt.bench.evaluation import evaluation_mix
    from adapt.replay import Scenario

    torch.set_num_threads(2)
    engine, prompts = workload_engine(args.pair, "mixed", args.load, 97, compile=args.compile)
    engine.clock = TickClock(args.tick_ms / 1e3)
    pf = load(str(ROOT / "models" / args.pair / "policy.json"))
    if args.profile:  # the machine's step costs now (else the policy file's: a repeatable run)
        pf.cost = profile_engine(engine)
    K = engine.block
    mix = evaluation_mix(pf.cost, K, max(24, 2 * args.load))
    grid = tuple(pf.settings.get("steps_grid", (1,)))
    # hold_share 0: a plain decision is held whatever the decision's own CPU time (which the share
    # test reads, and which varies from run to run)
    policy = (build_policy("adaptive", pf, steps_grid=grid, hold_share=0.0, **settings) if args.policy == "adaptive"
              else make_policy(args.policy, pf, steps_grid=(1,), width=K))
    served, seed = scenario_instance(prompts, args.instance, len(mix))
    run_live(engine, policy, Scenario("warm", min(args.load, 4), mix[:4]), served, seed=seed)

    counter = OpCounter({**phase_codes(engine), StepDigest.on_step.__code__: "instrument"}, lines=args.lines > 0)
    digest = StepDigest()
    engine.observers.append(digest)
    try:
        with counter.mode:
            run_live(engine, policy, Scenario("mix", args.load, mix[: args.requests]), served, seed=seed)
    finally:
        engine.observers.remove(digest)
    n = max(digest.steps, 1)
    per_phase = {k: round(v / n, 1) for k, v in counter.by_phase.most_common() if k not in LEFT_OUT}
    host = sum(v for k, v in per_phase.items() if k != "target_forward")
    print(f"{args.policy} at load {args.load}: {n} decode steps, {host:.0f} host operations per step, "
          f"decisions digest {digest.hexdigest()}")
    for k, v in per_phase.items():
        print(f"  {k:22s} {v:7.1f}")
    top = [(round(v / n, 2), k) for k, v in counter.by_line.most_common(args.lines)]
    for v, k in top:
        print(f"  {v:6.2f}  {k}")
    if args.out:
        write_json(args.out, {"policy": args.policy, "load": args.load, "pair": args.pair, "decode_steps": n,
                              "decisions_digest": digest.hexdigest(), "host_ops_per_step": round(host, 1),
                              "ops_per_step": per_phase, "top_lines": top})
    return 0


class TickClock:
    """A clock (seconds) that advances ``tick`` at every reading: a repeatable run."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


if __name__ == "__main__":
    sys.exit(main())
