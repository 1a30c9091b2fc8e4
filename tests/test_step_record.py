"""The engine's observer hook (`Engine.observers`, workers/step_record.py): every decode step is
one `StepRecord` (applied intent, plan, outcome, pinned rows, phase times), handed to the decision
maker's `observe` and then to each observer; every prefill is told to `on_prefill`."""

from __future__ import annotations

import torch

from workers.decisions import DraftIntent, StaticDecisions
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE
from workers.engine import DEMO_DRAFTER, DEMO_TARGET, Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams
from workers.step_record import PHASES, StepRecord


class Recorder:
    """A `StepObserver` that keeps what it is told."""

    def __init__(self):
        self.steps: list[StepRecord] = []
        self.prefills: list[tuple[float, int]] = []

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def on_prefill(self, seconds: float, rows: int) -> None:
        self.prefills.append((seconds, rows))


class Seen(StaticDecisions):
    """Static knobs, but request "pinned" drafted by diffusion too (its pin says otherwise); keeps
    the records `observe` receives, and the phases they held then."""

    def __init__(self):
        self.records: list[tuple[StepRecord, set]] = []

    def before_draft(self, rows):
        intent = super().before_draft(rows)
        mine = torch.tensor([rid == "pinned" for rid in rows.request_ids])
        return DraftIntent(torch.where(mine, DIFFUSION_CODE, intent.source), torch.where(mine, 1, intent.steps), intent.span)

    def observe(self, record: StepRecord) -> None:
        self.records.append((record, set(record.times)))


def test_each_decode_step_is_one_record_with_its_applied_intent_plan_and_phases():
    decisions, recorder = Seen(), Recorder()
    engine = Engine(EngineConfig(target=DEMO_TARGET, drafter=DEMO_DRAFTER, device="cpu", dtype="float32",
                                 max_batch=4, max_len=128), decisions=decisions)
    engine.observers.append(recorder)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("draft", [3, 7, 11, 13], greedy, DecodeKnobs(steps=2, draft_len=3))
    engine.add_request("plain", [4, 9, 2], greedy, DecodeKnobs(draft_len=0))
    # pinned to no drafts: the decision maker drafts it, its pin wins
    engine.add_request("pinned", [5, 5, 6], greedy, DecodeKnobs.pin(draft_len=0))
    while engine.has_unfinished():
        engine.step()
    assert [rows for _, rows in recorder.prefills] == [3] and recorder.prefills[0][0] > 0
    steps = recorder.steps
    assert [r.step for r in steps] == list(range(len(steps))) and len(steps) >= 4
    # the decision maker saw the same records first, before the `conclude` phase was timed
    assert [r for r, _ in decisions.records] == steps
    assert all(seen == set(PHASES) - {"conclude"} for _, seen in decisions.records)
    first = steps[0]
    assert set(first.times) == set(PHASES) and all(t >= 0 for t in first.times.values())
    assert first.rows.request_ids == ["draft", "plain", "pinned"]
    # applied: the pinned row drafts nothing, the drafting row's span is its draft length
    assert first.intent.source.tolist() == [DIFFUSION_CODE, NONE_CODE, NONE_CODE]
    assert first.intent.steps.tolist() == [2, 0, 0] and first.intent.span == 3
    assert first.pinned.tolist() == [False, False, True]
    assert first.plan is not None and first.plan.draft_len_host == [3, 0, 0]
    assert first.outcome.verified.tolist() == [3, 0, 0]
    assert first.times["draft"] > 0 and first.times["forward"] > 0
    # once "draft" has finished, the rows left decode plainly: no plan, no drafting phases
    plain = [r for r in steps if not bool(r.intent.source.any())]
    assert plain and all(r.plan is None and r.times["draft"] == 0 and r.times["choose"] == 0 for r in plain)


def test_sync_phases_keeps_the_output():
    """`sync_phases` only adds device synchronisations at the phase boundaries (none on a CPU)."""
    def run(sync: bool) -> list[int]:
        engine = Engine(EngineConfig(target=DEMO_TARGET, drafter=DEMO_DRAFTER, device="cpu", dtype="float32",
                                     max_batch=2, max_len=64))
        engine.sync_phases = sync
        engine.add_request("r", [3, 7, 11], SamplingParams(max_tokens=10, ignore_eos=True), DecodeKnobs(steps=1, draft_len=4))
        out = []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.new_token_ids
        return out

    assert run(True) == run(False)
