"""One claim per millisecond: findings that explain the same step time are reconciled.

Three detectors can point at the same exposed communication: `straggler` (the others wait for a
late rank: the wait shows up on their timelines as exposed communication), `missing-overlap`
(gathers issued only when needed: prefetch would hide part of that exposed time) and `comm-bound`
(communication longer than compute: the excess cannot be hidden). The rule, applied once after
every detector ran, most specific cause first:

1. `straggler` keeps its gain. The wait it causes is not overlap the others could gain:
   `missing-overlap` and `comm-bound` lose the straggler's gain per step from theirs.
2. `missing-overlap` keeps what is left. `comm-bound`'s excess loses the `missing-overlap` gain
   (prefetch recovers that part first; a gain `comm-bound` replayed on top of that prefetch
   already leaves it out and is kept), and its "no prefetch setting can fix this" becomes
   "beyond what prefetch recovers": the two never advise opposite things for the same time.
3. `host-bound` steps found only on straggler ranks are the straggler's own idle time (its
   diagnosis already names the host side): `host-bound` is dropped, listed under the straggler.
   The generic `exposed-comm` (steps with exposed communication, detectors/step_verdicts.py)
   is dropped when any of the three above fired: they say why the communication is exposed.
4. A wrap finding (`whole-model-wrap`, `tiny-layer-wrap`) comes before `missing-overlap`: its
   prefetch advice is about units the wrap change replaces (and their gathers' exposed time is
   what the re-wrap changes), so `missing-overlap` is dropped and the wrap finding says to
   re-profile after re-wrapping and add prefetch if gathers stay exposed. Wrap findings also
   explain `exposed-comm`.
5. `comm-bound`'s replayed remedies are settled against the report (detectors/comm_bound.py
   `settle`): a remedy `fp32-collectives` or `flat-sharding-multinode` proposes keeps its gain
   there, and the best of the others is taken beyond prefetch when `missing-overlap` is here.
6. A finding whose remaining gain falls to zero (or below its own firing minimum, when it
   records one as `min_gain_ms_per_step`) is dropped; the finding that took its time lists it
   in `evidence["explains"]`. Every reduced finding keeps its measured gain as
   `evidence["gain_before_reconcile_ms"]` and says why in its `gain_method`.
"""

from __future__ import annotations

from ..report import Finding
from .comm_bound import NO_OVERLAP_FIX, settle

# The order in which findings claim exposed communication time: earlier claims first.
CLAIM_ORDER = ("straggler", "missing-overlap", "comm-bound")
WRAP_FINDINGS = ("whole-model-wrap", "tiny-layer-wrap")


def _reduce(f: Finding, by: Finding) -> bool:
    """Take `by`'s gain out of `f`'s; False when nothing is left of `f` (drop it)."""
    if f.expected_gain_ms is None or not by.expected_gain_ms:
        return True  # nothing claimed by `by`: no overlap of claims
    if f.id == "comm-bound" and by.id == "missing-overlap":
        f.recommendation = f.recommendation.replace(
            NO_OVERLAP_FIX,
            f"Beyond the {by.expected_gain_ms:.2f} ms per step that prefetch recovers "
            "(`missing-overlap`), communication stays longer than the compute it could hide "
            "under; no prefetch setting removes the rest.",
        )
        if f.evidence.get("replayed_beyond_prefetch"):
            return True  # its gain was replayed on top of that prefetch: nothing to take out
    left = f.expected_gain_ms - by.expected_gain_ms
    floor = f.evidence.get("min_gain_ms_per_step")
    floor_ms = float(floor) if isinstance(floor, int | float) else 0.0
    if left <= 0.0 or left < floor_ms:
        by.evidence.setdefault("explains", []).append(f.id)
        return False
    f.evidence.setdefault("gain_before_reconcile_ms", f.expected_gain_ms)
    f.expected_gain_ms = round(left, 3)
    f.gain_method += (
        f"; minus the {by.expected_gain_ms:.2f} ms per step that `{by.id}` claims for the same "
        "exposed communication (detectors/reconcile.py)"
    )
    return True


def reconcile(findings: list[Finding]) -> list[Finding]:
    """The findings with overlapping claims on exposed communication reconciled (module doc);
    the others unchanged, order kept."""
    by_id = {f.id: f for f in findings}
    dropped: set[str] = set()
    st = by_id.get("straggler")
    hb = by_id.get("host-bound")
    if st is not None and hb is not None and hb.ranks and set(hb.ranks) <= set(st.ranks):
        st.evidence.setdefault("explains", []).append("host-bound")
        dropped.add("host-bound")
    wrap = next((by_id[i] for i in WRAP_FINDINGS if i in by_id), None)
    mo = by_id.get("missing-overlap")
    if wrap is not None and mo is not None:
        wrap.evidence.setdefault("explains", []).append("missing-overlap")
        wrap.evidence["exposed_gather_gain_ms_under_this_wrap"] = mo.expected_gain_ms
        wrap.recommendation += (
            f" The gathers are also exposed under today's wrap (prefetch would hide about "
            f"{mo.expected_gain_ms or 0:.2f} ms per step of them): re-profile after re-wrapping, "
            "and add explicit prefetch if `missing-overlap` fires then."
        )
        dropped.add("missing-overlap")
        del by_id["missing-overlap"]
    cb = by_id.get("comm-bound")
    if cb is not None:
        settle(cb, set(by_id) - dropped)
    explainer = next((by_id[i] for i in (*CLAIM_ORDER, *WRAP_FINDINGS) if i in by_id), None)
    if "exposed-comm" in by_id and explainer is not None:
        explainer.evidence.setdefault("explains", []).append("exposed-comm")
        dropped.add("exposed-comm")
    for i, later in enumerate(CLAIM_ORDER):
        f = by_id.get(later)
        if f is None:
            continue
        for earlier in CLAIM_ORDER[:i]:
            by = by_id.get(earlier)
            if by is None or earlier in dropped:
                continue
            if not _reduce(f, by):
                dropped.add(later)
                break
    return [f for f in findings if f.id not in dropped]
