"""The engine-side sections of `adapt.bench.gpu_check`: exactness, speed, cost table, host syncs,
compiled steps. Each `section_*` takes the check's `Context` and returns a dict (with a `checks`
dict of booleans where the section can fail); `gpu_check` runs them and writes the JSON.

Words: a **row** of the speed table is one way of decoding (`adapt`: our engine with the drafter's
default knobs, s = 1 and k = K; `adapt-ar`: our engine at `draft_len = 0`; `hf`: transformers
`generate`); **τ** = tokens emitted per sequence per target forward pass, the prefill's included
(`adapt.bench.speed_runners.Run.tau`, the same definition for every row); a **host sync** is a
point where the host waits for the device (docs/engine.md, "Host syncs").
"""

from __future__ import annotations

import functools
import statistics
import time
import traceback
import types
import warnings
from collections import Counter
from pathlib import Path

import torch

from adapt.bench.speed_runners import AdaptRunner, HFRunner, Run, groups_of

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = tuple(str(REPO_ROOT / d) + "/" for d in ("workers", "kernels", "adapt", "policies"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefix_agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """Mean share of each sequence's tokens before its first divergence from `ref`."""
    shares = []
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(n / max(len(b), 1))
    return sum(shares) / max(len(shares), 1)


@functools.lru_cache(maxsize=4)
def _heldout_encoded(target: str) -> tuple[tuple[int, ...], ...]:
    """The held-out stdlib files tokenised with `target`'s tokenizer (once per process)."""
    from transformers import AutoTokenizer

    from workers.training.corpus import read_texts, stdlib_files

    tok = AutoTokenizer.from_pretrained(target)
    tok.model_max_length = 1 << 30  # whole files, only cut into windows below
    return tuple(tuple(ids) for ids in tok(read_texts(stdlib_files("heldout")), add_special_tokens=False)["input_ids"])


def prompts(target: Path, vocab: int, count: int, length: int, seed: int) -> tuple[list[list[int]], str]:
    """`count` prompts of `length` tokens: windows of the held-out stdlib files ending at each
    file's middle, files spread over the sorted list (as `adapt bench speed`), or seeded random
    ids when the target has no tokenizer or too few files are long enough."""
    try:
        encoded = [ids for ids in _heldout_encoded(str(target)) if len(ids) >= 2 * length]
        if len(encoded) < count:
            raise ValueError(f"only {len(encoded)} held-out files have {2 * length} tokens")
        stride = len(encoded) / count
        out = [list(encoded[int(i * stride)][len(encoded[int(i * stride)]) // 2 - length:
                                              len(encoded[int(i * stride)]) // 2]) for i in range(count)]
        return out, "heldout stdlib windows"
    except Exception as exc:  # noqa: BLE001 - any reason falls back to random ids
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(2, vocab, (count, length), generator=g).tolist()
        return ids, f"random ids ({type(exc).__name__}: {str(exc)[:120]})"


# -- runners on a chosen device ---------------------------------------------------------------
class DeviceHFRunner(HFRunner):
    """transformers `generate` (greedy, left-padded groups) with the model on `device`."""

    def __init__(self, *args, device: torch.device, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = device

    def start(self) -> None:
        super().start()
        self.model.to(self.device)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int) -> Run:
        from transformers import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=self.pad, bos_token_id=None)
        outputs, passes, seconds = [], 0, 0.0
        for group in groups_of(prompts, batch):
            P = max(map(len, group))
            ids = torch.tensor([[self.pad] * (P - len(p)) + p for p in group], device=self.device)  # [b, P]
            mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in group], device=self.device)
            self.calls = 0
            sync(self.device)
            t = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            sync(self.device)
            seconds += time.perf_counter() - t
            passes += self.calls
            outputs.extend(out[:, P:].tolist())
        return Run(sum(map(len, outputs)), seconds, passes, len(prompts), len(groups_of(prompts, batch)), outputs)


# -- (2) greedy exactness -----------------------------------------------------------------------
def hf_greedy(target: Path, device: torch.device, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """The target's own greedy continuation of each prompt: plain transformers forwards in fp32
    with its KV cache, one prompt at a time (no batching, no padding)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `past_key_values` is renamed in later transformers
        for p in prompt_ids:
            ids = torch.tensor([p], device=device)
            past, new = None, []
            for _ in range(n):
                res = hf(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = res.logits[0, -1].argmax()
                new.append(nxt)
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
            out.append(torch.stack(new).tolist())
    del hf
    return out


def exactness_knobs(K: int):
    from workers.request import DecodeKnobs

    spec = [(1, 0, "confidence"), (1, K, "confidence"), (1, 4, "confidence"), (1, 1, "confidence"),
            (2, K, "confidence"), (2, K, "left-to-right"), (4, 8, "confidence"), (4, K, "left-to-right")]
    return [DecodeKnobs(steps=min(s, K) if k else 1, draft_len=min(k, K), commit_order=o) for s, k, o in spec]


def decode_all(engine, requests: list[tuple], join_after: int = 0) -> tuple[dict, dict]:
    """Run `requests` [(id, prompt, params, knobs)] to the end; the second half joins after
    `join_after` steps (0: all at once). Returns ({id: tokens}, {id: final stats})."""
    half = len(requests) // 2 if join_after else len(requests)
    for r in requests[:half]:
        engine.add_request(*r)
    late = list(requests[half:])
    got, stats, steps = {r[0]: [] for r in requests}, {}, 0
    while engine.has_unfinished() or late:
        if late and steps >= join_after:
            for r in late:
                engine.add_request(*r)
            late = []
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                stats[out.request_id] = out.stats
        steps += 1
    return got, stats


def section_exactness(ctx) -> dict:
    """Greedy output of the engine in fp32 on the device, token for token against transformers'
    own greedy decoding in fp32 on the same device: one batch of rows with different knobs (s, k,
    commit order; half join after 3 steps), then (full mode) a batch of default-knob rows with
    ragged prompt lengths."""
    from workers.engine import Engine, EngineConfig
    from workers.request import SamplingParams

    n_tok = 16 if ctx.quick else 48
    engine = Engine(EngineConfig(target=str(ctx.target), drafter=str(ctx.drafter), dtype="float32",
                                 device=str(ctx.device), max_batch=16, max_len=256, compile="off"))
    K = engine.block
    base, source = prompts(ctx.target, engine.vocab, 16, 48, ctx.seed)
    params = SamplingParams(max_tokens=n_tok, ignore_eos=True)
    batches = {"knob_matrix": [(f"m{i}", base[i][: 12 + 5 * i], params, kn)
                               for i, kn in enumerate(exactness_knobs(K))]}
    if not ctx.quick:
        batches["default_knobs_ragged"] = [(f"d{i}", base[i][: 8 + 2 * i], params, None) for i in range(16)]
    rows, all_match, accepted = [], True, 0
    for name, reqs in batches.items():
        got, stats = decode_all(engine, reqs, join_after=3 if name == "knob_matrix" else 0)
        want = hf_greedy(ctx.target, ctx.device, [r[1] for r in reqs], n_tok)
        for r, ref in zip(reqs, want):
            ours = got[r[0]]
            match = ours == ref
            all_match &= match
            accepted += stats[r[0]]["accepted"]
            kn = r[3]
            rows.append({"batch": name, "request": r[0], "prompt_len": len(r[1]),
                         "knobs": None if kn is None else {"steps": kn.steps, "draft_len": kn.draft_len,
                                                           "commit_order": kn.commit_order},
                         "match": match, "agreeing_prefix_share": prefix_agreement([ours], [ref]),
                         "tau": stats[r[0]]["tau"], "accepted": stats[r[0]]["accepted"]})
    return {"dtype": "float32", "max_tokens": n_tok, "block": K, "prompts": source, "rows": rows,
            "accepted_drafts_total": accepted,
            "checks": {"greedy_matches_transformers": all_match, "drafts_were_accepted": accepted > 0}}


# -- (3) speed ----------------------------------------------------------------------------------
def speed_plan(ctx) -> dict:
    if ctx.quick:
        return {"batches": (1, 2), "max_tokens": 16, "prompt_len": 32, "rounds": 1, "max_groups": 1}
    return {"batches": (1, 8, 64), "max_tokens": 128, "prompt_len": 256, "rounds": 3, "max_groups": 2}


def build_speed_runners(ctx, rows: list[str], max_batch: int, max_len: int, compile: str) -> dict:
    from workers.target_model import resolve_dtype

    made = {}
    for row in rows:
        if row == "adapt":
            made[row] = AdaptRunner(row, "adapt (default)", ctx.target, ctx.drafter, ctx.dtype, max_batch,
                                    max_len, compile=compile, device=ctx.device)
        elif row == "adapt-ar":
            made[row] = AdaptRunner(row, "adapt --draft-len 0", ctx.target, ctx.drafter, ctx.dtype, max_batch,
                                    max_len, draft_len=0, compile=compile, device=ctx.device)
        elif row == "hf":
            made[row] = DeviceHFRunner(row, "transformers generate", ctx.target, resolve_dtype(ctx.dtype, ctx.device),
                                       device=ctx.device)
        else:
            raise ValueError(f"speed rows: unknown row {row!r} (adapt, adapt-ar, hf)")
    return made


def measure_speed(ctx, runners: dict, plan: dict, prompt_ids: list[list[int]], profile: bool) -> list[dict]:
    """Every (batch, row): one short untimed warm-up, `rounds` timed runs in rotated row order
    (median tokens/s), then a profiled run of each adapt row (`PhaseProbe`, syncing at each phase
    boundary on CUDA)."""
    results = []
    names = list(runners)
    for batch in plan["batches"]:
        group = prompt_ids[: batch * plan["max_groups"]] if batch == 1 else prompt_ids[:batch]
        for name in names:
            runners[name].generate(group[:batch], batch, 4)  # warm-up: allocator, cuBLAS, first kernels
        runs = {name: [] for name in names}
        for rnd in range(plan["rounds"]):
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                runs[name].append(runners[name].generate(group, batch, plan["max_tokens"]))
        ref = runs["hf"][0].outputs if "hf" in runs else None
        for name in names:
            rs = sorted(runs[name], key=lambda r: r.tokens / max(r.seconds, 1e-9))
            med = rs[len(rs) // 2]
            rec = {"row": name, "label": runners[name].label, "batch": batch, "sequences": len(group),
                   "tokens_per_s": med.tokens / max(med.seconds, 1e-9), "ms_per_token": 1e3 * med.seconds / max(med.tokens, 1),
                   "tau": med.tau, "rounds_tokens_per_s": [r.tokens / max(r.seconds, 1e-9) for r in runs[name]],
                   "agrees_with_hf": None if ref is None else prefix_agreement(med.outputs, ref)}
            if profile and isinstance(runners[name], AdaptRunner):
                rec["phases"] = runners[name].generate(group, batch, plan["max_tokens"], profile=True).extra
            results.append(rec)
        by = {r["row"]: r["tokens_per_s"] for r in results if r["batch"] == batch}
        for a, b in (("adapt", "adapt-ar"), ("adapt", "hf"), ("adapt-ar", "hf")):
            if a in by and b in by:
                results.append({"ratio": f"{a}/{b}", "batch": batch, "value": by[a] / max(by[b], 1e-9)})
        ctx.log(f"speed batch {batch}: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in by.items()))
    return results


def section_speed(ctx) -> dict:
    """τ and tokens/s of the speculative default, our autoregressive decoding and transformers at
    batch 1, 8, 64 (quick: 1, 2), greedy, exactly `max_tokens` tokens each (EOS ignored)."""
    plan = speed_plan(ctx)
    max_b = max(plan["batches"])
    runners = build_speed_runners(ctx, ctx.speed_rows, max_b, plan["prompt_len"] + plan["max_tokens"] + 8, ctx.compile)
    for r in runners.values():
        r.start()
    vocab = next((r.engine.vocab for r in runners.values() if isinstance(r, AdaptRunner)), 1000)
    ids, source = prompts(ctx.target, vocab, max(max_b, plan["max_groups"]), plan["prompt_len"], ctx.seed)
    try:
        results = measure_speed(ctx, runners, plan, ids, profile=True)
    finally:
        for r in runners.values():
            r.close()
    ctx.shared["speed_outputs"] = results
    return {"dtype": ctx.dtype, "compile": ctx.compile, "plan": plan, "prompts": source, "results": results}


# -- (4) cost table ----------------------------------------------------------------------------
def section_cost(ctx) -> dict:
    """`adapt.controller.profile_engine` on the device (what a serving worker does at start): the
    verify table per token count, the drafter-pass table per row count, the per-step overhead.
    Written as OUT/cost_model.json (`CostModel.from_dict` reads it; extra keys are ignored)."""
    import json

    from adapt.controller import profile_engine
    from adapt.cost_model import DEFAULT_ROW_GRID, profile_token_grid
    from workers.engine import Engine, EngineConfig

    max_b = 4 if ctx.quick else 64
    engine = Engine(EngineConfig(target=str(ctx.target), drafter=str(ctx.drafter), dtype=ctx.dtype,
                                 device=str(ctx.device), max_batch=max_b, max_len=512, compile=ctx.compile))
    engine.warm_up()
    K = engine.block
    top = max_b * (K + 1)
    t0 = time.perf_counter()
    cost = profile_engine(engine, token_grid=profile_token_grid(top),
                          row_grid=[r for r in DEFAULT_ROW_GRID if r <= max(max_b, 2)],
                          repeats=2 if ctx.quick else 5, overhead_steps=3 if ctx.quick else 12)
    seconds = time.perf_counter() - t0
    data = cost.to_dict()
    data["profile"] = {"device": ctx.device_name, "dtype": str(engine.dtype).removeprefix("torch."),
                       "pair": ctx.pair, "block": K, "max_batch": max_b, "backend": engine.backend.label,
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (ctx.out / "cost_model.json").write_text(json.dumps(data, indent=1))
    ctx.shared["cost"] = cost
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_b]
    flat = {b: float(cost.verify.at(float(b * (K + 1))) / max(cost.verify.at(float(b)), 1e-9)) for b in batches}
    ys_ok = all(a <= b + 1e-9 for t in (cost.verify, cost.draft_pass) for a, b in zip(t.ys.tolist(), t.ys.tolist()[1:]))
    return {"file": "cost_model.json", "profile_seconds": seconds, "block": K,
            "verify_ms": dict(zip(cost.verify.xs.tolist(), cost.verify.ys.tolist())),
            "draft_pass_ms": dict(zip(cost.draft_pass.xs.tolist(), cost.draft_pass.ys.tolist())),
            "overhead_ms": cost.overhead_ms,
            "verify_full_block_over_one_token": flat,
            "drafting_step_over_plain_step": {b: float(cost.step_ms_at(b * (K + 1.0), [b]) / max(cost.step_ms_at(float(b)), 1e-9))
                                              for b in batches},
            "checks": {"tables_non_decreasing": ys_ok,
                       "finite_positive": all(v >= 0 for v in cost.verify.ys.tolist() + cost.draft_pass.ys.tolist())}}


# -- (5) host syncs per step --------------------------------------------------------------------
PY_VALUE_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")
TO_HOST = ("cpu",)


def _site() -> str:
    """The innermost frame of our code (workers/, kernels/, adapt/, policies/) on the stack."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        if fr.filename.startswith(CODE_DIRS) and not fr.filename.endswith("gpu_check_engine.py"):
            return f"{Path(fr.filename).relative_to(REPO_ROOT)}:{fr.lineno} {fr.name}"
    return "other"


class SyncCounter:
    """Counts, by call site, inside a `with` block:
    - `device_syncs` (CUDA only): the synchronizing CUDA operations that
      `torch.cuda.set_sync_debug_mode("warn")` reports (device-to-host reads, blocking copies,
      synchronize calls), each warning caught with its Python stack;
    - `host_reads`: calls of `Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ /
      numpy` (a tensor's value read into Python) and `to_host`: `Tensor.cpu()`, by patching those
      methods. On CUDA such a call syncs when the tensor lives on the GPU; on CPU nothing syncs,
      so this count is an upper bound of what would sync on a GPU: it includes reads of
      host-side tensors (a decision maker's CPU answers, `RowState`) that never touch a device,
      and misses blocking host-to-device copies (`torch.tensor(list, device=...)`, `.to(device)`)
      and syncs inside torch (`torch.equal`, `nonzero`), which only the CUDA count sees."""

    def __init__(self, device: torch.device):
        self.device = device
        self.device_syncs: Counter = Counter()
        self.host_reads: Counter = Counter()
        self.to_host: Counter = Counter()
        self._undo: list = []

    def __enter__(self):
        for names, counter in ((PY_VALUE_READS, self.host_reads), (TO_HOST, self.to_host)):
            for name in names:
                original = getattr(torch.Tensor, name)
                own = name in vars(torch.Tensor)

                def wrapped(t, *a, _orig=original, _count=counter, _name=name, **kw):
                    _count[f"{_name} @ {_site()}"] += 1
                    return _orig(t, *a, **kw)

                setattr(torch.Tensor, name, wrapped)
                self._undo.append((name, original if own else None))
        if self.device.type == "cuda":
            self._warn_ctx = warnings.catch_warnings()
            self._warn_ctx.__enter__()
            warnings.simplefilter("always")
            previous = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message):
                    self.device_syncs[_site()] += 1
                else:
                    previous(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self._warn_ctx.__exit__(*exc)
        for name, original in reversed(self._undo):
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._undo.clear()


def sync_scenarios(K: int):
    """(name, batch, [(params, knobs)] per row, decision maker name or None)."""
    from workers.request import DecodeKnobs, SamplingParams

    greedy = SamplingParams(max_tokens=400, ignore_eos=True)
    mixed = []
    for i in range(8):
        sampled = i % 2 == 1
        params = SamplingParams(max_tokens=400, temperature=0.8 if sampled else 0.0, seed=11 + i, ignore_eos=True,
                                top_p=0.9 if i == 3 else 1.0)
        quality = "tvd=0.1" if sampled and i % 4 == 1 else "lossless"
        knobs = DecodeKnobs(steps=1 + i % 2, draft_len=max(1, K - 3 * (i % 4)), quality=quality,
                            commit_order="left-to-right" if i % 3 == 0 else "confidence")
        mixed.append((params, knobs))
    ar = DecodeKnobs(steps=0, draft_len=0)
    return [("autoregressive, batch 1", [(greedy, ar)], None),
            ("autoregressive, batch 8", [(greedy, ar)] * 8, None),
            ("speculative default, greedy, batch 1", [(greedy, None)], None),
            ("speculative default, greedy, batch 8", [(greedy, None)] * 8, None),
            ("speculative mixed (sampled, tvd, ragged k, s 1-2), batch 8", mixed, None),
            ("adaptive policy, mixed, batch 8", mixed, "adaptive")]


def _targets(params, knobs):
    """Request targets as the policies read them (by attribute; no pydantic needed)."""
    eps = knobs.tvd_budget if knobs is not None else 0.0
    return types.SimpleNamespace(quality=types.SimpleNamespace(eps=eps, lossless=eps == 0.0),
                                 effective_tpot_ms=50.0, priority=0, tvd_budget_total=None, ttft_ms=None)


def section_syncs(ctx) -> dict:
    """Host syncs per decode step (prefill steps excluded) for a few batches: see `SyncCounter`
    for what is counted on CUDA and on CPU. docs/engine.md ("Host syncs") expects, on CUDA, one
    device sync per step with static knobs (the plan is computed on the host) and two with a
    policy that reads draft features (one packed copy of the features, then the results)."""
    from adapt.controller import build_policy
    from workers.decisions import StaticDecisions
    from workers.engine import Engine, EngineConfig

    n_steps = 4 if ctx.quick else 16
    engine = Engine(EngineConfig(target=str(ctx.target), drafter=str(ctx.drafter), dtype=ctx.dtype,
                                 device=str(ctx.device), max_batch=8, max_len=512, compile=ctx.compile))
    engine.warm_up()
    K = engine.block
    ids, _ = prompts(ctx.target, engine.vocab, 8, 48, ctx.seed)
    out = []
    for name, reqs, policy in sync_scenarios(K):
        if policy:
            cost = {"cost": ctx.shared["cost"]} if "cost" in ctx.shared else {}  # else the file's
            engine.decisions = build_policy(policy, ctx.pair_policy, **cost)
        else:
            engine.decisions = StaticDecisions()
        for i, (params, knobs) in enumerate(reqs):
            engine.add_request(f"s{i}", ids[i], params, knobs, targets=_targets(params, knobs) if policy else None)
        engine.step()  # prefill
        for _ in range(2):  # first decode steps: lazy allocations, first drafter-context flush
            engine.step()
        per_step, sites, reads, hosts = [], Counter(), Counter(), Counter()
        for _ in range(n_steps):
            with SyncCounter(ctx.device) as c:
                engine.step()
            per_step.append({"device_syncs": sum(c.device_syncs.values()), "host_reads": sum(c.host_reads.values()),
                             "to_host": sum(c.to_host.values())})
            sites.update(c.device_syncs)
            reads.update(c.host_reads)
            hosts.update(c.to_host)
        for rid in list(engine.requests):
            engine.abort(rid)
        mean = lambda key: statistics.mean(s[key] for s in per_step)  # noqa: E731
        out.append({"scenario": name, "batch": len(reqs), "steps": n_steps,
                    "device_syncs_per_step": mean("device_syncs") if ctx.device.type == "cuda" else None,
                    "host_reads_per_step": mean("host_reads"), "to_host_per_step": mean("to_host"),
                    "device_sync_sites": {k: v / n_steps for k, v in sites.most_common()},
                    "host_read_sites": {k: v / n_steps for k, v in reads.most_common()},
                    "to_host_sites": {k: v / n_steps for k, v in hosts.most_common()}})
        ctx.log(f"syncs {name}: reads {out[-1]['host_reads_per_step']:.1f}/step"
                + (f", device syncs {out[-1]['device_syncs_per_step']:.1f}/step" if ctx.device.type == "cuda" else ""))
    engine.decisions = StaticDecisions()
    method = ("torch.cuda.set_sync_debug_mode('warn'), every warning caught with its stack; plus patched "
              "Tensor reads" if ctx.device.type == "cuda" else
              "CPU: patched Tensor.item/tolist/__bool__/__int__/__float__/__index__/numpy (host_reads) and "
              "Tensor.cpu (to_host), by call site: an upper bound of GPU syncs that misses blocking "
              "host-to-device copies and syncs inside torch (see SyncCounter)")
    return {"method": method, "dtype": ctx.dtype, "scenarios": out}


# -- (7) compiled decode steps ----------------------------------------------------------------
def section_compiled(ctx) -> dict:
    """The engine's compiled decode steps (`compile="on"`: torch.compile/inductor; the engine has no
    CUDA-graph path, and `compile="auto"` loads a built package or runs eager steps:
    workers/backends.py): warm-up time, then the speed plan's batches for `adapt` and `adapt-ar`,
    with agreement against the eager rows of the speed section (bf16 numerics differ between
    compiled and eager programs, so agreement, not equality)."""
    from workers.backends import resolve_backend

    plan = speed_plan(ctx)
    max_b = max(plan["batches"])
    runners = build_speed_runners(ctx, ["adapt", "adapt-ar"], max_b, plan["prompt_len"] + plan["max_tokens"] + 8, "on")
    warm = {}
    for name, r in runners.items():
        t0 = time.perf_counter()
        r.start()
        warm[name] = {"seconds": time.perf_counter() - t0, **r.warm_up}
        ctx.log(f"compiled {name}: started and warmed up in {warm[name]['seconds']:.0f} s")
    ids, source = prompts(ctx.target, runners["adapt"].engine.vocab, max(max_b, plan["max_groups"]),
                          plan["prompt_len"], ctx.seed)
    try:
        results = measure_speed(ctx, runners, plan, ids, profile=False)
    finally:
        for r in runners.values():
            r.close()
    eager = {(r["row"], r["batch"]): r for r in ctx.shared.get("speed_outputs", []) if "row" in r}
    for r in results:
        e = eager.get((r.get("row"), r.get("batch")))
        if e is not None:
            r["eager_tokens_per_s"] = e["tokens_per_s"]
            r["compiled_over_eager"] = r["tokens_per_s"] / max(e["tokens_per_s"], 1e-9)
    return {"auto_resolves_to": resolve_backend("auto", ctx.device).name, "dtype": ctx.dtype, "warm_up": warm,
            "prompts": source, "results": results}
