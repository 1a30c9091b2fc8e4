"""The decoder engine: continuous batching of speculative-diffusion decoding (contracts §4).

Words used here (see also workers/decisions.py):
- **slot**: a row of the KV caches owned by one running request. Running requests always occupy
  slots `0 .. n-1` in order (`running[i]` owns slot i), so batched calls use plain cache views.
- **committed length L**: tokens whose K/V are in the target cache (and whose target hidden
  states are in the drafter's context cache). The **anchor** (last emitted token) sits at L.
- **step**: one `Engine.step()`: one decode step over all running rows, then the prefill of newly
  added requests (their first token comes from the target). A decode step builds one frozen
  `StepBatch` (workers/step_batch.py) and hands it to every part:
  (1) the decision maker's intent (`before_draft`: a draft source and diffusion steps `s` per
  row), the requests' pins applied; (2) drafting (workers/drafting.py `draft_step`): each source
  proposes for its rows (workers/draft_sources.py): the drafter denoises `[anchor, MASK x span]`
  for diffusion rows, all batched, s_max passes, and suffix rows take their suffix drafts;
  (3) draft length `k` and acceptance rule per row (`after_draft`), the batch's `StepPlan` with
  its ragged layout; (4) one target forward over `[anchor, x_1..x_k]` per row (padded to max
  k + 1; on CPU packed to each row's own positions) and verification (workers/verification.py);
  (5) the one host read, then commit and traces (workers/commit.py): lengths += accepted + 1
  (rollback is just not advancing), the target hidden states of the new positions are stashed
  for the drafter context; the decision maker's `observe` and the engine's `observers` get the
  step's `StepRecord` (workers/step_record.py).

This module keeps the engine's requests, slots and the order of a step; the parts named above
own their own state (drafter context cache, acceptance counters).

Randomness: each sampled request draws from its own `torch.Generator` (seeded by
`SamplingParams.seed`), and draws only what its own row needs, so a seeded request's output does
not depend on the rest of the batch.
"""


from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kernels import RaggedLayout, Rule
from kernels.rules import enforce_rules, exact_rules
from workers.admission import ADMISSION_MODES, RowClock, Waiting, admit_count
from workers.backends import resolve_backend
from workers.commit import advance, emit, remaining, request_stats, trace_record
from workers.compiled import CompiledTarget, compile_forward, mark_static, warm_up
from workers import draft_sources
from workers.decisions import DecisionMaker, DraftFeatures, DraftIntent, RowState, StaticDecisions, StepOutcome
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE
from workers.decode_log import DecodeLog
from workers.drafting import PENDING_WINDOW, DrafterContext, StepDrafts, draft_step
from workers.huge_pages import back_with_huge_pages
from workers.linear import WIDE_ROWS, prepare_for_inference
from workers.pins import StepPins, clamp_to_block, pin_clamp, row_pins
from workers.request import DecodeKnobs, EngineInputError, PromptTooLongError, RequestOutput, SamplingParams
from workers.sampling import probabilities
from workers.step_batch import RequestState, StepBatch, StepPlan, StepResult, common_value, sampling_tensors
from workers.step_record import StepObserver, StepRecord
from workers.suffix import SuffixConfig, SuffixDrafter
from workers.target_model import load_target, resolve_dtype
from workers.verification import AcceptCounters, Verifier, next_tokens

__all__ = ["DEMO_DRAFTER", "DEMO_TARGET", "PENDING_WINDOW", "SUFFIX_WIDTH", "Engine", "EngineConfig"]

SUFFIX_WIDTH = 16    # the longest suffix draft of an engine without a drafter (else the drafter's K)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models" / "demo" / "target"
DEMO_DRAFTER = REPO_ROOT / "models" / "demo" / "drafter"


@dataclass
class EngineConfig:
    """target / drafter: local model directories (drafter None = autoregressive only);
    dtype: auto | float32 | bfloat16 | float16; device: auto | cpu | cuda[:i];
    max_batch: running requests at once; max_len: prompt + generated tokens per request;
    shape_aware_linear: on CPU, run the bf16/fp16 target's and drafter's matmuls through packed
    oneDNN weights, the smallest through fp32 copies (workers/linear.py; ignored on GPUs and in
    fp32; False = plain `F.linear`); wide_fp32: with shape-aware linears, on a CPU without native
    bf16/fp16 matmuls (AVX2 only), run matmuls of `WIDE_ROWS` or more tokens (prefill, wide
    verifies, batches of 10+) through fp32 copies of the weights, ~4x faster for prefill at the
    price of an fp32 copy of the weights in memory (workers/linear.py; no effect elsewhere);
    wide_rows: from how many tokens a matmul is wide: "auto" = each weight shape's crossover of
    the two paths, timed at start-up (workers/wide_rows.py: ~4 s on SmolLM2, once per machine,
    kept in the cache directory; `Engine.wide_table` holds the answer), or one int for every
    layer (`WIDE_ROWS` = 10 was the constant before);
    compile: the step backend (workers/backends.py, `Engine.backend`): "off" (or False) = eager;
    "on" (or True) = the target's decode forwards and the drafter's denoising pass as
    torch.compile programs (workers/compiled.py; call `warm_up()` before serving, or the first
    steps of each kind compile on the spot); "aot" = the target's decode forwards (and the
    drafter's passes) from ahead-of-time compiled packages in the cache directory (workers/aot.py:
    loaded in about a second; `Engine.backend.info` says which); "auto" = "aot" that never builds:
    the packages when built, else eager steps (the default of `adapt generate` and `adapt serve`);
    aot_build: with "aot", build the package when it is missing (minutes, once per machine and
    engine shape), else decode eagerly when it is missing (what "auto" does, so that
    `adapt compile` once makes `adapt serve` and `adapt generate` faster); aot_pad: with "aot" on a
    CPU, measure at load whether decode calls of very few tokens run faster padded to a few more
    (`AotTarget.calibrate_padding`, ~1.5 s; `backend.info["pad"]`) and pad those that do (off by
    default: faster steps at one row, but the adaptive policy's choices at 2 and 8 rows lost ~7 %
    with it, docs/engine.md); aot_one_row: with "aot", run calls of one row and a few tokens on a
    one-row program (`workers.aot.aot_one_row`: inductor's GEMM template timed against oneDNN;
    bf16 on CPUs with native bf16 matmuls) for the token counts where it measured faster than the
    decode package, once, when it was built; aot_draft_subsets: with "aot", drafter passes over a subset of the
    batch's rows (some rows draft by diffusion, others copy or decode plainly) of at most this
    many rows run the drafter's package over their slots or a scratch copy of their context
    (`DrafterContext.subset_kv`) instead of the eager pass: ~0.7–1.9 ms faster a pass on SmolLM2,
    but **0 (eager) by default**: with cheaper passes the adaptive policy drafted at 8 requests,
    where drafting loses on a CPU, and measured 0.94–0.99x `ar` there against ~1.0x
    (docs/benchmarks.md); suffix:
    keep a suffix drafter (workers/suffix.py) so that rows may draft from text already seen
    (knobs source 'suffix', or a decision maker's suffix intent);
    suffix_global_tokens: how many tokens of finished requests' outputs it remembers for other
    requests' drafts (0 = only a request's own text: no request's speed then depends on what
    another request generated); pack: "auto" | "on" | "off" or a bool: verification forwards run
    their projections, MLPs and LM head only on the positions rows really verify (each row's
    anchor and k_r drafts) instead of the batch padded to its longest row (`TargetModel.forward`'s
    `packed`); auto = on for eager CPU engines, where the forward is compute-bound and padding
    costs as much as real positions (`StepBackend.packs_verify`: off for compiled programs and
    packages, which are padded);
    prefills of prompts of unequal lengths are packed the same way (`Engine.pack_prefill`): auto =
    on for every CPU engine, whatever its step backend, since prefills always run the eager forward
    (8 held-out chat prompts, 46-257 tokens, SmolLM2 bf16, 2 threads: 0.83 s packed against 1.7 s
    padded to the longest); admission: "all" | "sla",
    which waiting requests a step prefills (workers/admission.py: "all" = every one there is a
    slot for; "sla" = defer them while their prefill would push a running row off its TPOT
    target, each for at most admission_max_wait_ms or its TTFT target); draft_temperature_scale:
    the drafter draws a sampled row's draft at the row's temperature times this (1 = the row's
    own; below 1 sharpens the drafter's distribution q towards its likeliest tokens). Exactness
    does not depend on it: rejection sampling is exact for whatever q a draft was drawn from, and
    acceptance reads that q (workers/drafting.py `denoise`); only how many drafts the target
    accepts does (on SmolLM2 no scale was a clear gain: docs/engine.md); huge_pages: on a CPU, once
    loaded, move the process's large memory regions (weights, packages' constants, caches) onto
    huge pages (workers/huge_pages.py: ~3 s for SmolLM2 with packages, then ~1.1x faster decoding;
    `Engine.huge_pages` says what was done)."""

    target: str | Path = DEMO_TARGET
    drafter: str | Path | None = DEMO_DRAFTER
    dtype: str = "auto"
    device: str = "auto"
    max_batch: int = 64
    max_len: int = 1024
    seed: int = 0  # seeds the generators of requests that bring no seed
    shape_aware_linear: bool = True
    wide_fp32: bool = True
    wide_rows: int | Literal["auto"] = "auto"
    compile: bool | str = False
    aot_build: bool = True
    aot_pad: bool = False
    aot_one_row: bool = True
    aot_draft_subsets: int = 0
    suffix: bool = True
    suffix_global_tokens: int = 1 << 16
    pack: bool | str = "auto"
    admission: str = "all"
    admission_max_wait_ms: float = 1000.0
    draft_temperature_scale: float = 1.0
    huge_pages: bool = True



class Engine:
    """Continuous batching of speculative-diffusion decoding (see the module docstring):
    `add_request`, then `step()` until `has_unfinished()` is False; `abort` stops a request."""

    def __init__(self, config: EngineConfig, decisions: DecisionMaker | None = None, trace_sink=None):
        self.config = config
        if config.max_batch < 1:
            raise EngineInputError(f"max_batch must be >= 1, got {config.max_batch}")
        if not 0.0 < config.draft_temperature_scale <= 4.0:
            raise EngineInputError("draft_temperature_scale must be in (0, 4], got "
                                   f"{config.draft_temperature_scale}")
        if isinstance(config.aot_draft_subsets, bool) or not isinstance(config.aot_draft_subsets, int) \
                or config.aot_draft_subsets < 0:
            raise EngineInputError(f"aot_draft_subsets must be an int >= 0, got {config.aot_draft_subsets!r}")
        dev = config.device
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if dev == "auto" else dev)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # how the decode steps run and what that allows (workers/backends.py); an "aot" backend
        # whose target package is missing becomes eager in `_load_aot`
        self.backend = resolve_backend(config.compile, self.device, build=config.aot_build)
        if config.admission not in ADMISSION_MODES:
            raise EngineInputError(f"admission must be one of {', '.join(ADMISSION_MODES)}, got {config.admission!r}")
        if not config.admission_max_wait_ms >= 0:
            raise EngineInputError(f"admission_max_wait_ms must be >= 0, got {config.admission_max_wait_ms}")
        self.admission = config.admission  # may be switched between runs (benchmarks)
        # seconds (monotonic) for every time the engine takes: arrivals, first tokens, step and
        # prefill times, the rows' decode time; a benchmark may swap in a clock that runs only
        # while this engine steps (adapt/bench/interleave.py)
        self.clock = time.perf_counter
        if config.pack not in (True, False, "auto", "on", "off"):
            raise EngineInputError(f"pack must be auto, on or off, got {config.pack!r}")
        auto_wide = config.wide_rows == "auto"
        if not auto_wide and not (isinstance(config.wide_rows, int) and not isinstance(config.wide_rows, bool)
                                  and config.wide_rows >= 1):
            raise EngineInputError(f"wide_rows must be 'auto' or an int >= 1, got {config.wide_rows!r}")
        wide_rows = (WIDE_ROWS if auto_wide else config.wide_rows) if config.wide_fp32 else None
        self.target = load_target(config.target, self.dtype, self.device, shape_aware=config.shape_aware_linear,
                                  wide_rows=wide_rows)
        tcfg = self.target.config
        self.vocab = tcfg.vocab_size
        self.max_len = min(config.max_len, tcfg.max_position)
        if self.max_len < 2:
            raise EngineInputError(f"max_len must be >= 2, got {config.max_len}")
        self.drafter = None
        self.block = 0
        self.capture: tuple[int, ...] = ()
        if config.drafter is not None:
            from workers.drafter import load_drafter

            path = Path(config.drafter)
            if not (path / "config.json").is_file():
                raise EngineInputError(f"drafter directory {str(path)!r} does not exist or has no config.json")
            self.drafter = load_drafter(path, tcfg.hf_config, device=self.device, dtype=self.dtype)
            prepare_for_inference(self.drafter, shape_aware=config.shape_aware_linear, wide_rows=wide_rows)
            self.drafter.bind(self.target.model.embed_tokens, self.target.lm_head).eval().requires_grad_(False)
            self.block = self.drafter.config.block_size
            self.capture = tuple(self.drafter.config.target_layer_ids)
        # {(out, in): rows} of the weight shapes whose wide threshold was timed here (empty where
        # no matmul takes the wide fp32 path: fp32 weights, a GPU, a CPU with native bf16)
        self.wide_table: dict[tuple[int, int], int] = {}
        if auto_wide and wide_rows is not None and self.backend.times_wide_rows:
            from workers.wide_rows import calibrate_wide_rows

            heads = [] if self.drafter is None or self.drafter.draft_head is None else [self.drafter.draft_head]
            self.wide_table = calibrate_wide_rows(self.target, *([self.drafter] if self.drafter else []), *heads)
        # the widest draft verified: the drafter's block, or the suffix drafter's cap without one
        self.width = self.block or (SUFFIX_WIDTH if config.suffix else 0)
        self.suffix = (SuffixDrafter(SuffixConfig(max_draft=self.width, global_tokens=config.suffix_global_tokens))
                       if config.suffix else None)
        cap = self.max_len + self.width + 1  # room for speculative writes past max_len
        self.tcache = self.target.new_cache(config.max_batch, cap)
        # target_forward(ids, start, cache, row0, width, logits_index=None, start_value=None):
        # the target's forward with this engine's captured layers, run by the step backend
        self.target_forward = functools.partial(self.target, capture=self.capture)
        if self.backend.name == "compiled":
            self.target_forward = CompiledTarget(self.target, self.capture)
        elif self.backend.name == "aot":  # decode calls up to the widest verify (anchor + drafts) run the package
            self._load_aot()
        # packed verification: eager CPU engines only (compiled programs and packages are padded);
        # packed prefills: every CPU engine (prefills run the eager forward on every backend)
        self.pack = config.pack in (True, "on") or (config.pack == "auto" and self.backend.packs_verify)
        self.pack_prefill = config.pack in (True, "on") or (config.pack == "auto" and self.device.type == "cpu")
        self.drafting = None  # the drafter context cache and the denoising loop (workers/drafting.py)
        if self.drafter is not None:
            # draft_pass(tokens, masked, ctx_kv, mask, cos, sin): one denoising pass (`block_logits`);
            # context_kv(hidden, positions): the drafter-context K/V of stashed target hidden states
            draft_pass = self.drafter.block_logits
            context_kv = functools.partial(self.drafter.context_kv, bound=cap)
            if self.backend.name == "compiled":
                draft_pass = compile_forward(self.drafter, "block_logits")
                context_kv = compile_forward(self.drafter, "context_kv", bound=cap)
            self.drafting = DrafterContext(self.drafter, context_kv, draft_pass, config.max_batch, cap,
                                           len(self.capture) * tcfg.hidden_size, self.dtype, self.device,
                                           temperature_scale=config.draft_temperature_scale,
                                           subset_rows=config.aot_draft_subsets)
            if self.backend.name == "aot":  # the denoising passes over every row from the drafter's package
                self._load_aot_drafter()
        if self.backend.needs_warm_up:  # the buffers' shapes are constants of the compiled programs
            mark_static(*self.tcache.k, *self.tcache.v)
            if self.drafting is not None:
                mark_static(*self.dcache.k, *self.dcache.v)
        self.verifier = Verifier(AcceptCounters(config.max_batch, self.width, self.device), self.device)
        self.decisions = decisions or StaticDecisions()
        self.trace_sink = trace_sink
        # told of every decode step (`StepRecord`) and prefill, after the decision maker
        # (workers/step_record.py): how benchmarks and instruments see steps
        self.observers: list[StepObserver] = []
        # synchronise CUDA at each phase boundary of a decode step, so that `StepRecord.times`
        # are the phases' device times (an observer that needs them sets it; costs overlap)
        self.sync_phases = False
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0
        self.prefill_seconds = 0.0  # wall time spent in prefills so far (running rows wait meanwhile)
        self.prefill_ms_per_token: float | None = None  # running average over this engine's prefills
        self.deferred_steps = 0  # steps that left a waiting request waiting although a slot was free
        # the caller's promise that no request joins until every running one has finished (an
        # offline batch, e.g. a group of `adapt bench speed`); a server never sets it. With nothing
        # waiting either, a slot freed early stays empty: `RowState.closed`
        self.closed = False
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._tokenizer = None
        # the weights onto huge pages, last, once everything large is allocated (workers/huge_pages.py)
        self.huge_pages = back_with_huge_pages() if config.huge_pages and self.device.type == "cpu" else None

    def _load_aot(self) -> None:
        """The target's decode forward from its compiled package (workers/aot.py), built first when
        missing if the backend `builds`; else, when missing, eager decoding (and a hint how to
        build it): the backend becomes eager."""
        from workers.aot import aot_one_row, aot_target, offers_one_row

        log = logging.getLogger(__name__)
        try:
            self.target_forward, info = aot_target(self.target, self.capture, self.tcache, self.width + 1,
                                                   build=self.backend.builds, log=log.warning)
            if self.config.aot_one_row and offers_one_row(self.dtype, self.device):
                try:  # one-row calls of few tokens on a program of their own, where measured faster
                    info["one_row"] = aot_one_row(self.target_forward, info["weights"], build=self.backend.builds,
                                                  log=log.warning)
                except FileNotFoundError as err:
                    log.info("one-row steps on the decode package: %s", err)
            if self.device.type == "cpu" and self.config.aot_pad:  # few-token calls run padded where faster
                info["pad"] = self.target_forward.calibrate_padding()
            self.backend = dataclasses.replace(self.backend, info=info)
        except FileNotFoundError as err:
            log.info("eager decode steps: %s", err)
            self.backend = resolve_backend("off", self.device)

    def _load_aot_drafter(self) -> None:
        """The drafter's denoising pass and its context commit from their compiled packages
        (`backend.info["drafter"]`, `backend.info["context"]`), built first when missing if the
        backend `builds`; else, when missing, eager passes / commits."""
        from workers.aot import aot_context_write, aot_draft_pass

        log = logging.getLogger(__name__)
        d, build, info = self.drafting, self.backend.builds, dict(self.backend.info)
        try:
            d.program, info["drafter"] = aot_draft_pass(self.drafter, d.cache, self.block + 1, build=build,
                                                        log=log.warning)
        except FileNotFoundError as err:
            log.info("eager drafter passes: %s", err)
        try:
            d.writer, info["context"] = aot_context_write(self.drafter, d.cache, PENDING_WINDOW, d.pending.shape[-1],
                                                          d.pending.dtype, build=build, log=log.warning)
        except FileNotFoundError as err:
            log.info("eager drafter-context commits: %s", err)
        self.backend = dataclasses.replace(self.backend, info=info)

    @property
    def dcache(self):
        """The drafter-context KV cache (None without a drafter)."""
        return None if self.drafting is None else self.drafting.cache

    @property
    def pending(self):
        """[max_batch, PENDING_WINDOW, width] target hidden states not yet in the drafter context."""
        return None if self.drafting is None else self.drafting.pending

    def warm_up(self) -> dict:
        """Compile every call pattern of the compiled forward now, on throwaway requests
        (`workers.compiled.warm_up`); a no-op unless the step backend `needs_warm_up`. Call before
        serving."""
        if not self.backend.needs_warm_up:
            return {"seconds": 0.0, "steps": 0}
        if self.running or self.waiting:
            raise EngineInputError("warm_up: the engine has requests; warm up before adding any")
        return warm_up(self)

    # -- requests -----------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            path = Path(self.config.target)
            if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
                raise EngineInputError(f"prompt: text prompts need a tokenizer, and {path} has none (pass token ids)")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        return self._tokenizer

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a request unless it ignores EOS: the target config's `eos_token_id`s and
        its tokenizer's EOS (when the directory has a tokenizer; the two may differ)."""
        ids = list(self.target.config.eos_token_ids)
        path = Path(self.config.target)
        if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
            eos = self.tokenizer.eos_token_id
            if isinstance(eos, int) and 0 <= eos < self.vocab:
                ids.append(eos)
        return tuple(dict.fromkeys(ids))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    knobs: DecodeKnobs | None = None, targets: object = None) -> None:
        """Queue a request; it is prefilled at the next `step()`. Raises `EngineInputError`
        (a ValueError) naming the bad field; the engine state is untouched then."""
        params = params or SamplingParams()
        knobs = knobs or DecodeKnobs(draft_len=self.block)
        if not isinstance(request_id, str) or not request_id:
            raise EngineInputError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise EngineInputError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise EngineInputError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(knobs, DecodeKnobs):
            raise EngineInputError(f"knobs must be DecodeKnobs, got {type(knobs).__name__}")
        knobs, clamped = clamp_to_block(knobs, self.block, self.width)
        self._check_knobs(knobs)
        if isinstance(prompt, str):
            if not prompt:
                raise EngineInputError("prompt must not be empty")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise EngineInputError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise EngineInputError(f"prompt token ids must lie in [0, {self.vocab}), got {bad[:3]}")
        if len(ids) >= self.max_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens, but the context holds {self.max_len} (max_len) including at least one generated token")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab]
        if bad:
            raise EngineInputError(f"stop_token_ids must lie in [0, {self.vocab}), got {bad}")
        stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        gen = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        pins = row_pins(knobs, clamped)
        req = RequestState(request_id, ids, params, knobs, targets, tuple(dict.fromkeys(stops)), gen,
                           t_arrive=self.clock(), pins=pins, log=DecodeLog(pins.shown, clamped))
        if self.suffix is not None:
            req.suffix_index = self.suffix.new_index(ids)
        self.requests[request_id] = req
        self.waiting.append(req)

    def _check_knobs(self, knobs: DecodeKnobs) -> None:
        if knobs.source == "none":
            return
        source = draft_sources.by_name(knobs.source)
        if source.point_mass:  # a copy-like source (workers/draft_sources.py)
            width = source.width(self)
            if width == 0:
                raise EngineInputError(f"source = {knobs.source!r} needs {source.needs}")
            if knobs.draft_len > width:
                raise EngineInputError(f"draft_len = {knobs.draft_len} exceeds the longest {knobs.source} draft {width}")
            return
        if knobs.draft_len > 0 and knobs.steps > 0:
            if self.drafter is None:
                raise EngineInputError(f"draft_len = {knobs.draft_len} needs a drafter, and this engine has none (use draft_len 0)")
            if knobs.draft_len > self.block:
                raise EngineInputError(f"draft_len = {knobs.draft_len} exceeds the drafter's block size {self.block}")
            if knobs.steps > self.block:
                raise EngineInputError(f"steps = {knobs.steps} exceeds the drafter's block size {self.block}")

    def set_knobs(self, request_id: str, knobs: DecodeKnobs) -> None:
        """Change a request's static knobs (and pins); they apply from the next step."""
        knobs, clamped = clamp_to_block(knobs, self.block, self.width)
        self._check_knobs(knobs)
        req = self.requests[request_id]
        req.knobs, req.pins = knobs, row_pins(knobs, clamped)
        req.log.pins = dict(req.pins.shown)
        req.log.clamps["block"] += clamped

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its cache slot. Returns its final output (finish_reason
        'abort'), or None if the id is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._release([self.running.index(req)])
        return RequestOutput(request_id, [], True, "abort", request_stats(req))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_slots(self) -> int:
        return self.config.max_batch - len(self.running)

    # -- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Decode one step for every running request, then prefill waiting ones (up to free
        slots). Returns the outputs of requests that received tokens."""
        outputs = self._decode() if self.running else []
        if self.waiting and self.free_slots:
            outputs += self._prefill()
        return outputs

    def _prefill(self) -> list[RequestOutput]:
        """Prefill waiting requests (as many as there are free slots and the admission lets in:
        `_admit`) in one target forward and sample their first tokens. With packing
        (`pack_prefill`), prompts of unequal lengths run the projections, MLPs and LM head on
        their own tokens only, not padded to the longest prompt (padding doubles the tokens of a
        mixed chat / code / edit batch)."""
        take = self._admit()
        if take == 0:
            self.deferred_steps += 1
            return []
        new = [self.waiting.popleft() for _ in range(take)]
        t0 = self.clock()
        dev, m, row0 = self.device, len(new), len(self.running)
        P = max(len(r.prompt) for r in new)
        ids = torch.tensor([r.prompt + [0] * (P - len(r.prompt)) for r in new], device=dev)  # [m, P]
        lens_host = [len(r.prompt) for r in new]
        lens = torch.tensor(lens_host, device=dev)
        zero = torch.zeros(m, dtype=torch.long, device=dev)
        pack = {}
        if self.pack_prefill and sum(lens_host) < m * P:  # prompts of unequal lengths: no padded positions
            real = torch.arange(P) < torch.tensor(lens_host)[:, None]                  # [m, P] host: no device sync
            pack = {"packed": real.view(-1).nonzero().view(-1).to(dev), "packed_counts": lens_host}  # [sum lens]
        logits, hidden = self.target_forward(ids, zero, self.tcache, row0, P, logits_index=(lens - 1)[:, None],
                                             start_value=0, **pack)
        if self.drafting is not None:
            self.drafting.write_prompt(hidden, row0)
        temp, top_k, top_p = sampling_tensors(new, dev)
        probs = probabilities(logits[:, 0], temp, top_k, top_p)  # [m, V]
        first = next_tokens(probs, new, dev)
        self.verifier.counters.reset(row0, m)
        tokens = first.tolist()  # the prefill's one host sync
        now = self.clock()
        outputs, done = [], []
        for i, (req, tok) in enumerate(zip(new, tokens)):
            self.running.append(req)
            req.t_start, req.t_first, req.length, req.passes = t0, now, len(req.prompt), 1
            req.ctx_len = req.length  # the prefill wrote the prompt's drafter context
            reason = emit(req, [tok], now, self.max_len)
            outputs.append(RequestOutput(req.request_id, [tok], reason is not None, reason, request_stats(req)))
            if reason is not None:
                done.append(row0 + i)
        self._release(done)
        took = self.clock() - t0
        self.prefill_seconds += took
        ran = sum(lens_host) if pack else m * P  # the tokens this forward computed
        per = 1e3 * took / ran
        self.prefill_ms_per_token = per if self.prefill_ms_per_token is None else 0.5 * (self.prefill_ms_per_token + per)
        for observer in self.observers:
            observer.on_prefill(took, m)
        return outputs

    def _admit(self) -> int:
        """How many waiting requests this step prefills (`EngineConfig.admission`, workers/admission.py)."""
        free = min(self.free_slots, len(self.waiting))
        if self.admission == "all" or not self.running:
            return free
        now = self.clock()
        rows = [RowClock(getattr(r.targets, "effective_tpot_ms", None), 1e3 * (now - r.t_first),
                         len(r.output) - 1, remaining(r, self.max_len)) for r in self.running]
        waiting = [Waiting(len(r.prompt), 1e3 * (now - r.t_arrive), getattr(r.targets, "ttft_ms", None))
                   for r in itertools.islice(self.waiting, free)]
        return admit_count(waiting, rows, free, mode=self.admission, ms_per_token=self.prefill_ms_per_token,
                           max_wait_ms=self.config.admission_max_wait_ms, packed=self.pack_prefill)

    def _batch(self, rows: RowState, intent: DraftIntent, source: torch.Tensor, source_host: list[int],
               steps: torch.Tensor, steps_host: list[int], pins: StepPins | None) -> StepBatch:
        """The step's `StepBatch` (before its plan), for each row's source code and diffusion
        steps [B] (host tensors and lists) as the decision maker's `intent` asked and the rows'
        pins (None: no row pins anything) set them."""
        dev, run = self.device, self.running
        temp, top_k, top_p = sampling_tensors(run, dev)
        l2r = torch.tensor([r.knobs.commit_order == "left-to-right" for r in run])
        point_mass = draft_sources.point_mass(source_host)
        conditional = ((steps <= 1) | l2r) & ~point_mass  # point-mass drafts: MATCH
        lengths = [r.length for r in run]
        return StepBatch(
            requests=tuple(run), rows=rows, lengths=torch.tensor(lengths, device=dev), lengths_host=lengths,
            anchors=torch.tensor([r.output[-1] for r in run], device=dev), temperature=temp, top_k=top_k, top_p=top_p,
            source=source, source_host=source_host, steps=steps, steps_host=steps_host, point_mass=point_mass,
            left_to_right=l2r.to(dev),
            conditional=conditional, exact_rule=exact_rules(rows.temperature, conditional),
            lossless=torch.tensor([r.knobs.lossless for r in run]), span=self._span(intent, steps, steps_host, pins))

    def _span(self, intent: DraftIntent, steps: torch.Tensor, steps_host: list[int], pins: StepPins | None) -> int:
        """The block positions the drafter denoises this step: the intent's span (the most drafted
        tokens any diffusion row may verify; 0 = the whole block), widened to the draft lengths
        pinned rows verify, in [1, K]; the whole block where the backend runs whole blocks only
        (its drafter programs have the block's shape) or when no row drafts by diffusion."""
        K = self.block
        if not self.backend.partial_span or not any(s > 0 for s in steps_host):
            return K
        span = intent.span or K
        if pins is not None:
            span = max(span, pins.span(steps))
        return max(1, min(K, span))

    def _plan(self, batch: StepBatch, intent: DraftIntent, feats: DraftFeatures, drafts: StepDrafts,
              pins: StepPins | None) -> StepPlan:
        """Draft lengths and rules per row: the decision maker's (`after_draft`, told the applied
        `intent`), with the rows' pins applied
        (`StepPins.apply_verify`), capped by the draft each row has and its remaining tokens, with the rules each row really verifies with
        (`kernels.rules.enforce_rules`: GREEDY at T = 0, exact rules for lossless rows and
        point-mass drafts, MATCH where q are not conditionals). The draft lengths size the target forward,
        so the host reads them: computed on the host when the decision maker answers with host
        tensors (as `StaticDecisions` and the policies do), on the device otherwise (one sync)."""
        rows = batch.rows
        dec = self.decisions.after_draft(rows, intent, feats)
        on_host = all(t.device.type == "cpu" for t in (dec.draft_len, dec.rule, dec.param, dec.param2))
        at = torch.device("cpu") if on_host else self.device
        k, rule, param, param2 = (t.to(at) for t in (dec.draft_len, dec.rule, dec.param, dec.param2))
        if pins is not None:
            k, rule, param, param2 = pins.apply_verify(k, rule, param, param2, batch.exact_rule)
        k = torch.minimum(k.clamp(min=0), drafts.lengths.to(at))  # the tokens each row's source drafted
        k = torch.minimum(k, rows.remaining.to(at) - 1)
        rule, param, param2 = enforce_rules(rule, param, param2, rows.temperature.to(at),
                                            batch.lossless.to(at), batch.conditional.to(at), batch.point_mass.to(at),
                                            batch.exact_rule.to(at))
        # one host read (`torch.stack` promotes to float32: counts, rule ids and float32 params exact)
        k_host, rule_host, p1_host, p2_host = torch.stack([k, rule, param, param2]).tolist()
        k_host, rule_host = [int(x) for x in k_host], [int(x) for x in rule_host]
        dev = self.device
        k, rule, param, param2 = k.to(dev), rule.to(dev), param.float().to(dev), param2.float().to(dev)
        kmax = max(k_host)
        layout = None
        if kmax > 0 and any(r != int(Rule.GREEDY) for r in rule_host):
            layout = RaggedLayout.from_host_counts(k_host, dev)
        return StepPlan(k, rule, param, param2, k_host, rule_host, p1_host, p2_host, layout)

    def _decode(self) -> list[RequestOutput]:
        t0 = self._tick()
        run, K = self.running, self.width
        rows = self._row_state()
        # (1) the decision maker's intent, with the rows' pins applied
        intent = self.decisions.before_draft(rows)
        source, steps, pins = self._applied(rows, intent)  # host [B]
        source_host, steps_host = torch.stack([source, steps]).tolist()  # host tensors: no device sync
        t_decide = self._tick()
        if not any(source_host):  # no row drafts this step (NONE_CODE is 0)
            return self._decode_plain(rows, pins, t0, t_decide)
        batch = self._batch(rows, intent, source, source_host, steps, steps_host, pins)
        applied = DraftIntent(source, steps, batch.span)  # what drafting does

        # (2) draft: each source proposes for its rows (workers/draft_sources.py): suffix rows take
        # their suffix drafts, diffusion rows are denoised together over the first `span`
        # positions of the block (the most any of them may verify)
        drafts = draft_step(self, batch, self._reads_features())
        t_draft = self._tick()

        # (3) draft length and rule per row; lossless rows get exact rules only
        feats = DraftFeatures(batch.steps, drafts.confidence, drafts.entropy, drafts.margin, batch.exact_rule,
                              batch.conditional, batch.source)
        batch = batch.planned(self._plan(batch, applied, feats, drafts, pins))
        t_choose = self._tick()

        # (4) one target forward over [anchor, x_1..x_k] per row, verify the ragged batch
        kmax = batch.plan.max_k
        Tq = kmax + 1
        inp = torch.cat([batch.anchors[:, None], drafts.tokens[:, :kmax]], 1)  # [B, Tq]
        width = max(batch.lengths_host) + Tq
        packed = self._packed(batch.plan, Tq)  # [B + N] or None
        logits, hidden = self.target_forward(inp, batch.lengths, self.tcache, 0, width,  # [B, Tq, V] or [B + N, V]
                                             start_value=batch.common_length,
                                             **self._pack_args(packed, batch.plan))
        if self.drafting is not None:
            self.drafting.stash(run, hidden, Tq)
        t_forward = self._tick()
        tracing = self.trace_sink is not None
        trace_feats = (drafts.confidence, drafts.entropy, drafts.margin) if tracing else ()
        if kmax == 0:  # no row verifies a draft: each row just samples its next token
            host = self.verifier.sample_next(logits[:, 0], run, batch.temperature, batch.top_k, batch.top_p, trace_feats)
            Kc = 0
        else:
            out = self.verifier.verify(batch, logits, drafts.tokens, drafts.q, packed, drafts.vocab_ids)
            host, Kc = self.verifier.commit(batch, out, trace_feats)  # (5) the step's one host read
        now = self._tick()
        result = StepResult.unpack(host, Tq, Kc, 3 * K if tracing else 0)
        return self._conclude(batch, applied, pins, result, (t0, t_decide, t_draft, t_choose, t_forward, now))

    def _applied(self, rows: RowState, intent: DraftIntent) -> tuple[torch.Tensor, torch.Tensor, StepPins | None]:
        """Each row's source code and diffusion steps [B] (host) as `intent` asks (steps in [1, K]
        on diffusion rows, 0 elsewhere), overridden by the rows' pins (workers/pins.py: the knobs
        requests pinned win), with rows whose source has no draft for them this step (an empty
        suffix draft) set to no draft; and the step's pins (None: no row pins anything)."""
        source = intent.source.to(torch.int64).cpu()
        steps = torch.where(source == DIFFUSION_CODE, intent.steps.to(torch.int64).cpu().clamp(0, self.block), 0)
        source = torch.where((source == DIFFUSION_CODE) & (steps == 0), NONE_CODE, source)
        pins = StepPins.of([r.pins for r in self.running])
        if pins is not None:
            source, steps, pins = pins.apply(source, steps, rows.remaining)
            steps = steps.clamp(max=self.block)
        for code in draft_sources.codes():  # a source without a draft for a row leaves it none
            if code != NONE_CODE:
                ready = draft_sources.by_code(code).ready(self, rows)  # [B] bool
                source = torch.where((source == code) & ~ready, NONE_CODE, source)
        return source, torch.where(source == DIFFUSION_CODE, steps, 0), pins

    def _tick(self) -> float:
        """The engine's clock at a phase boundary of a decode step (`StepRecord.times`), the
        device synchronised first where `sync_phases` asks for it."""
        if self.sync_phases and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock()

    def _packed(self, plan: StepPlan, Tq: int) -> torch.Tensor | None:
        """[B + N] flat positions (row-major into [B, Tq]) of each row's anchor and verified
        drafts, when this engine packs verification forwards and the batch is ragged; else None."""
        k_host = plan.draft_len_host
        B, n = len(k_host), sum(k_host)
        if not self.pack or Tq == 1 or n + B == B * Tq:
            return None
        lay = plan.layout or RaggedLayout.from_host_counts(k_host, self.device)
        return lay.row * Tq + lay.col

    @staticmethod
    def _pack_args(packed: torch.Tensor | None, plan: StepPlan) -> dict:
        """The forward's packing arguments: none, `packed`, and with few drafting rows (at most a
        quarter of 4 or more) the per-row counts that make attention skip the padded queries. A
        per-row attention call costs ~0.1 ms over 30 layers: measured on SmolLM2, at 8 rows one
        row verifying 8 drafts took 35 ms against 45 ms padded-attention, but three drafting rows
        44 against 36 ms (docs/engine.md)."""
        if packed is None:
            return {}
        k = plan.draft_len_host
        drafting = sum(1 for x in k if x > 0)
        if len(k) >= 4 and 4 * drafting <= len(k):
            return {"packed": packed, "packed_counts": [x + 1 for x in k]}
        return {"packed": packed}

    def _decode_plain(self, rows: RowState, pins: StepPins | None, t0: float, t_decide: float) -> list[RequestOutput]:
        """The decode step when no row drafts (every s = 0; autoregressive decoding): one target
        forward over each row's anchor, one token per row, without the drafting and verification
        machinery. `after_draft` is not asked (there is nothing to verify); each row records its
        exact rule (GREEDY at T = 0, REJECTION otherwise) with parameters 0."""
        dev, run, B = self.device, self.running, len(self.running)
        lens = [r.length for r in run]
        logits, hidden = self.target_forward(torch.tensor([[r.output[-1]] for r in run], device=dev),  # [B, 1, V]
                                             torch.tensor(lens, device=dev), self.tcache, 0, max(lens) + 1,
                                             start_value=common_value(lens))
        if self.drafting is not None:
            self.drafting.stash(run, hidden, 1)
        t_forward = self._tick()
        sampled = any(r.generator is not None for r in run)
        temp, top_k, top_p = sampling_tensors(run, dev) if sampled else (None, None, None)
        feats = ()
        if self.trace_sink is not None:  # rows that do not draft have zero features
            zeros = torch.zeros(B, self.width, device=dev)
            feats = (zeros, zeros, zeros)
        host = self.verifier.sample_next(logits[:, 0], run, temp, top_k, top_p, feats)
        now = self._tick()
        batch = StepBatch.without_drafts(run, rows)
        result = StepResult.unpack(host, 1, 0, 3 * self.width if feats else 0)
        return self._conclude(batch, DraftIntent.none(B), pins, result, (t0, t_decide, t_decide, t_decide, t_forward, now))

    def _conclude(self, batch: StepBatch, intent: DraftIntent, pins: StepPins | None, result: StepResult,
                  times: tuple[float, ...]):
        """The host side of a decode step, after its one host read: each row commits its accepted
        drafts + 1 (workers/commit.py), emits its tokens and checks its stop conditions; trace
        records are written, the decision maker and then the observers are told (`StepRecord`,
        with the applied `intent` and the phase `times`: the clock at the step's start and after
        its decide, draft, choose, forward and accept phases), finished slots are freed."""
        plan, K, B = batch.plan, self.width, batch.size
        t0, t_decide, t_draft, t_choose, t_forward, t_accept = times
        drafted = any(batch.source_host)  # some row drafted (host ints: no tensor read)
        trace_times = (t0, t_draft if drafted else t0, t_accept)  # a step without drafts drafted for 0 ms
        # positions in the target forward: each row's own (packed) or rows padded to the longest
        positions = B + sum(plan.draft_len_host) if self.pack else B * (plan.max_k + 1)
        tracing = self.trace_sink is not None
        outputs, done, records = [], [], []
        for i, req in enumerate(batch.requests):
            ai, tvd_i, new = result.accepted[i], result.tvd[i], result.tokens[i]
            kk, src_i, s_i, rule_i = plan.draft_len_host[i], batch.source_host[i], batch.steps_host[i], plan.rule_host[i]
            # tokens left as the step began: the row's output grows only in `emit`, below
            clamp = pin_clamp(req.pins, s_i, kk, remaining(req, self.max_len)) if req.pins.any else None
            advance(req, src_i, s_i, kk, rule_i, ai, tvd_i, None if result.accept_per_position is None else result.accept_per_position[i],
                    clamp)
            if tracing:
                records.append(trace_record(req, self.step_count, result.features[i], K, src_i, s_i, kk, rule_i,
                                            plan.param_host[i], plan.param2_host[i], ai, tvd_i, trace_times, B, positions))
            reason = emit(req, new, t_accept, self.max_len)
            outputs.append(RequestOutput(req.request_id, new, reason is not None, reason, request_stats(req)))
            if reason is not None:
                done.append(i)
        if tracing:
            self.trace_sink.write(records)
        outcome = StepOutcome(torch.tensor(result.accepted), torch.tensor(plan.draft_len_host), torch.tensor(result.tvd),
                              t_accept - t0, positions, any_verified=any(plan.draft_len_host))
        phases = {"decide": t_decide - t0, "draft": t_draft - t_decide, "choose": t_choose - t_draft,
                  "forward": t_forward - t_choose, "accept": t_accept - t_forward}
        pinned = torch.zeros(B, dtype=torch.bool) if pins is None else pins.pinned
        record = StepRecord(self.step_count, batch.rows, intent, plan if drafted else None, outcome, pinned, phases)
        self.decisions.observe(record)
        self.step_count += 1
        self._release(done)
        phases["conclude"] = self._tick() - t_accept
        for observer in self.observers:
            observer.on_step(record)
        return outputs

    # -- helpers ------------------------------------------------------------------------
    def _reads_features(self) -> bool:
        """Whether this step's draft features (confidence, entropy, margin: a top-2 and an
        entropy over [B, K, V], ~10% of a speculative step at batch 1 on CPU) have a reader: the
        trace sink, or a decision maker that declares ``reads_draft_features``."""
        return self.trace_sink is not None or self.decisions.reads_draft_features

    def _source_facts(self) -> dict:
        """The `RowState` fields draft sources add before the decision (workers/draft_sources.py
        `facts`): those of the sources the decision maker reads (``reads_suffix``: the suffix
        drafts) or a running row's knobs name, where this engine can draft from them. A source
        whose facts are not computed has no draft for any row this step (`ready`)."""
        wanted = {r.knobs.source for r in self.running} | ({"suffix"} if self.decisions.reads_suffix else set())
        facts = {}
        for name in sorted(wanted):
            source = draft_sources.by_name(name)
            if source.width(self) > 0:
                facts.update(source.facts(self, self.running))
        return facts

    def _row_state(self) -> RowState:
        run = self.running
        facts = self._source_facts()
        now = self.clock()
        return RowState(
            request_ids=[r.request_id for r in run], knobs=[r.knobs for r in run], targets=[r.targets for r in run],
            position=torch.tensor([r.length for r in run]), generated=torch.tensor([len(r.output) for r in run]),
            temperature=torch.tensor([float(r.params.temperature) for r in run]),
            recent_accept=torch.tensor([r.recent_accept for r in run]), tvd_spent=torch.tensor([r.tvd for r in run]),
            remaining=torch.tensor([remaining(r, self.max_len) for r in run]), batch_size=len(run), block_size=self.width,
            has_drafter=self.drafter is not None, packed_verify=self.pack, closed=self.closed and not self.waiting,
            fixed_span=not self.backend.partial_span,
            decode_ms=torch.tensor([1e3 * (now - r.t_first) for r in run], dtype=torch.float32), **facts)

    def _release(self, idx: list[int]) -> None:
        """Free the slots `idx` of the running list, moving the last slots into the holes."""
        for i in sorted(idx, reverse=True):
            req = self.running[i]
            last = len(self.running) - 1
            if i != last:
                moved = self.running[last]
                self.tcache.move(last, i, moved.length + 1)
                if self.drafting is not None:
                    self.drafting.move(last, i, moved)
                self.verifier.counters.move(last, i)
                self.running[i] = moved
            self.running.pop()
            self.requests.pop(req.request_id, None)
            if self.suffix is not None:  # its output may be copied by later requests
                self.suffix.finish(req.output)
