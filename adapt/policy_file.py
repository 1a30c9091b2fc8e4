"""The versioned policy file: everything a worker needs to run the adaptive controller.

A *policy* is plain JSON (never pickle), so that workers can hot-reload one published through
Redis without deserialising code-bearing data:

```json
{"schema": "adapt-policy", "schema_version": 2, "version": "20261130T061500-3f2a9c1b",
 "created": 1764483300.0, "policy": "adaptive",
 "predictor": {"draft": {...}, "prior": {...}},      # adapt.predictor.AcceptancePredictor.to_dict
 "cost": {"verify": {...}, "draft_pass": {...}},     # adapt.cost_model.CostModel.to_dict
 "settings": {...},                                  # keyword settings of the policy class
 "report": {...},                                    # fit report: ECE, reliability tables, counts
 "checksum": "sha256 of the canonical JSON of every other field"}
```

`load` / `loads` validate the schema, every field's type and shape, and the checksum, and raise
`PolicyFileError` (a `ValueError`) naming the field on any corruption. `save` writes atomically
(temporary file + rename) so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field

from adapt.cost_model import CostModel
from adapt.predictor import AcceptancePredictor
from workers.atomic_file import write_text_atomic

SCHEMA = "adapt-policy"
SCHEMA_VERSION = 2  # 2: recent acceptance per position, predictor.typical_recent


class PolicyFileError(ValueError):
    """A policy file is missing, corrupt or of an unknown schema; the message names the field."""


@dataclass
class PolicyFile:
    """A loaded policy: predictor, cost model, policy name and its settings."""

    predictor: AcceptancePredictor = field(default_factory=AcceptancePredictor)
    cost: CostModel = field(default_factory=CostModel)
    policy: str = "adaptive"
    settings: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    version: str = ""
    created: float = 0.0

    def to_dict(self) -> dict:
        created = self.created or time.time()
        body = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created": created, "policy": self.policy,
                "predictor": self.predictor.to_dict(), "cost": self.cost.to_dict(), "settings": self.settings,
                "report": self.report}
        digest = _checksum(body)
        body["version"] = self.version or time.strftime("%Y%m%dT%H%M%S", time.gmtime(created)) + "-" + digest[:8]
        body["checksum"] = _checksum(body)
        return body


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _checksum(body: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in body.items() if k != "checksum"})).hexdigest()


def dumps(policy: PolicyFile) -> str:
    """The policy as a JSON string (what `save` writes and Redis stores)."""
    return json.dumps(policy.to_dict(), indent=1, sort_keys=True, allow_nan=False)


def save(policy: PolicyFile, path: str | os.PathLike) -> str:
    """Write ``policy`` to ``path`` atomically; returns the version string written."""
    text = dumps(policy)
    write_text_atomic(path, text)
    return json.loads(text)["version"]


def loads(text: str | bytes) -> PolicyFile:
    """Parse and validate a policy from JSON text; `PolicyFileError` names what is wrong."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PolicyFileError(f"policy: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PolicyFileError("policy: top level must be a JSON object")
    if data.get("schema") != SCHEMA:
        raise PolicyFileError(f"policy.schema: expected {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise PolicyFileError(f"policy.schema_version: unsupported {data.get('schema_version')!r} "
                              f"(this build reads {SCHEMA_VERSION})")
    for key, kind in (("predictor", dict), ("cost", dict), ("settings", dict), ("report", dict), ("policy", str),
                      ("version", str), ("checksum", str), ("created", (int, float))):
        if not isinstance(data.get(key), kind):
            raise PolicyFileError(f"policy.{key}: missing or of the wrong type")
    if _checksum(data) != data["checksum"]:
        raise PolicyFileError("policy.checksum: does not match the contents (file corrupt or edited)")
    try:
        predictor = AcceptancePredictor.from_dict(data["predictor"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyFileError(f"policy.predictor: {exc}") from None
    try:
        cost = CostModel.from_dict(data["cost"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyFileError(f"policy.cost: {exc}") from None
    return PolicyFile(predictor=predictor, cost=cost, policy=data["policy"], settings=data["settings"],
                      report=data["report"], version=data["version"], created=float(data["created"]))


def load(path: str | os.PathLike) -> PolicyFile:
    """Read and validate the policy file at ``path``."""
    try:
        with open(path, "rb") as handle:
            text = handle.read()
    except OSError as exc:
        raise PolicyFileError(f"policy: cannot read {os.fspath(path)} ({exc.strerror})") from None
    return loads(text)
