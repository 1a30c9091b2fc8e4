"""Maintainers' profiling instruments: live runs that say where a decode step's time goes and why.

Each is a module run with ``python -m adapt.bench.instruments.NAME --help`` (docs/instruments.md):

- `phase_times`: milliseconds per decode step by phase, per policy and per draft source;
- `step_log`: every adaptive step's choice and outcome, beside a static baseline, interleaved;
- `host_ops`: torch operations a decode step runs on the host, per phase and per line;
- `source_ceiling`: the ceiling of choosing the draft source per step against static suffix drafting;
- `code_ab`: one benchmark command run alternately from two checkouts of the code, ratios compared;
- `traces`: explore-policy traces of a pair, for `adapt policy fit` and notebooks/policy_tuning.ipynb.

The benchmarks a user runs are `adapt bench` subcommands; these are for changing the engine or the
policy, not for headline numbers.
"""
