"""Named model pairs: a target, the drafter trained for it (if any) and the policy file fitted on
the pair's traces (if any), selected on the command line with `--pair NAME`.

| pair | target | drafter | policy file |
|---|---|---|---|
| `smollm2` (default) | SmolLM2-135M-Instruct, pulled into the cache on first use (workers/pull.py) | `models/smollm2/drafter` when the repository has it | `models/smollm2/policy.json` when there |
| `demo` | `models/demo/target` (6.2 M-parameter Llama, stdlib code) | `models/demo/drafter` | `models/demo/policy.json` |

A pair without a drafter decodes autoregressively (`EngineConfig(drafter=None)`).
`resolve_models` applies the command line's overrides: `--target DIR` and `--drafter DIR`
replace the pair's, `--drafter none` means no drafter, and a target given without a drafter gets
the pair's drafter only when it is the pair's own target (a drafter reads its target's hidden
states, so it never goes with another one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = REPO_ROOT / "models"
DEFAULT_PAIR = "smollm2"
PAIRS = ("smollm2", "demo")
NONE = "none"  # `--drafter none`


@dataclass(frozen=True)
class Pair:
    """target: a model directory (for `smollm2`, the cache directory, which may not exist before
    `prepare`); drafter / policy_file: None when the pair has none."""

    name: str
    target: Path
    drafter: Path | None
    policy_file: Path | None
    pulled: str | None = None  # the `workers.pull` model behind the target, if any

    def prepare(self, cache_dir: str | Path | None = None, progress: bool = True) -> "Pair":
        """Pull the target if it is a pulled model not in the cache yet (`PullError` if that fails)."""
        if self.pulled is not None:
            from workers.pull import pull

            pull(self.pulled, cache_dir, progress=progress)
        return self


def _if_there(path: Path, marker: str = "config.json") -> Path | None:
    return path if (path / marker if marker else path).is_file() else None


def get_pair(name: str, cache_dir: str | Path | None = None) -> Pair:
    """The pair called `name` (paths only: nothing is pulled; see `Pair.prepare`)."""
    if name == "smollm2":
        from workers.pull import model_dir

        here = MODELS / "smollm2"
        return Pair("smollm2", model_dir("smollm2", cache_dir), _if_there(here / "drafter"),
                    _if_there(here / "policy.json", ""), pulled="smollm2")
    if name == "demo":
        here = MODELS / "demo"
        return Pair("demo", here / "target", here / "drafter", _if_there(here / "policy.json", ""))
    raise ValueError(f"--pair: unknown pair {name!r} (choose from {', '.join(PAIRS)})")


def _same(a: str | Path, b: str | Path) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def resolve_models(pair: str | None = None, target: str | Path | None = None, drafter: str | Path | None = None,
                   cache_dir: str | Path | None = None, progress: bool = True
                   ) -> tuple[Path, Path | None, Path | None]:
    """(target, drafter or None, policy file or None) for a command line's `--pair`, `--target`
    and `--drafter` (see the module docstring); pulls the pair's target when it is used and not
    in the cache yet. The policy file is the pair's when both models are the pair's."""
    p = get_pair(pair or DEFAULT_PAIR, cache_dir)
    if target is None:
        p.prepare(cache_dir, progress)
        target_dir = p.target
    else:
        target_dir = Path(target)
    if drafter is None:
        drafter_dir = p.drafter if _same(target_dir, p.target) else None
    elif str(drafter).lower() == NONE:
        drafter_dir = None
    else:
        drafter_dir = Path(drafter)
    own = (_same(target_dir, p.target) and drafter_dir is not None and p.drafter is not None
           and _same(drafter_dir, p.drafter))
    return target_dir, drafter_dir, p.policy_file if own else None
