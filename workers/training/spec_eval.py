"""Evaluate a drafter by real, exact speculative decoding against its target (a plain batched loop).

Each **pass** verifies one drafted block per row with one target forward and emits the accepted
drafts plus one target token (the correction at the first rejection, or the bonus token when all
K drafts are accepted), so **τ** = emitted tokens / passes. **Per-position acceptance** at block
index j is the conditional rate: passes that accepted draft j / passes that reached it. Outputs
that collapse into a repetition loop are easy to draft, so τ is also reported over the outputs
that do not loop (`tau_no_loop`, with `loop_share`; outputs of at least 80 tokens).

Verification is the engine's: the exact rule `kernels.rules.exact_rules` picks (GREEDY at
temperature 0; REJECTION against the q each draft was drawn from where q is the proposal's true
conditional, s = 1 or left-to-right commits; MATCH otherwise, exact for any drafter), verified by
`kernels.verify_greedy` (GREEDY, on the padded block, as `workers.verification.Verifier.greedy`)
or `kernels.verify` (sampled rules, one draw uniform per row and pass), so the output has the
target's distribution and τ is what the engine would measure with the same drafts.

A measuring harness for training (batched, KV-cached, one target forward per pass), not the
serving engine (`workers/engine.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kernels import rule_name, verify, verify_greedy
from kernels.reference import inverse_cdf
from kernels.rules import Rule, exact_rules
from workers.drafter import BlockDiffusionDrafter, context_features
from workers.training.target_eval import LOOP_WINDOW, MAX_PERIOD, is_loop


@dataclass
class SpecEvalResult:
    steps: int
    temperature: float
    commit_order: str          # "confidence" | "left-to-right"
    rule: str                  # "greedy" | "rejection" | "match"
    tau: float                 # emitted tokens per verification pass
    passes: int
    tokens: int
    accept_per_position: list[float]  # conditional acceptance at block index 1..K
    loop_share: float | None = None   # share of outputs whose tail is a repetition loop (target_eval.is_loop)
    tau_no_loop: float | None = None  # τ over the outputs that do not loop (None: all loop)

    def to_dict(self) -> dict:
        return asdict(self)


def verify_block(p_logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, rule: int, temperature: float,
                 gen: torch.Generator):
    """(accepted [B] int64, emitted token after them [B] int64) of one pass: every row verifies
    its K drafts (drafts [B, K], q [B, K, V]) against p_logits [B, K + 1, V] under `rule`, with
    the engine's verification (`kernels.verify_greedy` / `kernels.verify`)."""
    B, T, V = p_logits.shape
    K, dev = T - 1, p_logits.device
    if rule == Rule.GREEDY:
        out = verify_greedy(p_logits.argmax(-1), drafts, torch.full((B,), K, device=dev))
    else:
        p = torch.softmax(p_logits / temperature, -1).float().reshape(B * T, V).contiguous()   # [B (K + 1), V]
        draft_probs = q.float().reshape(B * K, V).contiguous() if rule == Rule.REJECTION else None
        coins = torch.rand(B * K, generator=gen).to(dev)                               # [B K]
        draw_u = torch.rand(B, generator=gen).to(dev)                                  # [B] one per row
        zeros = torch.zeros(B, device=dev)
        out = verify(drafts.reshape(-1).contiguous(), torch.arange(0, B * K + 1, K, dtype=torch.int32, device=dev),
                     p, draft_probs, torch.full((B,), int(rule), dtype=torch.int32, device=dev), zeros, zeros,
                     coins, draw_u, K, noise_rows=torch.arange(B, device=dev).repeat_interleave(T), check=False)
    m = out.num_accepted.long()                                                        # [B]
    return m, out.tokens.gather(1, m[:, None])[:, 0]


def _cache_arg(target) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"


@torch.no_grad()
def speculative_decode(target, drafter: BlockDiffusionDrafter, prompts: list[list[int]], new_tokens: int,
                       steps: int = 1, temperature: float = 0.0, left_to_right: bool = False,
                       block_size: int | None = None, seed: int = 0, autocast: bool = True,
                       pad_id: int = 0) -> tuple[list[list[int]], SpecEvalResult]:
    """Generate `new_tokens` per prompt by exact speculative decoding; returns outputs and stats.

    The target keeps a KV cache that grows by K + 1 entries per pass; rejected drafts stay in it
    as holes, masked out by the attention mask (`valid`), and positions are passed explicitly, so
    ragged acceptance needs no re-packing. The drafter's context K/V grows the same way."""
    from transformers import DynamicCache

    K = block_size or drafter.config.block_size
    device = drafter.mask_embedding.device
    gen = torch.Generator().manual_seed(seed)
    ids = drafter.config.target_layer_ids
    rule = int(exact_rules(torch.tensor([float(temperature)]), torch.tensor([steps == 1 or left_to_right]))[0])
    acc_count = torch.zeros(K, dtype=torch.long)
    reach_count = torch.zeros(K, dtype=torch.long)
    passes = emitted = 0
    B = len(prompts)
    row_passes = torch.zeros(B, dtype=torch.long)
    row_emitted = torch.zeros(B, dtype=torch.long)
    outputs: list[list[int]] = [[] for _ in prompts]
    cache, cache_arg = DynamicCache(), _cache_arg(target)

    def forward(tokens, valid, positions):
        out = target(input_ids=tokens, attention_mask=valid.long(), position_ids=positions, use_cache=True,
                     output_hidden_states=True, **{cache_arg: cache})
        feats = context_features(out.hidden_states, ids)
        return feats, out.logits.float()

    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        # prefill (left-padded); the first generated token is the first anchor
        width = max(len(p) for p in prompts)
        tokens = torch.full((B, width), pad_id, dtype=torch.long)
        valid = torch.zeros(B, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p):] = torch.tensor(p)
            valid[i, width - len(p):] = True
        tokens, valid = tokens.to(device), valid.to(device)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        feats, logits = forward(tokens, valid, positions)
        ctx_kv = drafter.context_kv(feats.masked_fill(~valid[..., None], 0.0), positions)
        last = logits[:, -1]
        if temperature == 0:
            anchor = last.argmax(-1)                                    # [B]
        else:  # drawn as the engine draws a row's first token (`workers.verification.next_tokens`)
            anchor = inverse_cdf(torch.softmax(last / temperature, -1).float(), torch.rand(B, generator=gen).to(device))[0]
        start = valid.sum(-1)                                           # [B] position of the anchor
        for i, t in enumerate(anchor.tolist()):
            outputs[i].append(t)
        active = torch.tensor([new_tokens > 1] * B, device=device)
        idx = torch.arange(K, device=device)
        while bool(active.any()):
            uniforms = torch.rand(B, steps, K, generator=gen).to(device) if temperature > 0 else None
            drafts, q = drafter.draft(anchor, start, ctx_kv, valid, steps=steps, left_to_right=left_to_right,
                                      temperature=temperature, uniforms=uniforms, block_size=K)  # [B, K], [B, K, V]
            block = torch.cat((anchor[:, None], drafts), 1)                  # [B, K + 1]
            block_pos = start[:, None] + torch.arange(K + 1, device=device)  # [B, K + 1]
            feats, p_logits = forward(block, torch.cat((valid, torch.ones_like(block, dtype=torch.bool)), 1), block_pos)
            m, out_tok = verify_block(p_logits, drafts, q, rule, temperature, gen)  # [B] accepted, correction or bonus
            counted = active[:, None]
            reach_count += ((m[:, None] >= idx) & counted).sum(0).cpu()
            acc_count += ((m[:, None] > idx) & counted).sum(0).cpu()
            passes += int(active.sum())
            emitted += int(((m + 1) * active).sum())
            row_passes += active.long().cpu()
            row_emitted += ((m + 1) * active).cpu()
            # the anchor and the accepted drafts become context; rejected drafts stay as holes
            new_valid = torch.arange(K + 1, device=device)[None] <= m[:, None]  # [B, K + 1]
            valid = torch.cat((valid, new_valid), 1)
            new_kv = drafter.context_kv(feats.masked_fill(~new_valid[..., None], 0.0), block_pos)
            ctx_kv = [(torch.cat((k, nk), 2), torch.cat((v, nv), 2)) for (k, v), (nk, nv) in zip(ctx_kv, new_kv)]
            for i, (on, mb, tok, d) in enumerate(zip(active.tolist(), m.tolist(), out_tok.tolist(), drafts.tolist())):
                if on:
                    outputs[i].extend(d[:mb] + [tok])
            active = active & torch.tensor([len(o) < new_tokens for o in outputs], device=device)
            start = start + m + 1
            anchor = out_tok
    rates = (acc_count.float() / reach_count.clamp(min=1).float()).tolist()
    outputs = [o[:new_tokens] for o in outputs]
    loop_share = tau_no_loop = None
    if new_tokens >= LOOP_WINDOW + MAX_PERIOD:
        loops = is_loop(torch.tensor(outputs))                          # [B]
        loop_share = loops.float().mean().item()
        if not loops.all():
            tau_no_loop = row_emitted[~loops].sum().item() / max(1, row_passes[~loops].sum().item())
    result = SpecEvalResult(steps, float(temperature), "left-to-right" if left_to_right else "confidence",
                            rule_name(rule).lower(),
                            emitted / max(1, passes), passes, emitted, [round(r, 4) for r in rates],
                            loop_share, tau_no_loop)
    return outputs, result


def format_result(r: dict) -> str:
    """One line per evaluated setting, as the training log prints it."""
    no_loop = "" if r.get("tau_no_loop") is None else f" (no-loop {r['tau_no_loop']:.3f}, loops {r['loop_share']:.0%})"
    return (f"T={r['temperature']:g} s={r['steps']} {r['commit_order']:<13} {r['rule']:<9} tau={r['tau']:.3f}{no_loop} "
            f"accept={[round(a, 2) for a in r['accept_per_position']]}")


def evaluate_drafter(target, drafter, prompts: list[list[int]], new_tokens: int, steps_list=(1, 2, 4),
                     temperatures=(0.0, 1.0), seed: int = 0, autocast: bool = True, progress: bool = True,
                     pad_id: int = 0) -> list[dict]:
    """τ and per-position acceptance for every (temperature, s, commit order) combination that
    has an exact rule: greedy with both orders; temperature > 0 with left-to-right commits."""
    from tqdm import tqdm

    configs = []
    for t in temperatures:
        for s in steps_list:
            orders = [False] if s == 1 else ([False, True] if t == 0 else [True])
            configs += [(t, s, o) for o in orders]
    results = []
    for t, s, l2r in tqdm(configs, desc="evaluate", disable=not progress):
        _, res = speculative_decode(target, drafter, prompts, new_tokens, steps=s, temperature=t,
                                    left_to_right=l2r, seed=seed, autocast=autocast, pad_id=pad_id)
        results.append(res.to_dict())
    return results


def main(argv=None) -> int:
    """`python -m workers.training.spec_eval --target DIR --drafter DIR [--out eval.json]`."""
    import argparse
    import json
    from pathlib import Path

    from workers.drafter import load_drafter
    from workers.training.drafter import load_target
    from workers.training.regenerate import random_windows, resolve_data, token_stream

    p = argparse.ArgumentParser(description="Evaluate a drafter by exact speculative decoding on held-out text.")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--eval-data", nargs="*", default=None, help="default: the stdlib held-out split")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target)
    drafter = load_drafter(args.drafter, target.config).bind(target.get_input_embeddings(), target.get_output_embeddings())
    drafter.eval()
    stream = token_stream(tokenizer, resolve_data(args.eval_data, "heldout"))
    prompts = random_windows(stream, args.prompts, args.prompt_len, torch.Generator().manual_seed(args.seed + 1)).tolist()
    results = evaluate_drafter(target, drafter, prompts, args.new_tokens, seed=args.seed, autocast=not args.fp32,
                               pad_id=tokenizer.pad_token_id or 0)
    for r in results:
        print(format_result(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"eval": results, "eval_setup": {k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
