"""`adapt policy {fit,...}`: build and manage policy files.

    adapt policy fit --traces PATH --out POLICY [--policy adaptive] [--settings JSON] [--report REPORT.json]
    adapt policy set POLICY --settings JSON

`set` merges settings into an existing policy file (validated against the file's policy; an
unknown, ill-typed or out-of-range setting is named and nothing is written) and writes it back as a
new version; settings deleted as measured no better (`policies.adaptive.settings.REMOVED`) that
the file still carries are dropped with a warning.

`fit` reads engine traces (a .jsonl file, a directory of them, or a glob), fits the acceptance
predictor (scikit-learn, calibrated by sequential temperature scaling), fits the step-cost model
from the logged timings, and writes a versioned JSON policy file (`adapt.policy_file`). It prints
the ECE before/after calibration and the reliability table.

More subcommands plug in without editing this file: a module ``adapt.commands.policy_<name>``
(e.g. ``policy_push``) with ``add_parser(subparsers)`` is picked up automatically, or call
`register_subcommand(name, add_parser)`. `fit_policy` is the reusable core (e.g. for fitting from
a Redis trace stream: pass the records).
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Iterable

from adapt.commands import optional_module

SUBCOMMANDS: dict[str, Callable] = {}
EXTENSIONS = ("push", "redis", "serve")  # optional modules adapt.commands.policy_<name>


def register_subcommand(name: str, add_parser: Callable) -> None:
    """Register ``add_parser(subparsers)`` for ``adapt policy <name>``."""
    SUBCOMMANDS[name] = add_parser


def fit_policy(source, *, policy: str = "adaptive", settings: dict | None = None, seed: int = 0):
    """Fit a `PolicyFile` from trace records (an iterable of dicts), a `TraceTable`, or a path.
    ``settings`` must be settings of ``policy`` (`adapt.controller.SETTINGS`); a policy that takes
    ``steps_grid`` gets the logged step counts unless ``settings`` has its own."""
    from adapt.controller import SETTINGS, validate_settings
    from adapt.cost_model import CostModel
    from adapt.policy_file import PolicyFile
    from adapt.predictor import fit_predictor
    from adapt.trace_data import TraceTable

    validate_settings(policy, settings or {})  # an unknown or ill-typed setting: PolicyFileError naming it
    if isinstance(source, TraceTable):
        table = source
    elif isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        table = TraceTable.read(source)
    else:
        table = TraceTable.from_records(source)
    predictor, report = fit_predictor(table, seed=seed)
    try:
        cost = CostModel.fit_traces(table)
        report["cost"] = {"source": "traces", "steps": int(len(set(table.step_key.tolist())))}
    except ValueError as exc:
        cost = CostModel()
        report["cost"] = {"source": "default", "why": str(exc)}
    logged = sorted({int(s) for s in table.steps.tolist() if s > 0})
    takes_grid = policy in SETTINGS and "steps_grid" in SETTINGS[policy].model_fields
    merged = {"steps_grid": logged[:4] or [1]} if takes_grid else {}
    if policy in SETTINGS and "suffix_accept" in SETTINGS[policy].model_fields:
        from adapt.suffix_fit import fit_suffix_accept

        suffix_table, report["suffix"] = fit_suffix_accept(table)
        if suffix_table is not None:
            merged["suffix_accept"] = suffix_table
    merged.update(settings or {})
    return PolicyFile(predictor=predictor, cost=cost, policy=policy, settings=merged, report=report)


def _format_reliability(rows: Iterable[dict]) -> str:
    lines = ["    bin          count  predicted  observed"]
    for r in rows:
        lo, hi = r["bin"]
        lines.append(f"    [{lo:.1f}, {hi:.1f})  {r['count']:6d}  {r['predicted']:9.3f}  {r['observed']:8.3f}")
    return "\n".join(lines)


def _run_fit(args) -> int:
    from adapt.policy_file import save
    from adapt.trace_data import TraceError

    try:
        settings = json.loads(args.settings) if args.settings else {}
        if not isinstance(settings, dict):
            raise ValueError("settings: must be a JSON object")
        pf = fit_policy(args.traces, policy=args.policy, settings=settings, seed=args.seed)
    except (TraceError, ValueError, json.JSONDecodeError) as exc:
        print(f"adapt policy fit: {exc}", file=sys.stderr)
        return 2
    version = save(pf, args.out)
    rep = pf.report
    print(f"policy {pf.policy} version {version} -> {args.out}")
    print(f"records {rep['records']} (exact {rep['exact_records']}), requests {rep['requests']}")
    for head in ("draft", "prior"):
        h = rep[head]
        print(f"{head} head: ECE {h['ece_uncalibrated']:.4f} uncalibrated -> {h['ece']:.4f} calibrated, "
              f"Brier {h['brier']:.4f} ({h['test_points']} held-out positions)")
        for cls, c in h.get("by_class", {}).items():
            print(f"  {cls} rows: ECE {c['ece']:.4f}, mean survival predicted {c['predicted']:.4f} vs observed "
                  f"{c['observed']:.4f} ({c['points']} positions)")
    typ = rep.get("typical_recent")
    if typ:
        print(f"typical recent acceptance (rows without history): greedy {typ['greedy']:.3f}, sampled {typ['sampled']:.3f}")
    print("reliability (draft head, held-out survival):")
    print(_format_reliability(rep["draft"]["reliability"]))
    if "lenient" in rep:
        print(f"lenient rows: ECE {rep['lenient']['ece']:.4f} over {rep['lenient']['records']} records")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump(rep, handle, indent=1)
    return 0


def _add_fit(sub) -> None:
    p = sub.add_parser("fit", help="fit predictor + cost model from traces and write a policy file")
    p.add_argument("--traces", required=True, help="trace .jsonl file, directory, or glob")
    p.add_argument("--out", required=True, help="policy file to write (JSON)")
    p.add_argument("--policy", default="adaptive", help="policy name stored in the file (default adaptive)")
    p.add_argument("--settings", default=None, help="JSON object of policy settings to store")
    p.add_argument("--report", default=None, help="also write the fit report (ECE, reliability) as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/calibration/test split")
    p.set_defaults(run=_run_fit)


register_subcommand("fit", _add_fit)


def _run_set(args) -> int:
    """Merge validated settings into a policy file and write it back as a new version."""
    from adapt.controller import validate_settings
    from adapt.policy_file import PolicyFileError, load, save
    from policies.adaptive.settings import REMOVED

    try:
        settings = json.loads(args.settings)
        if not isinstance(settings, dict) or not settings:
            raise ValueError("settings: must be a non-empty JSON object")
        policy = load(args.policy_file)
        gone = sorted(set(settings) & set(REMOVED)) if policy.policy == "adaptive" else []
        if gone:  # a deleted setting is not set anew (a file that carries one drops it, below)
            raise ValueError(f"settings.{gone[0]}: removed setting ({REMOVED[gone[0]]})")
        merged = dict(policy.settings, **settings)
        validate_settings(policy.policy, merged)  # an unknown, ill-typed or out-of-range setting: named, nothing written
        if policy.policy == "adaptive":
            merged = {k: v for k, v in merged.items() if k not in REMOVED}
    except (PolicyFileError, ValueError) as exc:
        print(f"adapt policy set: {exc}", file=sys.stderr)
        return 2
    policy.settings = merged
    policy.version, policy.created = "", 0.0  # a new version
    version = save(policy, args.policy_file)
    print(f"policy {policy.policy} version {version} -> {args.policy_file}: "
          + ", ".join(f"{k}={json.dumps(v)}" for k, v in settings.items()))
    return 0


def _add_set(sub) -> None:
    p = sub.add_parser("set", help="change settings of a policy file (validated; writes a new version)")
    p.add_argument("policy_file", help="the policy file to change in place")
    p.add_argument("--settings", required=True, help='JSON object of settings, e.g. \'{"steps_grid": [1]}\'')
    p.set_defaults(run=_run_set)


register_subcommand("set", _add_set)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("policy", help="fit, inspect and publish decoding policies")
    sub = parser.add_subparsers(dest="policy_command", required=True)
    for name in EXTENSIONS:
        module = optional_module(f"adapt.commands.policy_{name}")
        if module is None:
            continue
        if name not in SUBCOMMANDS and hasattr(module, "add_parser"):
            SUBCOMMANDS[name] = module.add_parser
    for add in SUBCOMMANDS.values():
        add(sub)
