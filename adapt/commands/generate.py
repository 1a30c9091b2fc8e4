"""`adapt generate "PROMPT"`: decode one prompt with the speculative-diffusion engine.

    adapt generate --chat "Write a Python function that checks whether a number is prime."
    adapt generate "def fibonacci(n):" --pair demo --max-tokens 64 --json
    adapt generate "import os" --pair demo --steps 2 --draft-len 8 --quality tvd=0.05 --temperature 0.8 --seed 1
    adapt generate "x = 1" --draft-len 0          # autoregressive, same engine (no drafter loaded)
    adapt generate "..." --target DIR --drafter DIR   # or --drafter none

Models come from a named pair (workers/pairs.py): `smollm2` by default (SmolLM2-135M-Instruct,
pulled into the cache on first use; its drafter when the repository has one, else autoregressive)
or `demo` (models/demo). `--chat MESSAGE` renders one user message with the target's chat
template and stops at the template's end-of-turn token (not part of the text). With --json it
prints one object: text, token_ids (generated only) and stats (tau = tokens per target forward
pass, target_passes, tokens, tokens_per_s = generated tokens / wall time from prefill start to the
last token, model loading excluded, accept_per_position, tvd_spent, ...; dtype_choice: the dtype
and why, cost_profile: whether the adaptive policy's cost profile was read back or timed,
adapt/profile_cache.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adapt.commands import add_pair_arguments
from workers.request import COMPILE_CHOICES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="decode a prompt with speculative diffusion (or autoregressively)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (or --chat MESSAGE)")
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="a user message, rendered with the target's chat template; stops at its end-of-turn token")
    add_pair_arguments(p)
    p.add_argument("--policy", default="auto", choices=["auto", "adaptive", "static"],
                   help="who picks s, k and the rule on every pass: 'adaptive' = the adaptive policy with the "
                        "pair's fitted policy file and a cost model profiled on this engine at start (what "
                        "adapt serve runs); 'static' = the knobs below; 'auto' (default) = adaptive when the "
                        "pair ships a policy file and no knob below is given, else static")
    p.add_argument("--steps", type=int, default=None,
                   help="diffusion (denoising) steps per drafted block, s >= 1 (static; default 1); given, it is "
                        "pinned: the adaptive policy keeps it too (workers/pins.py)")
    p.add_argument("--draft-len", type=int, default=None,
                   help="drafted tokens verified per step, k (static; default: the drafter's block size; "
                        "0 = autoregressive); given, it is pinned: the adaptive policy keeps it too")
    p.add_argument("--quality", default=None,
                   help="'lossless' (default) or 'tvd=E' (lenient, <= E TVD per token); the adaptive policy "
                        "keeps within it too")
    p.add_argument("--commit-order", default="confidence", choices=["confidence", "left-to-right"],
                   help="which masked positions each denoising step commits")
    p.add_argument("--draft-source", default=None, choices=["diffusion", "suffix", "none"],
                   help="where drafts come from: the diffusion drafter (default), the suffix drafter (text copied "
                        "from the prompt and output; no drafter is loaded) or none; given, it is pinned")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = on a CPU, the faster of bfloat16 and float32 for this machine's decode steps, "
                        "measured once and kept in the cache directory (adapt/dtype_choice.py); on a GPU bfloat16 "
                        "(float16 where it has no bfloat16)")
    p.add_argument("--reprofile", action="store_true",
                   help="time this machine again: the cost profile the adaptive policy starts from and the "
                        "--dtype auto choice (both are kept in the cache directory, adapt/profile_cache.py)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--huge-pages", action="store_true",
                   help="move the loaded weights onto huge pages first (workers/huge_pages.py: ~3 s for SmolLM2, "
                        "then ~1.1x faster decoding; pays for long outputs; `adapt serve` does it by default)")
    p.add_argument("--compile", default="auto", choices=COMPILE_CHOICES,
                   help="compiled decode steps: auto = the package `adapt compile` built for this model "
                        "(workers/aot.py; ~1.7x faster steps on a CPU, loaded in a second), else eager; aot = "
                        "the package, built first when missing (a minute or two, once); on = torch.compile in "
                        "this process (minutes, every time); off = eager")
    p.add_argument("--trace", type=Path, default=None, help="write per-step trace records (JSON Lines) here")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    p.set_defaults(run=run)


def _model_dirs(args) -> tuple[Path, Path | None, Path | None]:
    from workers.pairs import resolve_models

    target, drafter, policy_file = resolve_models(args.pair, args.target, args.drafter, args.cache_dir)
    if args.draft_len == 0 or args.draft_source in ("suffix", "none"):  # no diffusion drafts: no drafter needed
        drafter = None
    for name, path, flag in (("target", target, "--target"), ("drafter", drafter, "--drafter")):
        if path is not None and not (Path(path) / "config.json").is_file():
            which = f"{args.pair} pair's " if getattr(args, name) is None else ""
            raise ValueError(f"{flag}: {which}{name} model directory {str(path)!r} not found (no config.json)")
    return target, drafter, policy_file


def _use_adaptive(args, drafter, policy_file) -> bool:
    """Whether the adaptive policy decides (see --policy)."""
    if args.policy == "static" or drafter is None:
        return False
    if args.policy == "adaptive":
        return True
    return policy_file is not None and args.steps is None and args.draft_len is None and args.draft_source is None


def run(args) -> int:
    try:
        return _run(args)
    except ValueError as exc:
        print(f"adapt generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import torch

    from workers.engine import Engine, EngineConfig
    from workers.request import DecodeKnobs, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if (args.prompt is None) == (args.chat is None):
        raise ValueError("give either a prompt or --chat MESSAGE")
    target, drafter, policy_file = _model_dirs(args)
    adaptive = _use_adaptive(args, drafter, policy_file)
    steps, quality = args.steps or 1, args.quality or "lossless"
    sink = None
    if args.trace:
        from workers.traces import FileTraceSink

        sink = FileTraceSink(args.trace)
    def make_engine(dtype: str) -> Engine:
        built = Engine(EngineConfig(target=target, drafter=drafter, dtype=dtype, device=args.device, max_batch=1,
                                    compile=args.compile, huge_pages=args.huge_pages), trace_sink=sink)
        built.warm_up()
        return built

    dtype_choice = None
    if args.dtype == "auto" and _on_cpu(args.device):
        from adapt.dtype_choice import choice_facts, choose_dtype

        engine, dtype_choice = choose_dtype(make_engine, choice_facts(target, drafter, args.compile), args.cache_dir,
                                            refresh=args.reprofile)
    else:
        engine = make_engine(args.dtype)
    source = args.draft_source or "diffusion"
    draft_len = (engine.width if source == "suffix" else engine.block) if args.draft_len is None else args.draft_len
    given = {"steps": args.steps, "draft_len": args.draft_len, "source": args.draft_source}
    knobs = DecodeKnobs(steps=steps, draft_len=draft_len, quality=quality, commit_order=args.commit_order,
                        source=source, pinned=frozenset(k for k, v in given.items() if v is not None))
    profile_info = None
    if adaptive:
        from adapt.controller import build_policy
        from adapt.profile_cache import engine_profile

        # the policy decides s, k and the rule of every pass, within the request's quality target,
        # starting from this machine's stored cost profile (timed once per machine and model)
        cost, profile_info = engine_profile(engine, args.cache_dir, refresh=args.reprofile)
        engine.decisions = build_policy("adaptive", policy_file, cost=cost)
    tok = engine.tokenizer
    prompt, stops = args.prompt, ()
    if args.chat is not None:
        from workers.chat import chat_prompt_ids, stop_ids

        prompt = chat_prompt_ids(tok, [{"role": "user", "content": args.chat}])
        stops = () if args.ignore_eos else stop_ids(tok, chat=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_token_ids=stops, ignore_eos=args.ignore_eos)
    targets = None
    if adaptive:
        from adapt.targets import RequestTargets

        targets = RequestTargets(quality=quality)
    engine.add_request("cli", prompt, params, knobs, targets=targets)
    token_ids, stats, reason = [], {}, None
    stream = not args.json
    while engine.has_unfinished():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            stats, reason = out.stats, out.finish_reason
            if stream:
                sys.stdout.write(tok.decode(token_ids, skip_special_tokens=True)[len(tok.decode(token_ids[: len(token_ids) - len(out.new_token_ids)], skip_special_tokens=True)):])
                sys.stdout.flush()
    # the stop token ends token_ids (finish_reason "stop") but is never part of the text
    ended = set(stops) | set(() if args.ignore_eos else engine.eos_token_ids)
    shown = token_ids[:-1] if reason == "stop" and token_ids and token_ids[-1] in ended else token_ids
    text = tok.decode(shown, skip_special_tokens=True)
    stats = dict(stats, finish_reason=reason, dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
                 policy="adaptive" if adaptive else "static", quality=quality, backend=engine.backend.label,
                 huge_pages=engine.huge_pages,
                 decode_steps=_step_kind(engine),
                 **({} if adaptive else {"steps": steps, "draft_len": draft_len, "commit_order": args.commit_order,
                                         "draft_source": source}),
                 **_machine_stats(args.dtype, dtype_choice, profile_info))
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "stats": stats}))
    else:
        print()
        print(f"[{stats['tokens']} tokens, tau {stats['tau']:.2f}, {stats['tokens_per_s']:.0f} tok/s, "
              f"tvd spent {stats['tvd_spent']:.3f}, decode steps: {stats['decode_steps']}, {reason}]", file=sys.stderr)
    return 0


def _step_kind(engine) -> str:
    """How the decode steps ran: "compiled packages" (the target's and the drafter's), "compiled
    package" (the target's; eager drafter passes), "torch.compile" or "eager"."""
    return {"aot+drafter": "compiled packages", "aot": "compiled package", "compiled": "torch.compile",
            "eager": "eager"}[engine.backend.label]


def _on_cpu(device: str) -> bool:
    import torch

    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device).type == "cpu"


def _machine_stats(asked: str, dtype_choice, profile_info) -> dict:
    """What `--json` stats say about the dtype and the cost profile: chosen how, and why."""
    out = {}
    if dtype_choice is not None:
        out["dtype_choice"] = {"dtype": dtype_choice["dtype"], "reason": dtype_choice["reason"],
                               "cached": dtype_choice["cached"]}
    else:
        out["dtype_choice"] = {"reason": "given (--dtype)" if asked != "auto" else
                               "auto on a GPU: bfloat16, float16 where the GPU has no bfloat16"}
    if profile_info is not None:
        out["cost_profile"] = {"cached": profile_info["cached"], "built_s": profile_info["built_s"],
                               "path": profile_info["path"]}
    return out
