"""Cross-check zdiag's flight-recorder analysis against torch's own analyzer (fr_trace).

    python bench/fr_crosscheck.py DUMP_DIR [DUMP_DIR ...] [--json]

For each folder of per-rank dumps it prints what torch's `torch.distributed.flight_recorder`
builder reports (the collectives it could not match: missing ranks, mismatches, the culprit
ranks of its errors) next to zdiag's culprits. torch's own loader calls `pickle.load`, so the
dumps are read here with zdiag's plain-container unpickler and handed to torch's `build_db` as
the dicts its `read_dir` would have produced. Needs torch (it runs on CPU); docs/flight-recorder.md
records the comparison on the real dumps.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from zdiag.analyzers.inputs.plain_pickle import PlainUnpickler
from zdiag.analyzers.run import flight_recorder as fr


def _raw_details(folder: Path) -> tuple[dict[str, dict[str, Any]], str]:
    """What torch's `read_dir` returns, read safely: {file name: {rank, entries, ...}}."""
    details: dict[str, dict[str, Any]] = {}
    version = ""
    for path in fr.find_dumps([folder])[0]:
        dump = fr.read_dump(path)
        if not dump.readable:
            continue  # torch's loader would raise on it
        with path.open("rb") as f:
            raw = PlainUnpickler(f).load()
        details[path.name] = {
            "host_name": f"host_rank{dump.rank}",
            "rank": dump.rank,
            "entries": raw["entries"],
            "version": raw["version"],
            "pg_config": raw["pg_config"],
        }
        version = version or str(raw["version"])
    return details, version


def torch_report(folder: Path) -> dict[str, Any]:
    """torch's analyzer on `folder`: unmatched collectives, their missing ranks and culprits."""
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.utils import align_trace_from_beginning

    details, version = _raw_details(folder)
    args = JobConfig().parse_args([str(folder), "--allow-incomplete-ranks"])
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    torch_logger = logging.getLogger("Flight Recorder")
    torch_logger.addHandler(handler)
    saved = torch_logger.handlers[:]
    torch_logger.handlers = [handler]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            db = build_db(details, args, version)
    finally:
        torch_logger.handlers = saved
    kept = {
        r: len(es)
        for r, es in align_trace_from_beginning(
            {d["rank"]: list(d["entries"]) for d in details.values()}
        ).items()
    }
    missing: dict[str, set[int]] = {}
    mismatch: dict[str, set[int]] = {}
    rows = []
    for c in db.collectives:
        errors = c.mismatch_collectives or {}
        if c.pass_check and not c.missing_ranks and not errors:
            continue
        missing.setdefault(c.pg_desc, set()).update(c.missing_ranks or ())
        mismatch.setdefault(c.pg_desc, set()).update(errors)
        rows.append(
            {
                "group": c.pg_desc,
                "seq": c.collective_seq_id,
                "op": c.collective_name,
                "missing_ranks": sorted(c.missing_ranks or ()),
                "mismatch_ranks": sorted(errors),
            }
        )
    return {
        "collectives": len(db.collectives),
        "entries_kept_by_alignment": kept,
        "disagreeing_collectives": rows,
        "missing_ranks_by_group": {g: sorted(r) for g, r in missing.items() if r},
        "mismatch_ranks_by_group": {g: sorted(r) for g, r in mismatch.items() if r},
        "log_lines": len(log.getvalue().splitlines()),
    }


def zdiag_report(folder: Path) -> dict[str, Any]:
    """zdiag's culprits and first disagreements on `folder`."""
    analysis, _ = fr.analyze_flight_recorder(fr.find_dumps([folder])[0])
    return {
        "culprits": {c.rank: c.reason for c in analysis.culprits},
        "waiting": list(analysis.waiting),
        "disagreements": [
            {
                "group": f"{d.pg_name}:{d.pg_desc}",
                "kind": d.kind,
                "seq": d.seq,
                "op": d.profiling_name,
                "missing": list(d.with_status("missing", "no dump")),
                "stuck": list(d.with_status("stuck")),
            }
            for d in analysis.disagreements
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Print torch's and zdiag's readings of each folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = {}
    for folder in args.folders:
        out[str(folder)] = {"torch": torch_report(folder), "zdiag": zdiag_report(folder)}
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=str)
        print()
        return 0
    for folder, both in out.items():
        t, z = both["torch"], both["zdiag"]
        print(folder)
        print(f"  zdiag culprits: {z['culprits']}")
        dropped = {r: n for r, n in t["entries_kept_by_alignment"].items() if n == 0}
        print(
            f"  torch: {t['collectives']} collectives built, {len(t['disagreeing_collectives'])} "
            f"with missing or mismatched ranks; ranks left without entries by its record-id "
            f"alignment: {sorted(dropped)}"
        )
        for g, ranks in sorted(t["missing_ranks_by_group"].items()):
            print(f"    torch missing ranks in {g}: {ranks}")
        for g, ranks in sorted(t["mismatch_ranks_by_group"].items()):
            print(f"    torch mismatch culprits in {g}: {ranks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
