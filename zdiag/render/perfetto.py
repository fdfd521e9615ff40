"""`zdiag analyze PATH --perfetto FILE`: the ranks' traces with the zdiag overlay merged in.

The overlay (perfetto_overlay.py) is step verdicts and findings as tracks; perfetto_merge.py puts
it into the ranks' Kineto traces. This module chooses what goes into which file.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from zdiag.analyzers.report import Report
from zdiag.render.format import fmt_ranks
from zdiag.render.perfetto_merge import MAX_MERGED_RANKS, merged_trace
from zdiag.render.perfetto_overlay import overlay_events
from zdiag.render.renderer import Destination, Output, Rendered, Renderer
from zdiag.render.stats import detailed_ranks

RANK_PLACEHOLDER = "{rank}"
"""In a --perfetto file name: write one file per rank (`out/rank-{rank}.json`)."""


def _encode(data: dict[str, Any], path: Path) -> bytes:
    raw = msgspec.json.encode(data)
    return gzip.compress(raw, 6, mtime=0) if path.name.endswith(".gz") else raw


class PerfettoRenderer(Renderer):
    """The trace for ui.perfetto.dev: the ranks' traces with the zdiag overlay merged in.

    - a file: one trace with the overlay of every rank and the Kineto traces of up to
      `perfetto_merge.MAX_MERGED_RANKS` of them (rank 0 and the slowest), finding markers on
      their events; gzipped when the name ends in .gz;
    - a file name with `{rank}`: one such file per rank, holding that rank's trace and overlay
      (made one at a time, as the writer asks for them);
    - standard output, or traces that cannot be read (a report rendered away from its traces):
      the overlay alone, which lines up with the traces when loaded beside them.

    The notes say what the user should know (ranks written without a trace).
    """

    name = "perfetto"

    def render(self, report: Report, destination: Destination) -> Rendered:
        """The merged trace(s), or the overlay alone for standard output."""
        path = destination.path
        if path is None:
            return Rendered.one(destination, msgspec.json.encode(overlay_events(report)))
        if RANK_PLACEHOLDER in path.name:
            return _per_rank(report, path)
        chosen = detailed_ranks(report.ranks, MAX_MERGED_RANKS)
        data, missing = merged_trace(report, chosen)
        notes = []
        if len(chosen) < len(report.ranks):
            notes.append(
                f"the traces of {len(chosen)} of {len(report.ranks)} ranks (rank 0 and the "
                f"slowest) are merged in; every rank has its zdiag tracks; "
                f"'{RANK_PLACEHOLDER}' in the file name writes one file per rank."
            )
        notes += _missing_note(missing)
        return Rendered.one(destination, _encode(data, path), notes)


def _rank_path(path: Path, rank: int) -> Path:
    return path.with_name(path.name.replace(RANK_PLACEHOLDER, str(rank)))


def _per_rank(report: Report, path: Path) -> Rendered:
    """One file per rank (`{rank}` in `path`), each made when the writer asks for it; the note
    on ranks without a readable trace comes once all are made."""
    notes: list[str] = []

    def outputs() -> Iterator[Output]:
        missing: list[int] = []
        for rank in report.ranks:
            one = msgspec.structs.replace(report, ranks=[rank])
            data, lost = merged_trace(one, [rank])
            target = _rank_path(path, rank.rank)
            yield Output(target, _encode(data, target))
            missing += lost
        notes.extend(_missing_note(missing))

    return Rendered(tuple(_rank_path(path, r.rank) for r in report.ranks), outputs(), notes)


def _missing_note(missing: list[int]) -> list[str]:
    if not missing:
        return []
    return [
        f"no readable trace for {fmt_ranks(missing)}: their zdiag tracks are written "
        "alone (open them beside the original traces)."
    ]
