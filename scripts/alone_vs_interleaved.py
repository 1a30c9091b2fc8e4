"""Does interleaving change a run's own numbers? `ar` at one load (default 16) on SmolLM2's mixed
workload: alone, then two `ar` engines interleaved (adapt/bench/interleave.py), then alone again;
prints goodput tok/s as JSON (stop 24: 34.7, then 35.0 and 33.9, then 34.4).

    python scripts/alone_vs_interleaved.py 16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch

    from adapt.bench.interleave import engine_copies, run_interleaved
    from adapt.bench.live import KnobsBaseline, run_live
    from adapt.bench.policies import workload_engine
    from adapt.replay import Scenario, make_mix

    argv = sys.argv[1:] if argv is None else argv
    load = int(argv[0]) if argv else 16
    torch.set_num_threads(2)
    engine, prompts = workload_engine("smollm2", "mixed", 64, 98)
    first, second = engine_copies(engine, 2)
    mix = make_mix(max(24, 2 * load), 160.0, 640.0, max_tokens=64, length_spread=0.5)
    ar = lambda: KnobsBaseline("ar", draft_len=0)  # noqa: E731
    for engine in (first, second):
        run_live(engine, ar(), Scenario("warm", 4, mix[:4]), prompts)  # not recorded
    scenario = Scenario("mix", load, mix)
    alone_1 = run_live(first, ar(), scenario, prompts)["goodput_tok_s"]
    both = run_interleaved([first, second], [ar(), ar()], scenario, prompts)
    alone_2 = run_live(second, ar(), scenario, prompts)["goodput_tok_s"]
    print(json.dumps({"load": load, "alone_1": round(alone_1, 1),
                      "interleaved": [round(m["goodput_tok_s"], 1) for m in both], "alone_2": round(alone_2, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
