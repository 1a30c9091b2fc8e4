"""The decoder engine: continuous batching of speculative-diffusion decoding (contracts §4).

Words used here (see also workers/decisions.py):
- **slot**: a row of the KV caches owned by one running request. Running requests always occupy
  slots `0 .. n-1` in order (`running[i]` owns slot i), so batched calls use plain cache views.
- **committed length L**: tokens whose K/V are in the target cache (and whose target hidden
  states are in the drafter's context cache). The **anchor** (last emitted token) sits at L.
- **step**: one `Engine.step()`: prefill of newly added requests (their first token comes from
  the target), then one decode step over all running rows: (1) steps `s` per row; (2) the
  drafter denoises `[anchor, MASK x K]` for rows with s > 0, all rows batched, s_max passes;
  (3) draft length `k` and acceptance rule per row; (4) one target forward over
  `[anchor, x_1..x_k]` per row (padded to max k + 1), `kernels.verify` on the ragged flat batch;
  (5) commit: lengths += accepted + 1 (rollback is just not advancing), the target hidden states
  of the new positions are stashed for the drafter context; one host sync reads the results.
- **lazy context commit**: the drafter's context K/V of a row's positions `[ctx_len, L)` are
  computed only when the row next drafts (or when its stash of `PENDING_WINDOW` positions fills),
  from the target hidden states kept in `pending`. Rows that decode without drafts (`s = 0`,
  `--draft-len 0`) thus pay one batched context pass per `PENDING_WINDOW` tokens instead of one
  per step.

Randomness: each sampled request draws from its own `torch.Generator` (seeded by
`SamplingParams.seed`), and draws only what its own row needs, so a seeded request's output does
not depend on the rest of the batch.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kernels import Rule, verify
from kernels.verify import VerifyOutput
from kernels.reference import race
from kernels.denoise import select_commit
from kernels.rules import NEEDS_DRAFT_PROBS, enforce_rules, exact_rules
from workers.compiled import CompiledTarget, compile_forward, mark_static, resolve_compile, warm_up
from workers.decisions import (RECENT_NONE, SUFFIX, DecisionMaker, DraftFeatures, RowState, StaticDecisions,
                               StepOutcome, next_recent_accept)
from workers.request import DecodeKnobs, EngineInputError, PromptTooLongError, RequestOutput, SamplingParams
from workers.sampling import argmax, draft_features, inverse_cdf_sample, probabilities, race_sample
from workers.linear import prepare_for_inference
from workers.suffix import SuffixConfig, SuffixDrafter
from workers.traces import TRACE_VERSION
from workers.target_model import load_target, resolve_dtype

# rules that read q: those that need it, plus TYPICAL, whose TVD is exact only when q is given
USES_DRAFT_PROBS = NEEDS_DRAFT_PROBS | {Rule.TYPICAL}
PENDING_WINDOW = 64  # target positions a row may stash before its drafter context is written
SUFFIX_WIDTH = 16    # the longest suffix draft of an engine without a drafter (else the drafter's K)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models" / "demo" / "target"
DEMO_DRAFTER = REPO_ROOT / "models" / "demo" / "drafter"


def _source_name(steps: int, draft_len: int) -> str:
    """A row's draft source in a step: 'suffix', 'diffusion' or 'none' (nothing verified)."""
    return "none" if draft_len <= 0 else "suffix" if steps == SUFFIX else "diffusion"


def _common(values: list[int]) -> int | None:
    """The value shared by all of `values`, or None if they differ."""
    first = values[0]
    return first if all(v == first for v in values) else None


@dataclass
class EngineConfig:
    """target / drafter: local model directories (drafter None = autoregressive only);
    dtype: auto | float32 | bfloat16 | float16; device: auto | cpu | cuda[:i];
    max_batch: running requests at once; max_len: prompt + generated tokens per request;
    shape_aware_linear: on CPU, run the bf16/fp16 target's and drafter's matmuls through packed
    oneDNN weights, the smallest through fp32 copies (workers/linear.py; ignored on GPUs and in
    fp32; False = plain `F.linear`); compile: "on" | "off" | "auto" (on for CPU devices), or a
    bool: run the target's decode forwards and the drafter's denoising pass as compiled programs
    (workers/compiled.py; call `warm_up()` before serving, or the first steps of each kind
    compile on the spot); suffix: keep a suffix drafter (workers/suffix.py) so that rows may
    draft from text already seen (knobs source 'suffix', or a decision maker's `SUFFIX`);
    suffix_global_tokens: how many tokens of finished requests' outputs it remembers for other
    requests' drafts (0 = only a request's own text: no request's speed then depends on what
    another request generated)."""

    target: str | Path = DEMO_TARGET
    drafter: str | Path | None = DEMO_DRAFTER
    dtype: str = "auto"
    device: str = "auto"
    max_batch: int = 64
    max_len: int = 1024
    seed: int = 0  # seeds the generators of requests that bring no seed
    shape_aware_linear: bool = True
    compile: bool | str = False
    suffix: bool = True
    suffix_global_tokens: int = 1 << 16


@dataclass(frozen=True)
class StepPlan:
    """What a decode step decided per row, on the host: `steps` (s; `SUFFIX` = a suffix draft; 0 =
    none), `draft_len` (k verified), `rule` and its parameters `param`, `param2`."""

    steps: list[int]
    draft_len: list[int]
    rule: list[int]
    param: list[float]
    param2: list[float]


@dataclass(frozen=True)
class StepResult:
    """What a decode step produced per row, read back in its one host sync: the `tokens` emitted,
    drafts `accepted`, `tvd` spent, `accept_per_position` (None when no draft was verified: the
    counters did not change) and, when tracing, `features` (confidence, entropy, margin: 3 K
    values)."""

    tokens: list[list[int]]
    accepted: list[int]
    tvd: list[float]
    accept_per_position: list[list[float]] | None
    features: list[list[float]]

    @classmethod
    def unpack(cls, host: list[list[float]], Tq: int, Kc: int, feature_width: int) -> "StepResult":
        """Parse the packed host rows of `_verify_commit` / `_sample_next`: per row [tokens (Tq),
        accepted, emitted, tvd, (accept_per_position (Kc), positions verified if Kc), features]."""
        base = Tq + 3 + (Kc + 1 if Kc else 0)
        return cls(tokens=[[int(t) for t in row[: int(row[Tq + 1])]] for row in host],
                   accepted=[int(row[Tq]) for row in host], tvd=[row[Tq + 2] for row in host],
                   accept_per_position=[row[Tq + 3 : Tq + 3 + int(row[Tq + 3 + Kc])] for row in host] if Kc else None,
                   features=[row[base : base + feature_width] for row in host])


@dataclass(eq=False)  # compared by identity
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    knobs: DecodeKnobs
    targets: object
    stop_ids: tuple[int, ...]
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    length: int = 0            # committed length L
    ctx_len: int = 0           # positions < ctx_len have drafter-context K/V; [ctx_len, L) are stashed
    passes: int = 0            # target forward passes that emitted tokens for this request
    accepted: int = 0
    verified: int = 0
    tvd: float = 0.0
    recent_accept: float = RECENT_NONE
    t_start: float = 0.0
    t_last: float = 0.0
    last_knobs: tuple = (0, 0, int(Rule.GREEDY))  # steps, draft_len, rule of the latest step
    apos: list[float] = field(default_factory=list)  # accept_per_position
    _ema_before: float = RECENT_NONE
    suffix_index: object = None  # workers.suffix.TokenIndex over prompt + output
    suffix_draft: object = None  # this step's workers.suffix.SuffixDraft


class Engine:
    def __init__(self, config: EngineConfig, decisions: DecisionMaker | None = None, trace_sink=None):
        self.config = config
        if config.max_batch < 1:
            raise EngineInputError(f"max_batch must be >= 1, got {config.max_batch}")
        dev = config.device
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if dev == "auto" else dev)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.compiled = resolve_compile(config.compile, self.device)
        self.target = load_target(config.target, self.dtype, self.device, shape_aware=config.shape_aware_linear)
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
            prepare_for_inference(self.drafter, shape_aware=config.shape_aware_linear)
            self.drafter.bind(self.target.model.embed_tokens, self.target.lm_head).eval().requires_grad_(False)
            self.block = self.drafter.config.block_size
            self.capture = tuple(self.drafter.config.target_layer_ids)
        # the widest draft verified: the drafter's block, or the suffix drafter's cap without one
        self.width = self.block or (SUFFIX_WIDTH if config.suffix else 0)
        self.suffix = (SuffixDrafter(SuffixConfig(max_draft=self.width, global_tokens=config.suffix_global_tokens))
                       if config.suffix else None)
        cap = self.max_len + self.width + 1  # room for speculative writes past max_len
        self.tcache = self.target.new_cache(config.max_batch, cap)
        # target_forward(ids, start, cache, row0, width, logits_index=None, start_value=None):
        # the target's forward with this engine's captured layers; compiled with `compile`
        self.target_forward = functools.partial(self.target, capture=self.capture)
        # draft_pass(tokens, masked, ctx_kv, mask, cos, sin): one denoising pass (`block_logits`)
        self.draft_pass = None if self.drafter is None else self.drafter.block_logits
        # context_kv(hidden, positions): the drafter-context K/V of stashed target hidden states
        self.context_kv = None if self.drafter is None else functools.partial(self.drafter.context_kv, bound=cap)
        if self.compiled:
            self.target_forward = CompiledTarget(self.target, self.capture)
            if self.drafter is not None:
                self.draft_pass = compile_forward(self.drafter, "block_logits")
                self.context_kv = compile_forward(self.drafter, "context_kv", bound=cap)
        self.dcache = None
        if self.drafter is not None:
            from workers.kv_cache import KVCache

            dc = self.drafter.config
            self.dcache = KVCache(dc.num_layers, config.max_batch, dc.num_kv_heads, cap, dc.head_dim,
                                  dtype=self.dtype, device=self.device)
            width = len(self.capture) * tcfg.hidden_size
            # [max_batch, PENDING_WINDOW, n * H] target hidden states not yet in the drafter context
            self.pending = torch.zeros(config.max_batch, PENDING_WINDOW, width, dtype=self.dtype, device=self.device)
        if self.compiled:  # the buffers' shapes are constants of the compiled programs
            mark_static(*self.tcache.k, *self.tcache.v)
            if self.dcache is not None:
                mark_static(*self.dcache.k, *self.dcache.v)
        K = max(self.width, 1)
        self.acc_counts = torch.zeros(config.max_batch, K, device=self.device)    # accepted at draft position j
        self.reach_counts = torch.zeros(config.max_batch, K, device=self.device)  # verified with all before accepted
        self.decisions = decisions or StaticDecisions()
        self.trace_sink = trace_sink
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.step_count = 0
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._tokenizer = None

    def warm_up(self) -> dict:
        """Compile every call pattern of the compiled forward now, on throwaway requests
        (`workers.compiled.warm_up`); a no-op without `compile`. Call before serving."""
        if not self.compiled:
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
        req = _Request(request_id, ids, params, knobs, targets, tuple(dict.fromkeys(stops)), gen)
        if self.suffix is not None:
            req.suffix_index = self.suffix.new_index(ids)
        self.requests[request_id] = req
        self.waiting.append(req)

    def _check_knobs(self, knobs: DecodeKnobs) -> None:
        if knobs.source == "suffix":
            if self.suffix is None:
                raise EngineInputError("source = 'suffix' needs the engine's suffix drafter (EngineConfig.suffix)")
            if knobs.draft_len > self.width:
                raise EngineInputError(f"draft_len = {knobs.draft_len} exceeds the longest suffix draft {self.width}")
            return
        if knobs.draft_len > 0 and knobs.steps > 0:
            if self.drafter is None:
                raise EngineInputError(f"draft_len = {knobs.draft_len} needs a drafter, and this engine has none (use draft_len 0)")
            if knobs.draft_len > self.block:
                raise EngineInputError(f"draft_len = {knobs.draft_len} exceeds the drafter's block size {self.block}")
            if knobs.steps > self.block:
                raise EngineInputError(f"steps = {knobs.steps} exceeds the drafter's block size {self.block}")

    def set_knobs(self, request_id: str, knobs: DecodeKnobs) -> None:
        """Change a request's static knobs; they apply from the next step."""
        self._check_knobs(knobs)
        self.requests[request_id].knobs = knobs

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
        return RequestOutput(request_id, [], True, "abort", self._stats(req))

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
        new = [self.waiting.popleft() for _ in range(min(self.free_slots, len(self.waiting)))]
        t0 = time.perf_counter()
        dev, m, row0 = self.device, len(new), len(self.running)
        P = max(len(r.prompt) for r in new)
        ids = torch.tensor([r.prompt + [0] * (P - len(r.prompt)) for r in new], device=dev)  # [m, P]
        lens = torch.tensor([len(r.prompt) for r in new], device=dev)
        zero = torch.zeros(m, dtype=torch.long, device=dev)
        logits, hidden = self.target_forward(ids, zero, self.tcache, row0, P, logits_index=(lens - 1)[:, None],
                                             start_value=0)
        if self.drafter is not None:
            pos = torch.arange(P, device=dev).expand(m, P)
            self.dcache.write_span(self.drafter.context_kv(hidden, pos, bound=self.dcache.max_len), row0, 0)
        temp, top_k, top_p = self._sampling_tensors(new)
        probs = probabilities(logits[:, 0], temp, top_k, top_p)  # [m, V]
        noise = self._noise(new, [1] * m, probs.shape[1], ones=True)
        first = race_sample(probs, noise, temp <= 0)
        self.acc_counts[row0 : row0 + m] = 0
        self.reach_counts[row0 : row0 + m] = 0
        tokens = first.tolist()  # the prefill's one host sync
        now = time.perf_counter()
        outputs, done = [], []
        for i, (req, tok) in enumerate(zip(new, tokens)):
            self.running.append(req)
            req.t_start, req.length, req.passes = t0, len(req.prompt), 1
            req.ctx_len = req.length  # the prefill wrote the prompt's drafter context
            reason = self._emit(req, [tok], now)
            outputs.append(RequestOutput(req.request_id, [tok], reason is not None, reason, self._stats(req)))
            if reason is not None:
                done.append(row0 + i)
        self._release(done)
        return outputs

    def _decode(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        dev, run, B, K, V = self.device, self.running, len(self.running), self.width, self.vocab
        rows = self._row_state()
        steps = self.decisions.choose_steps(rows).to(torch.int64).clamp(SUFFIX, self.block)
        if rows.suffix_len is None:  # no suffix drafts this step
            steps = steps.clamp(min=0)
        else:  # a row without a suffix draft does not draft
            steps = torch.where((steps == SUFFIX) & (rows.suffix_len == 0), 0, steps)
        s_host = steps.tolist()
        if not any(s_host):  # no row drafts this step
            return self._decode_plain(rows, t0)
        temp, top_k, top_p = self._sampling_tensors(run)
        lengths = torch.tensor([r.length for r in run], device=dev)  # [B] L
        anchors = torch.tensor([r.output[-1] for r in run], device=dev)  # [B]
        l2r = torch.tensor([r.knobs.commit_order == "left-to-right" for r in run], device=dev)
        steps_d = steps.to(dev)
        conditional = ((steps_d <= 1) | l2r) & (steps_d >= 0)  # suffix drafts are point masses: MATCH
        exact = exact_rules(temp, conditional)

        # (2) draft all rows with s > 0 together
        drafts = torch.zeros(B, K, dtype=torch.long, device=dev)  # [B, K]
        conf = torch.zeros(B, K, device=dev)
        ent, margin = torch.zeros_like(conf), torch.zeros_like(conf)
        q_full = None
        if SUFFIX in s_host:  # suffix rows: their drafts and vote shares (as confidence), host-built
            tok_s, conf_s = self._suffix_drafts(s_host)
            drafts, conf = tok_s.to(dev), conf_s.to(dev)
        if self.block and max(s_host) > 0:
            drows = [i for i, s in enumerate(s_host) if s > 0]
            sel = None if len(drows) == B else torch.tensor(drows, device=dev)
            self._flush(drows)
            tok_d, q_d = self._draft(drows, sel, s_host, anchors, lengths, temp, top_k, top_p, l2r)
            if self._reads_features():
                c, e, mg = draft_features(q_d)
            else:  # nobody reads them: zeros, as for rows that do not draft
                c = e = mg = torch.zeros(len(drows), K, device=dev)
            if sel is None:
                drafts, conf, ent, margin, q_full = tok_d, c, e, mg, q_d
            else:
                drafts[sel], conf[sel], ent[sel], margin[sel] = tok_d, c, e, mg
                q_full = torch.zeros(B, K, V, device=dev)
                q_full[sel] = q_d
        t_draft = time.perf_counter()

        # (3) draft length and rule per row; lossless rows get exact rules only
        feats = DraftFeatures(steps_d, conf, ent, margin, exact, conditional)
        dec = self.decisions.choose_verify(rows, feats)
        remaining = rows.remaining.to(dev)
        longest = torch.where(steps_d > 0, K, 0)
        if rows.suffix_len is not None:
            longest = torch.where(steps_d == SUFFIX, rows.suffix_len.to(dev), longest)
        k = torch.minimum(dec.draft_len.to(dev).clamp(min=0), longest)
        k = torch.minimum(k, remaining - 1)
        # the rule each row really verifies with (kernels.rules.enforce_rules: GREEDY at T = 0,
        # exact rules for lossless rows and suffix drafts, MATCH where q are not conditionals)
        lossless = torch.tensor([r.knobs.lossless for r in run], device=dev)
        rule, param, param2 = enforce_rules(dec.rule.to(dev), dec.param.to(dev), dec.param2.to(dev), temp, lossless,
                                            conditional, steps_d == SUFFIX)
        # the draft lengths size the target forward, so the host reads them (free for a decision
        # maker that answers with CPU tensors, as StaticDecisions does)
        k_host, rule_host, p1_host, p2_host = torch.stack([k.double(), rule.double(), param.double(), param2.double()]).tolist()
        k_host, rule_host = [int(x) for x in k_host], [int(x) for x in rule_host]
        plan = StepPlan(s_host, k_host, rule_host, p1_host, p2_host)

        # (4) one target forward over [anchor, x_1..x_k] per row, verify the ragged batch
        kmax = max(k_host)
        Tq = kmax + 1
        inp = torch.cat([anchors[:, None], drafts[:, :kmax]], 1)  # [B, Tq]
        width = max(r.length for r in run) + Tq
        logits, hidden = self.target_forward(inp, lengths, self.tcache, 0, width,  # [B, Tq, V]
                                             start_value=_common([r.length for r in run]))
        if self.drafter is not None:
            self._stash(hidden, Tq)
        tracing = self.trace_sink is not None
        if kmax == 0:  # no row verifies a draft: each row just samples its next token
            host = self._sample_next(logits[:, 0], run, temp, top_k, top_p, (conf, ent, margin) if tracing else ())
            Kc = 0
        else:
            host, Kc = self._verify_commit(logits, drafts, q_full, k_host, rule_host, k, rule, param, param2,
                                           temp, top_k, top_p, (conf, ent, margin) if tracing else ())
        now = time.perf_counter()
        result = StepResult.unpack(host, Tq, Kc, 3 * K if tracing else 0)
        return self._conclude(rows, plan, result, t0, t_draft, now)

    def _decode_plain(self, rows: RowState, t0: float) -> list[RequestOutput]:
        """The decode step when no row drafts (every s = 0; autoregressive decoding): one target
        forward over each row's anchor, one token per row, without the drafting and verification
        machinery. `choose_verify` is not asked (there is nothing to verify); each row records its
        exact rule (GREEDY at T = 0, REJECTION otherwise) with parameters 0."""
        dev, run, B = self.device, self.running, len(self.running)
        lens = [r.length for r in run]
        logits, hidden = self.target_forward(torch.tensor([[r.output[-1]] for r in run], device=dev),  # [B, 1, V]
                                             torch.tensor(lens, device=dev), self.tcache, 0, max(lens) + 1,
                                             start_value=_common(lens))
        if self.drafter is not None:
            self._stash(hidden, 1)
        sampled = any(r.generator is not None for r in run)
        temp, top_k, top_p = self._sampling_tensors(run) if sampled else (None, None, None)
        feats = ()
        if self.trace_sink is not None:  # rows that do not draft have zero features
            zeros = torch.zeros(B, self.width, device=dev)
            feats = (zeros, zeros, zeros)
        host = self._sample_next(logits[:, 0], run, temp, top_k, top_p, feats)
        rule_host = [int(Rule.REJECTION if r.params.temperature > 0 else Rule.GREEDY) for r in run]
        zero = [0] * B
        now = time.perf_counter()
        plan = StepPlan(zero, zero, rule_host, [0.0] * B, [0.0] * B)
        result = StepResult.unpack(host, 1, 0, 3 * self.width if feats else 0)
        return self._conclude(rows, plan, result, t0, t0, now)

    def _conclude(self, rows, plan: StepPlan, result: StepResult, t0, t_draft, now):
        """The host side of a decode step, after its one host read: advance each row by its
        accepted drafts + 1, emit its tokens, apply stop conditions, write trace records, tell the
        decision maker, free finished slots."""
        run, K, B = self.running, self.width, len(self.running)
        padded = B * (max(plan.draft_len) + 1)  # positions in the target forward: rows padded to the longest
        tracing = self.trace_sink is not None
        outputs, done, records = [], [], []
        for i, req in enumerate(run):
            ai, tvd_i, new = result.accepted[i], result.tvd[i], result.tokens[i]
            kk, s_i, rule_i = plan.draft_len[i], plan.steps[i], plan.rule[i]
            req.passes += 1
            req._ema_before = req.recent_accept
            req.accepted += ai
            req.verified += kk
            req.tvd += tvd_i
            req.recent_accept = next_recent_accept(req.recent_accept, ai, kk)
            if result.accept_per_position is not None:  # else the counters did not change
                req.apos = result.accept_per_position[i]
            req.last_knobs = (s_i, kk, rule_i)
            req.length += ai + 1
            if tracing:
                records.append(self._record(req, i, result.features[i], K, s_i, kk, rule_i, plan.param[i],
                                            plan.param2[i], ai, tvd_i, t0, t_draft, now, B, padded))
            reason = self._emit(req, new, now)
            outputs.append(RequestOutput(req.request_id, new, reason is not None, reason, self._stats(req)))
            if reason is not None:
                done.append(i)
        if tracing:
            self.trace_sink.write(records)
        self.decisions.observe(rows, StepOutcome(torch.tensor(result.accepted), torch.tensor(plan.draft_len),
                                                 torch.tensor(result.tvd), now - t0, padded))
        self.step_count += 1
        self._release(done)
        return outputs

    def _sample_next(self, logits, run, temp, top_k, top_p, feats) -> list[list[float]]:
        """The autoregressive step (no row verifies a draft): logits [B, V] of each row's anchor
        position; each row emits one token, drawn as `kernels.verify` draws a bonus token (argmax of
        p for T = 0 rows, the exponential race over p otherwise, with the same noise), without the
        ragged layout, rules and counters (nothing is accepted, so they do not change).
        Returns host rows as `_verify_commit`'s with no counters: [token, 0, 1, 0.0, *feats]."""
        B, V = logits.shape
        if all(r.generator is None for r in run):  # all greedy (T = 0): no noise to draw
            tok = argmax(torch.softmax(logits, -1))  # `probabilities` at T = 0, bit for bit
        else:
            p = probabilities(logits, temp, top_k, top_p)  # [B, V]
            tok = torch.where(temp <= 0, argmax(p), race(p, self._noise(run, [1] * B, V, ones=True))[0])
        zero = torch.zeros(B, 1, dtype=torch.float64, device=self.device)
        cols = [tok[:, None].double(), zero, zero + 1, zero] + [f.double() for f in feats]
        return torch.cat(cols, 1).tolist()  # the step's one host sync

    def _verify_commit(self, logits, drafts, q_full, k_host, rule_host, k, rule, param, param2,
                       temp, top_k, top_p, feats) -> tuple[list[list[float]], int]:
        """Verify the drafts of the ragged batch (`kernels.verify`), apply stop tokens and update
        the per-position counters, all on the device, then read everything back in one host sync.
        logits [B, Tq, V]; drafts [B, K]; q_full [B, K, V] or None. Returns (host rows, Kc) with
        row = [tokens (Tq), accepted, emitted, tvd, accept_per_position (Kc), positions verified,
        *feats], Kc the width of the counters."""
        run, dev, K = self.running, self.device, self.width
        B, Tq, V = logits.shape
        if all(r == int(Rule.GREEDY) for r in rule_host):  # every row greedy (T = 0)
            out = self._verify_greedy(logits, drafts, k)
        else:
            out = self._verify_ragged(logits, drafts, q_full, k_host, rule_host, rule, param, param2, temp, top_k, top_p)

        # (5) commit, stop conditions, stats: all on device, then one host sync
        a = out.num_accepted.to(torch.int64)
        emit = a + 1
        j = torch.arange(Tq, device=dev)
        stop_tab = self._stop_table(run)  # [B, S]
        is_stop = (out.tokens[:, :, None] == stop_tab[:, None, :]).any(-1) & (j[None] < emit[:, None])  # [B, Tq]
        first_stop = torch.where(is_stop.any(1), is_stop.to(torch.int8).argmax(1), Tq)
        n_emit = torch.minimum(emit, first_stop + 1)
        Kc = max(K, 1)  # width of the per-position counters
        jk = torch.arange(Kc, device=dev)
        self.acc_counts[:B] += (jk[None] < a[:, None]).float()
        self.reach_counts[:B] += ((jk[None] < k[:, None]) & (jk[None] <= a[:, None])).float()
        apos = self.acc_counts[:B] / self.reach_counts[:B].clamp(min=1)
        packed = [out.tokens.double(), a[:, None].double(), n_emit[:, None].double(),
                  out.tvd_spent[:, None].double(), apos.double(),
                  (self.reach_counts[:B] > 0).sum(1, keepdim=True).double()]  # positions ever verified
        packed += [f.double() for f in feats]
        return torch.cat(packed, 1).tolist(), Kc  # the step's one host sync

    def _verify_ragged(self, logits, drafts, q_full, k_host, rule_host, rule, param, param2,
                       temp, top_k, top_p) -> VerifyOutput:
        """`kernels.verify` on the ragged flat batch (contracts §2): target rows of each request's
        anchor and drafts, each request's probabilities, noise and coins from its own generator."""
        run, dev = self.running, self.device
        B, Tq, V = logits.shape
        kmax, n = Tq - 1, sum(k_host)
        k_t = torch.tensor(k_host, device=dev)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        cu[1:] = k_t.cumsum(0)
        needs_q = any(rr in USES_DRAFT_PROBS for rr, kk in zip(rule_host, k_host) if kk > 0)
        if min(k_host) == kmax:  # every row verifies kmax drafts: the ragged layout is a reshape
            logits_flat = logits.reshape(B * Tq, V)
            draft_flat = drafts[:, :kmax].reshape(-1)  # [n]
            q_flat = q_full[:, :kmax].reshape(n, V) if needs_q else None  # [n, V]
            rep = lambda t: None if t is None else t.repeat_interleave(Tq)
        else:
            ar = torch.arange(B, device=dev)
            row_t = torch.repeat_interleave(ar, k_t + 1, output_size=n + B)  # [n + B] row of each target position
            col_t = torch.arange(n + B, device=dev) - (cu[:-1].long() + ar)[row_t]
            logits_flat = logits[row_t, col_t]
            row_d = torch.repeat_interleave(ar, k_t, output_size=n)  # [n] row of each draft (no host sync)
            col_d = torch.arange(n, device=dev) - cu[:-1].long()[row_d]
            draft_flat = drafts[row_d, col_d]  # [n]
            q_flat = q_full[row_d, col_d] if needs_q else None  # [n, V]
            rep = lambda t: None if t is None else t[row_t]
        p_flat = probabilities(logits_flat, rep(temp), rep(top_k), rep(top_p))  # [n + B, V]
        uniforms = torch.zeros(n, device=dev)
        noise = self._noise(run, [kk + 1 for kk in k_host], V, ones=True, uniforms=(uniforms, k_host))
        if q_flat is not None:
            q_flat = q_flat.contiguous()  # the kernels read rows by pointer; a no-op when already contiguous
        return verify(draft_flat, cu, p_flat, q_flat, rule, param, param2, uniforms, noise, kmax, check=False)

    def _verify_greedy(self, logits, drafts, k) -> VerifyOutput:
        """`kernels.verify` for a batch whose rows all verify with GREEDY (T = 0), on the padded
        [B, Tq] layout (no ragged flattening, rule groups or noise): a row accepts its drafts
        while each equals the argmax of p at its position and emits the argmax at the first
        mismatch (or the bonus position). logits [B, Tq, V]; drafts [B, K]; k [B] int64."""
        B, Tq, V = logits.shape
        kmax = Tq - 1
        p = torch.softmax(logits.reshape(B * Tq, V), -1)  # [B * Tq, V]: `probabilities` at T = 0, bit for bit
        y = argmax(p).view(B, Tq)                                                 # argmax p per position
        j = torch.arange(Tq, device=logits.device)
        match = (drafts[:, :kmax] == y[:, :kmax]) & (j[None, :kmax] < k[:, None])  # [B, kmax]
        a = match.to(torch.int32).cumprod(1).sum(1)                                # [B] leading matches
        tokens = torch.where(j[None, :kmax] < a[:, None], drafts[:, :kmax], -1)
        tokens = torch.cat((tokens, tokens.new_full((B, 1), -1)), 1)                # [B, Tq], -1 padded
        tokens.scatter_(1, a[:, None].long(), y.gather(1, a[:, None].long()))
        return VerifyOutput(tokens=tokens, num_accepted=a.to(torch.int32),
                            tvd_spent=torch.zeros(B, device=logits.device))

    def _stash(self, hidden: torch.Tensor, Tq: int) -> None:
        """Keep the target hidden states [B, Tq, n * H] of this step's positions L .. L + Tq − 1 of
        every running row until it drafts (positions past its new length are overwritten later).
        Rows whose stash would overflow are flushed first."""
        run, dev = self.running, self.device
        full = [i for i, r in enumerate(run) if r.length - r.ctx_len + Tq > PENDING_WINDOW]
        if full:
            self._flush(full)
        B = len(run)
        offs = [r.length - r.ctx_len for r in run]
        off = _common(offs)
        if off is not None:  # the same offset for every row: one plain copy (index_put_ costs ~8x more)
            self.pending[:B, off : off + Tq] = hidden
            return
        offs = torch.tensor(offs, device=dev)                                             # [B]
        rows = torch.arange(B, device=dev)[:, None].expand(B, Tq)
        self.pending.index_put_((rows, offs[:, None] + torch.arange(Tq, device=dev)), hidden.to(self.pending.dtype))

    def _flush(self, idx: list[int]) -> None:
        """Write the drafter-context K/V of the stashed positions [ctx_len, L) of rows `idx`."""
        run, dev = self.running, self.device
        idx = [i for i in idx if run[i].length > run[i].ctx_len]
        if not idx:
            return
        P = max(run[i].length - run[i].ctx_len for i in idx)
        bound = self.dcache.max_len
        starts = [run[i].ctx_len for i in idx]
        common = _common(starts)
        if common is not None and idx == list(range(idx[0], idx[0] + len(idx))):  # a slice of rows, one start
            # fresh contiguous tensors, as the gathered rows below are, whatever P: a compiled
            # context_kv then has the same programs for both (a slice of the stash is contiguous
            # only when P = PENDING_WINDOW, and is not an inference tensor)
            pos = torch.arange(common, common + P, device=dev).repeat(len(idx), 1)      # [n, P]
            kv = self.context_kv(self.pending[idx[0] : idx[0] + len(idx), :P].clone(), pos)
            self.dcache.write_span(kv, idx[0], common)
        else:
            rows = torch.tensor(idx, device=dev)
            start = torch.tensor(starts, device=dev)                                     # [n]
            pos = start[:, None] + torch.arange(P, device=dev)                           # [n, P]
            # a row's entries past its own count land at positions >= L: masked, overwritten later
            kv = self.context_kv(self.pending[rows, :P], pos.clamp(max=bound - 1))
            self.dcache.write_rows(kv, rows, start)
        for i in idx:
            run[i].ctx_len = run[i].length

    def _draft(self, drows, sel, s_host, anchors, lengths, temp, top_k, top_p, l2r):
        """Denoise `[anchor, MASK x K]` for rows `drows` (sel: their indices, None = all rows).
        Returns drafted tokens [Bd, K] and q [Bd, K, V], the distribution each was drawn from.

        The block's keys / values go into the drafter-context cache right after the longest
        row's context (columns C .. C + K, free: past every drafting row's length), so attention
        reads context and block in place; RoPE and the mask are built once for all passes."""
        dev, K, dr = self.device, self.block, self.drafter
        pick = (lambda t: t) if sel is None else (lambda t: None if t is None else t[sel])
        Bd = len(drows)
        L, T, tk, tp, lr = pick(lengths), pick(temp), pick(top_k), pick(top_p), pick(l2r)
        s_list = [s_host[i] for i in drows]
        s_d = torch.tensor(s_list, device=dev)
        lens = [self.running[i].length for i in drows]
        C = max(lens)
        W = C + K + 1  # context columns, then the block's
        ctx = self.dcache.views(0, Bd, W) if sel is None else self.dcache.gather(sel, W)
        dtype = dr.mask_embedding.dtype
        mask = None  # one context length: every row attends to all W columns
        if _common(lens) is None:
            cols = torch.arange(W, device=dev)
            attend = (cols[None] < L[:, None]) | (cols[None] >= C)  # [Bd, W]: own context and the block
            mask = torch.zeros(Bd, 1, W, dtype=dtype, device=dev).masked_fill_(~attend[:, None], float("-inf"))
        positions = L[:, None] + torch.arange(K + 1, device=dev)  # [Bd, K + 1]
        rope = dr.rope(positions, dtype, bound=self.dcache.max_len)
        tokens = torch.zeros(Bd, K + 1, dtype=torch.long, device=dev)
        tokens[:, 0] = pick(anchors)
        masked = torch.ones(Bd, K + 1, dtype=torch.bool, device=dev)
        masked[:, 0] = False
        s_max = max(s_list)
        q_rec = None if s_max == 1 else torch.zeros(Bd, K, self.vocab, device=dev)
        greedy = T <= 0
        all_greedy = all(self.running[i].generator is None for i in drows)  # no request samples
        u = None if all_greedy else torch.zeros(Bd, s_max, K, device=dev)  # one uniform per (step, position)
        for b, i in enumerate(drows):
            g = self.running[i].generator
            if g is not None:
                u[b, : s_list[b]].uniform_(generator=g)
        T_rep = T.repeat_interleave(K)
        tk_rep = None if tk is None else tk.repeat_interleave(K)
        tp_rep = None if tp is None else tp.repeat_interleave(K)
        for it in range(s_max):
            logits = self.draft_pass(tokens, masked, ctx, mask, *rope)  # [Bd, K, V]
            if all_greedy:  # `probabilities` at T = 0 is the plain softmax, bit for bit
                q = torch.softmax(logits, -1)
                x = argmax(q)  # [Bd, K]
            else:
                q = probabilities(logits.flatten(0, 1), T_rep, tk_rep, tp_rep).view(Bd, K, -1)
                x = torch.where(greedy[:, None], argmax(q), inverse_cdf_sample(q, u[:, it]))  # [Bd, K]
            if s_max == 1:  # one pass: every row commits its whole block
                return x, q
            c = q.gather(-1, x[..., None]).squeeze(-1)
            still = masked[:, 1:]
            left = (s_d - it).clamp(min=1)
            n_commit = torch.where(s_d > it, (still.sum(1) + left - 1) // left, 0).to(torch.int32)
            commit = select_commit(c, still, n_commit, lr)
            tokens[:, 1:] = torch.where(commit, x, tokens[:, 1:])
            q_rec = torch.where(commit[..., None], q, q_rec)
            masked[:, 1:] = still & ~commit
        return tokens[:, 1:], q_rec

    # -- helpers ------------------------------------------------------------------------
    def _reads_features(self) -> bool:
        """Whether this step's draft features (confidence, entropy, margin: a top-2 and an
        entropy over [B, K, V], ~10% of a speculative step at batch 1 on CPU) have a reader: the
        trace sink, or a decision maker that does not declare ``reads_draft_features = False``."""
        return self.trace_sink is not None or getattr(self.decisions, "reads_draft_features", True)

    def _wants_suffix(self) -> bool:
        """Whether this step computes suffix drafts: the engine has a suffix drafter, and the
        decision maker reads them (``reads_suffix``) or a running row's knobs ask for them."""
        if self.suffix is None:
            return False
        return getattr(self.decisions, "reads_suffix", False) or any(r.knobs.source == "suffix" for r in self.running)

    def _suffix_drafts(self, s_host: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The suffix drafts of rows with s = SUFFIX, padded: tokens [B, K] int64 and their vote
        shares [B, K] float32 (CPU; other rows zero)."""
        B, K = len(self.running), self.width
        tok, conf = np.zeros((B, K), np.int64), np.zeros((B, K), np.float32)
        for i, (req, s) in enumerate(zip(self.running, s_host)):
            if s == SUFFIX:
                d = req.suffix_draft
                tok[i, : len(d.tokens)], conf[i, : len(d.probs)] = d.tokens, d.probs
        return torch.from_numpy(tok), torch.from_numpy(conf)

    def _row_state(self) -> RowState:
        run = self.running
        suffix = {}
        if self._wants_suffix():  # else no row may take a suffix draft this step (steps clamp to >= 0)
            for r in run:
                r.suffix_draft = self.suffix.propose(r.suffix_index)
            suffix = dict(suffix_len=torch.tensor([len(r.suffix_draft.tokens) for r in run]),
                          suffix_score=torch.tensor([r.suffix_draft.score for r in run]),
                          suffix_match=torch.tensor([r.suffix_draft.match_len for r in run]))
        return RowState(
            request_ids=[r.request_id for r in run], knobs=[r.knobs for r in run], targets=[r.targets for r in run],
            position=torch.tensor([r.length for r in run]), generated=torch.tensor([len(r.output) for r in run]),
            temperature=torch.tensor([float(r.params.temperature) for r in run]),
            recent_accept=torch.tensor([r.recent_accept for r in run]), tvd_spent=torch.tensor([r.tvd for r in run]),
            remaining=torch.tensor([self._remaining(r) for r in run]), batch_size=len(run), block_size=self.width,
            has_drafter=self.drafter is not None, **suffix)

    def _remaining(self, req: _Request) -> int:
        return min(req.params.max_tokens - len(req.output), self.max_len - len(req.prompt) - len(req.output))

    def _sampling_tensors(self, reqs):
        dev = self.device
        temp = torch.tensor([float(r.params.temperature) for r in reqs], device=dev)
        top_k = top_p = None
        if any(r.params.top_k > 0 and r.params.temperature > 0 for r in reqs):
            top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
        if any(r.params.top_p < 1.0 and r.params.temperature > 0 for r in reqs):
            top_p = torch.tensor([float(r.params.top_p) for r in reqs], device=dev)
        return temp, top_k, top_p

    def _noise(self, reqs, counts, V, ones, uniforms=None):
        """Exp(1) noise [sum(counts), V]: request i's `counts[i]` rows drawn from its own generator
        (greedy rows: ones, unused). `uniforms` = (tensor [n], k per row) also gets each sampled
        row's k coins, drawn first."""
        total = sum(counts)
        sampled = [r.generator is not None for r in reqs]
        noise = torch.ones(total, V, device=self.device) if not all(sampled) else torch.empty(total, V, device=self.device)
        off, uoff = 0, 0
        for i, (req, c) in enumerate(zip(reqs, counts)):
            if sampled[i]:
                if uniforms is not None and uniforms[1][i]:
                    uniforms[0][uoff : uoff + uniforms[1][i]].uniform_(generator=req.generator)
                noise[off : off + c].exponential_(generator=req.generator)
            off += c
            if uniforms is not None:
                uoff += uniforms[1][i]
        return noise

    def _stop_table(self, reqs) -> torch.Tensor:
        S = max(1, max(len(r.stop_ids) for r in reqs))
        return torch.tensor([list(r.stop_ids) + [-2] * (S - len(r.stop_ids)) for r in reqs], device=self.device)

    def _emit(self, req: _Request, new: list[int], now: float) -> str | None:
        """Append tokens; returns the finish reason if the request is done."""
        req.output.extend(new)
        if req.suffix_index is not None:
            req.suffix_index.extend(new)
        req.t_last = now
        if new and new[-1] in req.stop_ids:
            return "stop"
        if self._remaining(req) <= 0:
            return "length"
        return None

    def _release(self, idx: list[int]) -> None:
        """Free the slots `idx` of the running list, moving the last slots into the holes."""
        for i in sorted(idx, reverse=True):
            req = self.running[i]
            last = len(self.running) - 1
            if i != last:
                moved = self.running[last]
                self.tcache.move(last, i, moved.length + 1)
                if self.dcache is not None:
                    self.dcache.move(last, i, moved.ctx_len + 1)
                    if moved.length > moved.ctx_len:
                        self.pending[i, : moved.length - moved.ctx_len] = self.pending[last, : moved.length - moved.ctx_len]
                self.acc_counts[i] = self.acc_counts[last]
                self.reach_counts[i] = self.reach_counts[last]
                self.running[i] = moved
            self.running.pop()
            self.requests.pop(req.request_id, None)
            if self.suffix is not None:  # its output may be copied by later requests
                self.suffix.finish(req.output)

    def _stats(self, req: _Request) -> dict:
        gen = len(req.output)
        wall = max(req.t_last - req.t_start, 1e-9)
        return {
            "tau": gen / max(req.passes, 1), "target_passes": req.passes, "tokens": gen,
            "accepted": req.accepted, "verified": req.verified,
            "accept_per_position": req.apos, "tvd_spent": req.tvd,
            "steps_used": max(req.last_knobs[0], 0), "draft_len_used": req.last_knobs[1],
            "source_used": _source_name(req.last_knobs[0], req.last_knobs[1]),
            "rules_used": Rule(req.last_knobs[2]).name, "tokens_per_s": gen / wall,
            "prompt_tokens": len(req.prompt),
        }

    def _record(self, req, i, feats, K, s, k, rule, param, param2, a, tvd, t0, t_draft, now, B, num_tokens) -> dict:
        # called after the step's commit: position / generated / recent_accept as before the step
        before = req.length - a - 1
        return {
            "v": TRACE_VERSION, "request_id": req.request_id, "step": self.step_count, "time": time.time(),
            "position": before, "generated": len(req.output),
            "temperature": float(req.params.temperature), "recent_accept": req._ema_before,
            "batch_size": B, "num_tokens": num_tokens, "steps": s, "draft_len": k, "rule": rule,
            "source": _source_name(s, k), "suffix_match": req.suffix_draft.match_len if s == SUFFIX else 0,
            "param": param, "param2": param2, "commit_order": req.knobs.commit_order,
            "confidence": feats[:K] if s else [], "entropy": feats[K : 2 * K] if s else [],
            "margin": feats[2 * K : 3 * K] if s else [], "accepted": a,
            "accept_flags": [1] * a + [0] * (k - a), "tvd_spent": tvd,
            "draft_ms": (t_draft - t0) * 1e3, "verify_ms": (now - t_draft) * 1e3, "step_ms": (now - t0) * 1e3,
        }
