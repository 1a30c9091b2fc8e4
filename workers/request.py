"""What a caller hands the engine per request, what it gets back, and the errors it may see.

- `SamplingParams`: how tokens are drawn (temperature 0 = greedy) and when to stop.
- `DecodeKnobs`: the request's static decoding knobs: diffusion steps `s`, draft length `k`,
  quality (`lossless` or a per-token TVD budget `tvd=E`), commit order of the denoising steps,
  draft source, and which of them the caller **pinned** (fixed over any policy: workers/pins.py).
- `RequestOutput`: the tokens a request got in one engine step, plus its running stats.

All validation errors are `ValueError` subclasses whose message names the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers import draft_sources

COMPILE_CHOICES = ("auto", "on", "off", "aot")  # EngineConfig.compile and the CLIs' --compile (workers/backends.py)


class EngineInputError(ValueError):
    """A request or knob value is invalid; the message names the field."""


class PromptTooLongError(EngineInputError):
    pass


class ModelLoadError(ValueError):
    """A model directory is missing, unreadable, or of an unsupported family."""


COMMIT_ORDERS = ("confidence", "left-to-right")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise EngineInputError(msg)


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate; temperature: 0 = greedy; top_p in (0, 1]; top_k: 0 = off;
    seed: a seeded request draws all its randomness from its own generator, so its output does not
    depend on what else is in the batch; stop_token_ids: stop after emitting one of these (the
    target's EOS ids are added unless ignore_eos)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be in [0, 100], got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


PIN_FIELDS = ("steps", "draft_len", "source", "commit_order")  # the knobs a request may pin


@dataclass(frozen=True)
class DecodeKnobs:
    """steps: diffusion steps s per block (0 = no drafting: autoregressive); draft_len: drafted
    tokens verified per step (0 = autoregressive; capped at the drafter's block size); quality:
    'lossless' (exact rules only) or 'tvd=E' (lenient, spends at most E total variation per token);
    commit_order: which masked positions each denoising step commits ('confidence' = most
    confident first, 'left-to-right'); source: where drafts come from, 'diffusion' (the drafter,
    `steps` denoising passes), 'suffix' (copied from earlier text, workers/suffix.py; `steps`
    unused, `draft_len` caps the draft, verified with exact rules only), 'none' (no drafts), or
    any other registered source (workers/draft_sources.py).
    pinned: the names (of `PIN_FIELDS`) the caller fixed: the engine holds every step of the
    request to them whatever its decision maker answers (workers/pins.py); the others are the
    decision maker's. `DecodeKnobs.pin(...)` pins exactly the knobs it is given. The default
    decision maker (`StaticDecisions`) uses every knob as if pinned."""

    steps: int = 1
    draft_len: int = 16
    quality: str = "lossless"
    commit_order: str = "confidence"
    source: str = "diffusion"
    pinned: frozenset = frozenset()

    @classmethod
    def pin(cls, **knobs) -> "DecodeKnobs":
        """Knobs with exactly the given ones pinned (``quality`` may be given too; it is always the
        request's own and never a pin)."""
        return cls(**knobs, pinned=frozenset(knobs) - {"quality"})

    def __post_init__(self):
        pinned = frozenset(self.pinned)
        _check(pinned <= set(PIN_FIELDS), f"pinned must name knobs of {PIN_FIELDS}, got {sorted(pinned)}")
        object.__setattr__(self, "pinned", pinned)
        sources = draft_sources.names()
        _check(self.source in sources, f"source must be one of {sources}, got {self.source!r}")
        _check(isinstance(self.steps, int) and 0 <= self.steps <= 64, f"steps must be an integer in [0, 64], got {self.steps!r}")
        _check(isinstance(self.draft_len, int) and 0 <= self.draft_len <= 64,
               f"draft_len must be an integer in [0, 64], got {self.draft_len!r}")
        _check(self.commit_order in COMMIT_ORDERS, f"commit_order must be one of {COMMIT_ORDERS}, got {self.commit_order!r}")
        self.tvd_budget  # validates quality

    @property
    def lossless(self) -> bool:
        return self.quality == "lossless"

    @property
    def tvd_budget(self) -> float:
        """Per-token TVD budget E of `tvd=E` (0.0 for lossless)."""
        if self.quality == "lossless":
            return 0.0
        ok = isinstance(self.quality, str) and self.quality.startswith("tvd=")
        try:
            eps = float(self.quality[4:]) if ok else -1.0
        except ValueError:
            eps = -1.0
        _check(0.0 < eps <= 1.0, f"quality must be 'lossless' or 'tvd=E' with E in (0, 1], got {self.quality!r}")
        return eps


@dataclass
class RequestOutput:
    """Tokens a request received in one engine step. `stats` holds tau (tokens per target pass),
    target_passes, tokens, accept_per_position (conditional acceptance of draft position j given
    that positions < j were accepted), tvd_spent, steps_used / draft_len_used / source_used /
    rules_used (what most of its decode steps so far used), last_step (this step's), decode_stats
    (per-step counts, pins and clamps: workers/decode_log.py) and tokens_per_s."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stats: dict = field(default_factory=dict)
    error: str | None = None
