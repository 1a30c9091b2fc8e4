"""Settings written on a command line as ``KEY=VALUE`` items, for `adapt bench ab` and the
instruments (adapt/bench/instruments).

A **setting item** is ``KEY=VALUE`` where VALUE is JSON (``2``, ``0.5``, ``true``, ``[1, 2]``) or
``@PATH``, the JSON in that file (a table, e.g. an earlier run's ``suffix_accept``). A **variant**
is ``NAME:ITEM,ITEM,...``: a named set of settings (`adapt bench ab --variant`).
"""

from __future__ import annotations

import json
from pathlib import Path


def parse_settings(items, text_keys: tuple[str, ...] = ()) -> dict:
    """{key: value} of setting items; the values of `text_keys` stay plain strings. A value that
    is not JSON (nor a readable ``@PATH`` of JSON) raises ValueError naming its key."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not key or not eq:
            raise ValueError(f"setting {item!r}: expected KEY=VALUE")
        if key in text_keys:
            out[key] = value
            continue
        try:
            out[key] = json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)
        except (OSError, ValueError) as e:
            raise ValueError(f"setting {key}: {value!r} is not JSON or @PATH of JSON ({e})") from None
    return out


def parse_variant(text: str, text_keys: tuple[str, ...] = ()) -> tuple[str, dict]:
    """``'name:key=value,key=value'`` -> (name, settings), the items as `parse_settings` reads them."""
    name, _, body = text.partition(":")
    return name, parse_settings(filter(None, body.split(",")), text_keys)
