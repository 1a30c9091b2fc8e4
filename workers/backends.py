"""Step backends: how an engine runs its decode steps, as one value that says what it can do.

A **step backend** is how the target's decode forwards and the drafter's denoising passes run:

| name | decode steps run as | start-up |
|---|---|---|
| `eager` | the PyTorch modules, op by op | nothing to compile |
| `compiled` | programs `torch.compile` generates in this process (workers/compiled.py) | every process compiles its call patterns anew: 15-30 s each on 2 cores, minutes in all (`Engine.warm_up`) |
| `aot` | programs compiled ahead of time into packages in the cache directory (workers/aot.py) | a package loads in about a second; building one takes minutes, once per machine, model and engine shape |

The engine reads what its backend can do from the fields of `StepBackend` (`Engine.backend`),
never from its name, except to build the forwards themselves: whether `pack="auto"` packs
verification, whether the drafter may denoise part of its block, whether the wide fp32 matmul
thresholds are timed at start, whether `warm_up()` compiles anything.

**One meaning of "auto".** An `EngineConfig.compile` of "auto", and the `--compile auto` default of
`adapt generate`, `adapt serve` and `adapt info`, is the `aot` backend that never builds: the
packages `adapt compile` built for this model, engine shape and device when they are in the cache
directory, else eager steps (the engine falls back when the target's package is missing). So
nothing compiles or builds at start: torch.compile takes minutes per process on 2 cores (SmolLM2
more than ten, docs/serving.md "Start-up"), and SmolLM2's autoregressive steps from a built package
run ~1.6x faster at batch 1 than eager ones on a CPU (docs/getting-started.md; docs/cpu-performance.md,
"Compiled packages"). "aot" builds a missing package
first (`EngineConfig.aot_build`), "on" is the `compiled` backend and "off" the `eager` one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.request import COMPILE_CHOICES

__all__ = ["BACKEND_NAMES", "StepBackend", "resolve_backend"]

BACKEND_NAMES = ("eager", "compiled", "aot")


@dataclass(frozen=True)
class StepBackend:
    """One engine's step backend (module docstring) and what it can do.

    packs_verify: `pack="auto"` runs verification forwards packed (only the positions rows verify,
      `TargetModel.forward`'s `packed`): eager on a CPU, where the forward is compute-bound and
      padding costs as much as real positions. Not on a GPU, and not for programs: they serve
      padded shapes, and a packed call would run the eager forward instead of the program.
    partial_span: the drafter may denoise only part of its block (`Engine._span`); not with
      torch.compile, whose drafter programs have the block's shape.
    times_wide_rows: `wide_rows="auto"` times each weight shape's wide fp32 threshold at start
      (workers/wide_rows.py, a few seconds); a torch.compile engine keeps `WIDE_ROWS` (its decode
      matmuls are inductor's own).
    needs_warm_up: call patterns compile on their first call (torch.compile): the engine marks its
      caches static and `Engine.warm_up()` compiles the patterns before serving.
    builds: `aot` only: build a missing package at start (minutes) instead of decoding eagerly.
    info: `aot` only: the loaded packages (`workers.aot.aot_target`'s path, key, build and load
      seconds; "drafter" and "context": the drafter's packages; "pad": `AotTarget.calibrate_padding`);
      empty for the other backends."""

    name: str
    packs_verify: bool
    partial_span: bool
    times_wide_rows: bool
    needs_warm_up: bool
    builds: bool = False
    info: dict = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        """The backend as profiles key it: "aot+drafter" (the target's and the drafter's packages),
        "aot" (the target's package, eager drafter passes), "compiled" or "eager"."""
        return "aot+drafter" if self.name == "aot" and "drafter" in self.info else self.name

    def facts(self) -> dict:
        """A JSON-able summary: the name, label, capabilities and info (for reports and `info()`)."""
        return {"name": self.name, "label": self.label, "packs_verify": self.packs_verify,
                "partial_span": self.partial_span, "needs_warm_up": self.needs_warm_up, "builds": self.builds,
                "info": self.info}


def resolve_backend(setting: bool | str, device: torch.device | str, build: bool = True) -> StepBackend:
    """The step backend for a `compile` setting ("auto" | "on" | "off" | "aot", or a bool: True =
    "on") on `device`; `build` (`EngineConfig.aot_build`) applies to "aot" only ("auto" never
    builds). The device decides `packs_verify` (a CPU's); "auto" means the same on every device
    (module docstring). Raises ValueError for any other setting."""
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    if setting not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)} (or a bool), got {setting!r}")
    if setting == "off":
        return StepBackend("eager", packs_verify=torch.device(device).type == "cpu", partial_span=True,
                           times_wide_rows=True, needs_warm_up=False)
    if setting == "on":
        return StepBackend("compiled", packs_verify=False, partial_span=False, times_wide_rows=False,
                           needs_warm_up=True)
    return StepBackend("aot", packs_verify=False, partial_span=True, times_wide_rows=True, needs_warm_up=False,
                       builds=build and setting == "aot")
