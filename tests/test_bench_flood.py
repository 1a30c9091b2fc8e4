"""`adapt bench flood` end to end, in its own process: a local Ray, Serve's proxy, the application on
the tiny pair over a real Redis, real HTTP; small queues so that a flood overflows them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_flood_reports_each_round_statuses_latency_and_memory(redis_server, tmp_path):
    from tests.tiny_models import make_tiny_pair

    target, drafter = make_tiny_pair(tmp_path)
    redis_server.flush()
    done = subprocess.run([sys.executable, "-m", "adapt.bench.flood", "--target", str(target), "--drafter", str(drafter),
                           "--redis-url", redis_server.url, "--requests", "24", "--spread-s", "0", "--max-tokens", "6",
                           "--max-batch", "2", "--decoder-max-ongoing", "2", "--decoder-max-queued", "2",
                           "--rounds", "2", "--timeout-s", "120"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert set(r["statuses"]) <= {"200", "429"} and sum(r["statuses"].values()) == 24  # never a 5xx or a hang
        assert r["statuses"].get("429", 0) > 0 and r["429_ours"] == r["statuses"]["429"]  # JSON, Retry-After
        assert r["accepted_complete"] == r["statuses"]["200"] > 0 and r["after_flood_status"] == 200
        assert r["rss_mib"]["peak"] >= r["rss_mib"]["before"] > 0 and r["accepted_latency_s"]["p50"] > 0
