"""No benchmark or instrument (adapt/bench) patches the engine or a policy (issue #60).

They see steps through `Engine.observers` (workers/step_record.py) and wrap a decision maker from
outside (adapt/bench/instruments/wrapped_decisions.py). This reads every module of adapt/bench
and fails on:
- an assignment to ``__class__`` (swapping an object's class);
- an assignment, ``setattr`` or ``del``/``delattr`` of an attribute named like a method of the
  engine, its parts or a policy, on anything but ``self`` (a class of adapt/bench setting its own) (`patchable_names`: methods of the classes in `ENGINE_MODULES`
  and policies/);
- a ``setattr``/``delattr`` whose name is not a string literal (it could be any of those), on
  anything but `torch.Tensor` (counting host reads of tensors: gpu_check_engine's `SyncCounter`).
`ALLOWED` lists, with their reasons, the other assignments that share a method's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "adapt" / "bench"
# the engine and the parts whose methods it calls each step
ENGINE_MODULES = ("engine", "decisions", "verification", "drafting", "draft_sources", "step_batch", "commit",
                  "pins", "suffix", "aot", "compiled", "backends")
ALLOWED = {
    # vLLM's own engine, in its subprocess, its steps counted (not our engine)
    ("vllm_runner.py", "step"),
    # a transformers / target model's forward compiled with torch.compile (the model, not the engine)
    ("forward_speed.py", "forward"),
}


def patchable_names() -> set[str]:
    """Names of the methods (and properties) of the classes of the engine's modules and of the policies."""
    files = [ROOT / "workers" / f"{m}.py" for m in ENGINE_MODULES] + sorted((ROOT / "policies").rglob("*.py"))
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names - {"__init__"}


def _is_torch_tensor(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "Tensor" and isinstance(node.value, ast.Name) \
        and node.value.id == "torch"


def patches(source: str, filename: str, names: set[str]) -> list[str]:
    """The places in ``source`` that patch (module docstring), as ``file:line what``."""
    found = []

    def flag(node, what: str, attr: str | None) -> None:
        if attr is not None and (filename, attr) in ALLOWED:
            return
        found.append(f"{filename}:{node.lineno} {what}")

    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    if sub.attr != "__class__" and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        continue  # an object setting its own attributes (its class is ours, in adapt/bench)
                    if sub.attr == "__class__":
                        flag(node, "assigns __class__", None)
                    elif sub.attr in names:
                        flag(node, f"replaces .{sub.attr}", sub.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if len(node.args) < 2:
                continue
            obj, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if name.value == "__class__" or name.value in names:
                    flag(node, f"{node.func.id}(..., {name.value!r})", name.value)
            elif not _is_torch_tensor(obj):
                flag(node, f"{node.func.id} with a computed name", None)
    return found


def test_no_module_of_adapt_bench_patches_the_engine_or_a_policy():
    names = patchable_names()
    assert {"_decode", "_conclude", "_prefill", "before_draft", "after_draft", "observe", "draft", "verify"} <= names
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        found += patches(path.read_text(), str(path.relative_to(BENCH)), names)
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_patch():
    """The patterns the check exists for are found (so that a clean result means something),
    and what is not patching passes: public settings, torch's own methods, a local wrapper."""
    names = patchable_names()
    bad = {
        "engine._decode = decode": "replaces ._decode",
        "eng.drafting.draft = timed": "replaces .draft",
        "policy.__class__ = Logged": "assigns __class__",
        "setattr(AdaptivePolicy, '_span', timed)": "setattr(..., '_span')",
        "for n in parts:\n    setattr(AdaptivePolicy, n, timed(n))": "setattr with a computed name",
        "setattr(obj, name, counted)": "setattr with a computed name",
        "del engine.drafting.draft": "replaces .draft",
        "self.engine._prefill = prefill": "replaces ._prefill",
        "delattr(obj, name)": "delattr with a computed name",
    }
    for source, what in bad.items():
        found = patches(source, "x.py", names)
        assert len(found) == 1 and found[0].endswith(what), (source, found)
    fine = ("engine.decisions = policy\nengine.clock = clock\nengine.sync_phases = True\nengine.closed = False",
            "engine.observers.append(probe)",
            "setattr(torch.Tensor, name, wrapped)\ndelattr(torch.Tensor, name)",
            "step = self.inner.before_draft(rows)\nself.log = []\nself.label = label",
            "llm.llm_engine.step = counted_step")
    for source in fine:
        filename = "vllm_runner.py" if "llm_engine" in source else "x.py"
        assert patches(source, filename, names) == [], source
