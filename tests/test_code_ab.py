"""`python -m adapt.bench.instruments.code_ab`: one benchmark command from two checkouts, ratios compared."""

import json
import subprocess
from pathlib import Path

from adapt.bench.instruments import code_ab


def test_code_ab_runs_each_checkout_and_compares_their_ratios(tmp_path):
    repo_root = Path(__file__).resolve().parents[1]
    other = tmp_path / "other"
    subprocess.run(["git", "-C", str(repo_root), "worktree", "add", "--detach", str(other), "HEAD"], check=True,
                   capture_output=True)
    try:
        out = tmp_path / "ab"
        code_ab.main(["--old", str(other), "--new", str(repo_root), "--order", "old,new", "--out", str(out), "--",
                      "bench", "speed", "--pair", "demo", "--batch-sizes", "1", "--rows", "adapt-ar,adapt-policy",
                      "--quick", "--interleave", "--no-profile", "--threads", "1"])
        report = json.loads((out / "code_ab.json").read_text())
        assert [r["code"] for r in report["runs"]] == ["old", "new"]
        assert all(r["ratios"]["batch=1"] > 0 for r in report["runs"])
        s = report["summary"]["batch=1"]
        assert s["new_over_old"] == round(s["new"][0] / s["old"][0], 3)
        assert (out / "old-1" / "speed.json").is_file() and (out / "new-2" / "speed.json").is_file()
    finally:
        subprocess.run(["git", "-C", str(repo_root), "worktree", "remove", "--force", str(other)], check=False,
                       capture_output=True)
