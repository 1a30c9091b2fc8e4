"""Verification: the target's verdict on a step's drafts, and the step's one host read.

Words:
- **acceptance counters**: per slot and draft position j, how often a draft at j was accepted
  and how often it was *reached* (verified with every earlier draft accepted); their ratio is the
  request's `accept_per_position`.
- **host rows**: everything the host needs from a step, packed per row into one float64 matrix
  and read in the step's one host sync: [tokens (Tq), accepted, emitted, tvd, (accept per
  position (Kc), positions verified), features]; `workers.step_batch.StepResult.unpack` names
  its fields.

Every sampled request draws its coins and the uniform of its emitted token from its own
generator (`kernels.draw_noise`), one such uniform per request and step, so a seeded request's
tokens do not depend on the rest of the batch. A step that verifies nothing (`sample_next`) and
the prefill's first token draw as `kernels.verify` draws a bonus token (`next_tokens`): the same
uniform, the same inverse CDF, so a request's token does not depend on which path emits it.
"""

from __future__ import annotations

import torch

from kernels import draw_noise, verify
from kernels.reference import inverse_cdf
from kernels.rules import NEEDS_DRAFT_PROBS, Rule
from kernels.verify import VerifyOutput, verify_greedy
from workers.sampling import argmax, probabilities
from workers.step_batch import StepBatch


class AcceptCounters:
    """Acceptance counters [max_batch, Kc] per slot (see the module docstring)."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        self.width = max(width, 1)
        self.accepted = torch.zeros(max_batch, self.width, device=device)  # accepted at draft position j
        self.reached = torch.zeros(max_batch, self.width, device=device)   # verified with all before accepted
        self.slots = torch.arange(self.width, device=device)  # [Kc] draft positions j

    def reset(self, row0: int, n: int) -> None:
        self.accepted[row0 : row0 + n] = 0
        self.reached[row0 : row0 + n] = 0

    def move(self, src: int, dst: int) -> None:
        self.accepted[dst] = self.accepted[src]
        self.reached[dst] = self.reached[src]

    def update(self, accepted: torch.Tensor, draft_len: torch.Tensor) -> list[torch.Tensor]:
        """Count a step's outcome (accepted / draft_len [B] int64) for slots 0 .. B − 1; returns
        the host-row columns [accept per position (Kc), positions ever verified (1)] as float64."""
        B = accepted.shape[0]
        acc, reached = self.accepted[:B], self.reached[:B]                            # [B, Kc] views
        acc += self.slots < accepted[:, None]
        # position j was reached when every draft before it was accepted: j <= accepted, j < draft_len
        reached += self.slots < torch.minimum(draft_len, accepted + 1)[:, None]
        apos = acc / reached.clamp(min=1)
        return [apos.double(), (reached > 0).sum(1, keepdim=True).double()]


def stop_table(requests, device) -> torch.Tensor:
    """[B, S] each request's stop ids, padded with -2 (no token)."""
    S = max(1, max(len(r.stop_ids) for r in requests))
    return torch.tensor([list(r.stop_ids) + [-2] * (S - len(r.stop_ids)) for r in requests], device=device)


def next_tokens(probs: torch.Tensor, requests, device) -> torch.Tensor:
    """[B] one token per row of probs [B, V]: the argmax for greedy requests (no generator), else
    an inverse-CDF draw (`kernels.reference.inverse_cdf`) at one uniform from the request's
    generator, which is what `kernels.verify` draws at a row without drafts (`kernels.draw_noise`
    with no coins). Greedy and sampled rows are picked on the host (no device sync)."""
    greedy = [i for i, r in enumerate(requests) if r.generator is None]
    sampled = [i for i, r in enumerate(requests) if r.generator is not None]
    if not sampled:
        return argmax(probs)
    tok = torch.zeros(probs.shape[0], dtype=torch.int64, device=device)
    if greedy:
        g = torch.tensor(greedy, device=device)
        tok[g] = argmax(probs.index_select(0, g))
    s = torch.tensor(sampled, device=device)
    u = draw_noise([requests[i].generator for i in sampled], [0] * len(sampled), device,
                   rules=[int(Rule.REJECTION)] * len(sampled)).sample_u                    # [S]
    tok[s] = inverse_cdf(probs.index_select(0, s), u)[0]
    return tok


class Verifier:
    """Verifies a planned `StepBatch` and reads the step back (see the module docstring)."""

    def __init__(self, counters: AcceptCounters, device: torch.device):
        self.counters = counters
        self.device = device

    def verify(self, batch: StepBatch, logits: torch.Tensor, drafts: torch.Tensor, q,
               packed: torch.Tensor | None = None, q_ids: torch.Tensor | None = None) -> VerifyOutput:
        """logits [B, Tq, V] of each row's anchor and drafts, or [B + N, V] of the `packed`
        positions [B + N] (row-major into [B, Tq]: the ragged layout's order); drafts [B, K];
        q [B, K, Vd] or None: the draft distributions over the draft vocabulary, whose target ids
        are `q_ids` [Vd] (None: Vd = V, the whole vocabulary)."""
        if batch.plan.all_greedy:
            return self.greedy(logits, drafts, batch.plan.draft_len, packed, batch.plan.max_k + 1)
        return self.ragged(batch, logits, drafts, q, packed, q_ids)

    def ragged(self, batch: StepBatch, logits: torch.Tensor, drafts: torch.Tensor, q,
               packed: torch.Tensor | None = None, q_ids: torch.Tensor | None = None) -> VerifyOutput:
        """`kernels.verify` on the ragged flat batch (contracts §2): target rows of each request's
        anchor and drafts, each request's probabilities, noise and coins from its own generator.
        q goes to `verify` over the drafter's vocabulary (`q_ids`), only when a rule reads q (greedy
        and suffix rows never do); it spreads over the whole vocabulary only the rows it reads
        there."""
        plan, dev = batch.plan, self.device
        B, Tq, V = (len(plan.draft_len_host), plan.max_k + 1, logits.shape[-1]) if packed is not None else logits.shape
        lay, k_host = plan.layout, plan.draft_len_host
        kmax, n = Tq - 1, lay.num_drafts
        needs_q = any(rr in NEEDS_DRAFT_PROBS for rr, kk in zip(plan.rule_host, k_host) if kk > 0)
        if needs_q and q.shape[1] < kmax:  # q is the diffusion span wide; a suffix row may verify past it
            q = torch.nn.functional.pad(q, (0, 0, 0, kmax - q.shape[1]))               # [B, kmax, Vd], zeros past the span
        if packed is not None:  # the forward gave the ragged target rows already
            logits_flat = logits                                   # [n + B, V]
            draft_flat = drafts[lay.draft_row, lay.draft_col]      # [n]
            q_flat = q[lay.draft_row, lay.draft_col] if needs_q else None  # [n, Vd]
            rep = lambda t: None if t is None else t[lay.row]
        elif min(k_host) == kmax:  # every row verifies kmax drafts: the ragged layout is a reshape
            logits_flat = logits.reshape(B * Tq, V)
            draft_flat = drafts[:, :kmax].reshape(-1)  # [n]
            q_flat = q[:, :kmax].reshape(n, -1) if needs_q else None  # [n, Vd]
            rep = lambda t: None if t is None else t.repeat_interleave(Tq)
        else:
            logits_flat = logits[lay.row, lay.col]                 # [n + B, V]
            draft_flat = drafts[lay.draft_row, lay.draft_col]      # [n]
            q_flat = q[lay.draft_row, lay.draft_col] if needs_q else None  # [n, Vd]
            rep = lambda t: None if t is None else t[lay.row]
        p_flat = probabilities(logits_flat, rep(batch.temperature), rep(batch.top_k), rep(batch.top_p))  # [n + B, V]
        noise = draw_noise([r.generator for r in batch.requests], k_host, dev, rules=plan.rule_host, layout=lay)
        if q_flat is not None:  # [n, Vd] over the draft vocabulary (`verify` spreads what it reads)
            q_flat = q_flat.contiguous()
        return verify(draft_flat, lay.cu, p_flat, q_flat, plan.rule, plan.param, plan.param2, noise.uniforms,
                      noise.sample_u, kmax, noise_rows=noise.noise_rows, layout=lay, check=False,
                      draft_ids=q_ids if q_flat is not None else None, rules=plan.rule_host)

    @staticmethod
    def greedy(logits: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor,
               packed: torch.Tensor | None = None, Tq: int | None = None) -> VerifyOutput:
        """`kernels.verify.verify_greedy` (the padded GREEDY verification the training evaluator
        shares) for a batch whose rows all verify with GREEDY (T = 0): a row accepts its drafts
        while each equals the argmax of p at its position and emits the argmax at the first
        mismatch (or the bonus position). The argmax of p is taken on the logits, as transformers'
        greedy search does: softmax is monotone, so it is the same token unless the two largest
        logits are within 2^-24 of each other relative to 1 and exp rounds them together (then
        this takes the larger logit where argmax p takes the lower index). Skipping the softmax
        saves a pass over [B * Tq, V]. logits [B, Tq, V], or [B + N, V] at the `packed`
        positions [B + N] of [B, Tq] (then `Tq` is given); drafts [B, K]; k [B] int64."""
        if packed is None:
            B, Tq, V = logits.shape
            y = argmax(logits.reshape(B * Tq, V)).view(B, Tq)                      # argmax p per position
        else:
            B = k.shape[0]
            y = torch.full((B * Tq,), -1, dtype=torch.int64, device=logits.device)
            y[packed] = argmax(logits).to(torch.int64)                            # [B + N] argmax p per position
            y = y.view(B, Tq)                                                     # -1 where a row verifies nothing
        return verify_greedy(y, drafts, k)

    def commit(self, batch: StepBatch, out: VerifyOutput, feats) -> tuple[list[list[float]], int]:
        """Stop conditions and counters on the device, then the step's one host sync. Returns
        (host rows, Kc) (see the module docstring); feats: tensors [B, K] to read back, or ()."""
        dev = self.device
        Tq = out.tokens.shape[1]
        a = out.num_accepted.to(torch.int64)
        emit = a + 1
        j = torch.arange(Tq, device=dev)
        stops = stop_table(batch.requests, dev)  # [B, S]
        is_stop = (out.tokens[:, :, None] == stops[:, None, :]).any(-1) & (j[None] < emit[:, None])  # [B, Tq]
        first_stop = torch.where(is_stop.any(1), is_stop.to(torch.int8).argmax(1), Tq)
        n_emit = torch.minimum(emit, first_stop + 1)
        # one float64 table (`torch.cat` promotes: the counters' columns are float64, and token ids
        # and counts are exact in it)
        packed = [out.tokens, a[:, None], n_emit[:, None], out.tvd_spent[:, None],
                  *self.counters.update(a, batch.plan.draft_len), *feats]
        return torch.cat(packed, 1).double().tolist(), self.counters.width  # the step's one host sync

    def sample_next(self, logits: torch.Tensor, requests, temperature, top_k, top_p, feats) -> list[list[float]]:
        """The autoregressive step (no row verifies a draft): logits [B, V] of each row's anchor
        position; each row emits one token, drawn as `kernels.verify` draws a bonus token
        (`next_tokens`: argmax of p for T = 0 rows, an inverse-CDF draw of p at one uniform
        otherwise), without the ragged layout, rules and counters (nothing is accepted, so they do
        not change).
        Returns host rows as `commit`'s with no counters: [token, 0, 1, 0.0, *feats]."""
        B = logits.shape[0]
        if all(r.generator is None for r in requests):  # all greedy (T = 0): no noise to draw
            tok = argmax(logits)  # argmax p = argmax of the logits (see `greedy`)
        else:
            tok = next_tokens(probabilities(logits, temperature, top_k, top_p), requests, self.device)  # p [B, V]
        zero = torch.zeros(B, 1, dtype=torch.float64, device=self.device)
        cols = [tok[:, None].double(), zero, zero + 1, zero] + [f.double() for f in feats]
        return torch.cat(cols, 1).tolist()  # the step's one host sync
