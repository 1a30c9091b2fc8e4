"""`adaptive`: our controller, as a package of small modules by responsibility.

Per pass and per row it picks diffusion steps, draft length and leniency to maximise the batch's
*weighted* goodput, where a row's weight grows with how far it is behind its latency target
(and with its priority). Read in this order:

- `settings`: every setting, its default, range and effect (one pydantic model);
- `objective`: what a row's tokens are worth (urgency, SLA lateness, closed batches);
- `plan`: diffusion steps per row before drafting (a frozen `Plan`) and the drafter's span;
- `source`: where a row's draft comes from (its plan, or a suffix draft that pays more);
- `verify`: after drafting, how many drafted tokens each row verifies and under which rule;
- `guards`: SLA guards (candidates that push a row off its target are worth 0);
- `calibration`: the online corrections of acceptance and cost, each with ``observe()``;
- `cadence`: holding plain decisions where deciding is dear;
- `suffix_table`: suffix-draft acceptance tables;
- `policy`: `AdaptivePolicy`, which wires the phases of a step.
"""

from .calibration import batch_bucket, verified_drafts
from .guards import keeps_targets
from .objective import planned_extra
from .plan import Plan, StepDecision
from .policy import AdaptivePolicy
from .settings import REMOVED, AdaptiveSettings, check_settings
from .source import suffix_candidates
from .suffix_table import check_suffix_accept, suffix_accept_of, suffix_draft_accept, suffix_slot_accept

__all__ = ["AdaptivePolicy", "AdaptiveSettings", "Plan", "REMOVED", "StepDecision", "batch_bucket",
           "check_settings", "check_suffix_accept", "keeps_targets", "planned_extra", "suffix_accept_of",
           "suffix_candidates", "suffix_draft_accept", "suffix_slot_accept", "verified_drafts"]
