"""Plot `scripts/ab_settings.py` results: goodput per policy and load, with every round.

One panel per input file: bars at each policy's median round, dots at its rounds, and the SLA
attainment over each bar. Example (stop 20):

    python scripts/plot_ab.py results/policies-smollm2-20/ab-mixed.json \
        results/policies-smollm2-20/ab-mixed-guard.json --out results/policies-smollm2-20/ab-mixed.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON written by scripts/ab_settings.py --out")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.files), figsize=(6 * len(args.files), 4), squeeze=False)
    for ax, path in zip(axes[0], args.files):
        rows = json.loads(path.read_text())
        loads = sorted({r["load"] for r in rows})
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        width = 0.8 / len(policies)
        for i, name in enumerate(policies):
            for j, load in enumerate(loads):
                row = next((r for r in rows if r["policy"] == name and r["load"] == load), None)
                if row is None:
                    continue
                x = j + (i - (len(policies) - 1) / 2) * width
                ax.bar(x, row["goodput_tok_s"], width, color=f"C{i}", label=name if j == 0 else None)
                ax.plot([x] * len(row["goodput_rounds"]), row["goodput_rounds"], "k.", ms=4)
                ax.text(x, row["goodput_tok_s"], f"{row['sla_attainment']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(loads)), [str(c) for c in loads])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("goodput (tok/s); SLA attainment above bars")
        ax.set_title(f"{rows[0]['pair']}, {rows[0]['workload']}: {path.name}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
