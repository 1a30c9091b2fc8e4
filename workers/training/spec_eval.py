"""Evaluate a drafter by real, exact speculative decoding against its target (a plain batched loop).

Each **pass** verifies one drafted block per row with one target forward and emits the accepted
drafts plus one target token (the correction at the first rejection, or the bonus token when all
K drafts are accepted), so **τ** = emitted tokens / passes. **Per-position acceptance** at block
index j is the conditional rate: passes that accepted draft j / passes that reached it.

Verification rules (all exact, so the output has the target's distribution):
- temperature 0: greedy, accept while the draft equals the target's argmax.
- temperature > 0 with s = 1 or left-to-right commits: rejection sampling against the q each
  draft token was drawn from (then q is the proposal's true conditional).
- temperature > 0 with most-confident-first commits and s > 1: match verification (draw the
  target's own token at every position, accept while equal), exact for any drafter.

The loop recomputes the target over the whole sequence each pass (no KV cache): it is a
measuring harness for training, not the serving engine (`workers/engine.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from workers.drafter import BlockDiffusionDrafter, context_features


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

    def to_dict(self) -> dict:
        return asdict(self)


def _target_forward(target, rows: list[list[int]], layer_ids: list[int], pad_id: int, device):
    """Left-padded forward over token lists: feats [B, W, n*H], logits [B, W, V], valid [B, W], pos [B, W]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        valid[i, width - len(r):] = True
    ids, valid = ids.to(device), valid.to(device)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    out = target(input_ids=ids, attention_mask=valid.long(), position_ids=pos, output_hidden_states=True)
    feats = context_features(out.hidden_states, layer_ids).masked_fill(~valid[..., None], 0.0)  # pads: no NaN
    return feats, out.logits.float(), valid, pos


def _race(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sample from probs [..., V] by the exponential race (argmax of p / Exp(1))."""
    noise = torch.empty(probs.shape).exponential_(1, generator=gen).to(probs.device)
    return (probs / noise).argmax(-1)


@torch.no_grad()
def speculative_decode(target, drafter: BlockDiffusionDrafter, prompts: list[list[int]], new_tokens: int,
                       steps: int = 1, temperature: float = 0.0, left_to_right: bool = False,
                       block_size: int | None = None, seed: int = 0, autocast: bool = True,
                       pad_id: int = 0) -> tuple[list[list[int]], SpecEvalResult]:
    """Generate `new_tokens` per prompt by exact speculative decoding; returns outputs and stats."""
    K = block_size or drafter.config.block_size
    device = drafter.mask_embedding.device
    gen = torch.Generator().manual_seed(seed)
    ids = drafter.config.target_layer_ids
    rule = "greedy" if temperature == 0 else ("rejection" if steps == 1 or left_to_right else "match")
    acc_count = torch.zeros(K, dtype=torch.long)
    reach_count = torch.zeros(K, dtype=torch.long)
    passes = emitted = 0
    outputs: list[list[int]] = [[] for _ in prompts]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        # prefill: the first generated token is the first anchor
        feats, logits, valid, pos = _target_forward(target, prompts, ids, pad_id, device)
        last = logits[:, -1]
        first = last.argmax(-1) if temperature == 0 else _race(torch.softmax(last / temperature, -1), gen)
        seqs = [list(p) + [t] for p, t in zip(prompts, first.tolist())]
        for i, t in enumerate(first.tolist()):
            outputs[i].append(t)
        active = list(range(len(prompts)))
        while active:
            B = len(active)
            anchor = torch.tensor([seqs[i][-1] for i in active], device=device)
            start = torch.tensor([len(seqs[i]) - 1 for i in active], device=device)
            kv = drafter.context_kv(feats, pos)
            noise = None
            if temperature > 0:
                noise = torch.empty(steps, B, K, drafter.config.vocab_size).exponential_(1, generator=gen).to(device)
            drafts, q = drafter.draft(anchor, start, kv, valid, steps=steps, left_to_right=left_to_right,
                                      temperature=temperature, exp_noise=noise, block_size=K)  # [B, K], [B, K, V]
            rows = [seqs[i] + d for i, d in zip(active, drafts.tolist())]
            feats, logits, valid, pos = _target_forward(target, rows, ids, pad_id, device)
            p_logits = logits[:, -K - 1:]  # [B, K + 1, V]: predicts draft 1..K, then the bonus
            if rule == "greedy":
                y = p_logits.argmax(-1)                                 # [B, K + 1]
                accept = drafts == y[:, :K]
            else:
                p = torch.softmax(p_logits / temperature, -1)
                if rule == "match":
                    y = _race(p, gen)
                    accept = drafts == y[:, :K]
                else:
                    px = p[:, :K].gather(-1, drafts[..., None])[..., 0]
                    qx = q.gather(-1, drafts[..., None])[..., 0]
                    u = torch.rand(B, K, generator=gen).to(device)
                    accept = u * qx < px
                    resid = torch.cat(((p[:, :K] - q).clamp(min=0), p[:, K:]), 1)  # [B, K + 1, V]
                    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
                    y = _race(resid, gen)
            m = accept.long().cumprod(-1).sum(-1)                       # [B] accepted drafts
            out_tok = y.gather(1, m[:, None])[:, 0]                     # correction or bonus
            idx = torch.arange(K, device=device)
            reach_count += (m[:, None] >= idx).sum(0).cpu()
            acc_count += (m[:, None] > idx).sum(0).cpu()
            passes += B
            emitted += int(m.sum()) + B
            keep = []
            for b, (i, mb, tok, d) in enumerate(zip(active, m.tolist(), out_tok.tolist(), drafts.tolist())):
                new = d[:mb] + [tok]
                seqs[i].extend(new)
                outputs[i].extend(new)
                if len(outputs[i]) < new_tokens:
                    keep.append(b)
            # the next context: this forward's positions up to the last accepted draft
            anchor_col = valid.shape[1] - K - 1
            cols = torch.arange(valid.shape[1], device=device)
            valid = valid & (cols[None] <= anchor_col + m[:, None])
            keep_t = torch.tensor(keep, dtype=torch.long, device=device)
            feats, valid, pos = feats[keep_t], valid[keep_t], pos[keep_t]
            active = [active[b] for b in keep]
    rates = (acc_count.float() / reach_count.clamp(min=1).float()).tolist()
    result = SpecEvalResult(steps, float(temperature), "left-to-right" if left_to_right else "confidence", rule,
                            emitted / max(1, passes), passes, emitted, [round(r, 4) for r in rates])
    return [o[:new_tokens] for o in outputs], result


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
