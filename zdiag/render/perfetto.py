"""`zdiag analyze PATH --perfetto FILE`: the ranks' traces with the zdiag overlay merged in.

The overlay (perfetto_overlay.py) is step verdicts and findings as tracks; perfetto_merge.py puts
it into the ranks' Kineto traces. This module chooses what goes into which file.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import msgspec

from zdiag.analyzers.report import Report
from zdiag.render.format import fmt_ranks
from zdiag.render.output import write_output
from zdiag.render.perfetto_merge import MAX_MERGED_RANKS, merged_trace
from zdiag.render.perfetto_overlay import overlay_events
from zdiag.render.renderer import Destination, Renderer
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
    - a file name with `{rank}`: one such file per rank, holding that rank's trace and overlay;
    - standard output, or traces that cannot be read (a report rendered away from its traces):
      the overlay alone, which lines up with the traces when loaded beside them.

    `notes` lists, after `render`, what the user should know (ranks written without a trace).
    """

    name = "perfetto"

    def __init__(self) -> None:
        self.notes: list[str] = []

    def render(self, report: Report, destination: Destination) -> None:
        """Write the merged trace(s), or the overlay alone to standard output."""
        path = destination.path
        if path is None:
            destination.write(msgspec.json.encode(overlay_events(report)))
            return
        missing: list[int] = []
        if RANK_PLACEHOLDER in path.name:
            for rank in report.ranks:
                one = msgspec.structs.replace(report, ranks=[rank])
                data, lost = merged_trace(one, [rank])
                target = path.with_name(path.name.replace(RANK_PLACEHOLDER, str(rank.rank)))
                write_output(target, _encode(data, target))
                missing += lost
        else:
            chosen = detailed_ranks(report.ranks, MAX_MERGED_RANKS)
            data, missing = merged_trace(report, chosen)
            destination.write(_encode(data, path))
            if len(chosen) < len(report.ranks):
                self.notes.append(
                    f"the traces of {len(chosen)} of {len(report.ranks)} ranks (rank 0 and the "
                    f"slowest) are merged in; every rank has its zdiag tracks; "
                    f"'{RANK_PLACEHOLDER}' in the file name writes one file per rank."
                )
        if missing:
            self.notes.append(
                f"no readable trace for {fmt_ranks(missing)}: their zdiag tracks are written "
                "alone (open them beside the original traces)."
            )
