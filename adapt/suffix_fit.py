"""Fit the acceptance of suffix drafts from traces: per-token acceptance by match length.

A suffix draft (workers/suffix.py) of match length m is accepted token by token; treating each
token as accepted with the same probability c(m) until the first rejection (a geometric law cut
at the draft length k), the maximum-likelihood estimate from records with `accepted` = a of k is

    c(m) = Σ a / (Σ a + Σ [a < k])

(accepted tokens over accepted tokens plus rejections). Buckets of match lengths share one c;
the estimates are made non-decreasing in m (a longer match never predicts less), and buckets with
too few records fall back to the built-in ``m / (m + 3)``. The table goes into the adaptive
policy's settings (``suffix_accept``; policies/adaptive.py) and the fit report.
"""

from __future__ import annotations

import numpy as np

from adapt.trace_data import TraceTable

EDGES = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # lower match-length edges of the buckets
MIN_RECORDS = 20                         # fewer records in a bucket: the built-in prior


def fit_suffix_accept(table: TraceTable, edges=EDGES, min_records: int = MIN_RECORDS) -> tuple[dict | None, dict]:
    """(settings table ``{"match": [...], "accept": [...]}`` or None when the traces hold no suffix
    drafts, report {bucket edge: records, c})."""
    rows = (table.steps == -1) & (table.draft_len > 0)
    if not rows.any():
        return None, {"records": 0}
    m, a, k = table.suffix_match[rows], table.accepted[rows], table.draft_len[rows]
    bucket = np.searchsorted(np.asarray(edges), m, side="right") - 1
    accept, report = [], {"records": int(rows.sum()), "buckets": []}
    for i, lo in enumerate(edges):
        sel = bucket == i
        n = int(sel.sum())
        prior = lo / (lo + 3.0)
        if n >= min_records:
            acc, rej = float(a[sel].sum()), float((a[sel] < k[sel]).sum())
            c = acc / max(acc + rej, 1.0)
        else:
            c = prior
        accept.append(c)
        report["buckets"].append({"match": lo, "records": n, "accept": round(c, 4), "fitted": n >= min_records})
    accept = np.maximum.accumulate(np.asarray(accept)).clip(0.0, 0.999).tolist()
    return {"match": list(edges), "accept": [round(c, 4) for c in accept]}, report
