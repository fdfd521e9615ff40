"""The one place zdiag talks to HTA (Holistic Trace Analysis), for cross-checks and benchmarks.

HTA is published on PyPI as `traceinsight` (import name `hta`) and pulls in jupyterlab, so it is
the optional extra `zdiag[hta]`; `hta` is imported lazily, only when a function here is called.

`hta_breakdown(paths)` runs HTA's temporal breakdown and its communication/computation overlap on
one or more per-rank Kineto traces and returns one `HtaBreakdown` per rank. What HTA measures
(read from traceinsight 0.6.1's source; docs/hta-crosscheck.md compares it with zdiag):

- Nanosecond-resolution traces: every event is shrunk inward to whole microseconds (start
  rounded up, end rounded down) unless `ns_rounding=False`.
- Its window: GPU events launched by CPU ops that start before the *last* `ProfilerStep`
  (the last step is dropped unless `include_last_profiler_step=True`); kernels whose launch it
  cannot correlate are dropped as well.
- `kernel_time_us`: from the first GPU event's start to the last one's end in that window.
- `idle_us`: kernel_time minus the union of all GPU events (kernels, memcpy, memset).
- `compute_us`: union of the kernels its name patterns call computation (not `nccl*`, `hip*`,
  `*Memcpy*`, `*Memset*`, ...).
- `non_compute_us`: kernel_time - compute - idle (communication, memcpy, memset not under compute).
- `comm_comp_overlap_ratio`: |comm ∩ compute| / |comm|, comm being the kernels matching
  `^nccl`, `ncclKernel`, `^hip`, `^hccl` (so e.g. custom all-reduce kernels count as compute).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from zdiag.errors import InputError, UserError

INSTALL_HINT = "pip install 'zdiag[hta]'"


class HtaUnavailable(UserError):
    """HTA (`traceinsight`) is not installed."""


class HtaFailed(InputError):
    """HTA raised while analyzing a trace (it fails on some valid real traces)."""


@dataclass(frozen=True)
class HtaBreakdown:
    """HTA's figures for one rank, in microseconds (see the module docstring for definitions)."""

    rank: int
    kernel_time_us: float
    idle_us: float
    compute_us: float
    non_compute_us: float
    comm_comp_overlap_ratio: float | None  # None when HTA found no communication kernels


def import_hta() -> ModuleType:
    """Import and return the `hta` package, or raise HtaUnavailable saying how to install it."""
    try:
        import hta
    except ImportError as exc:
        raise HtaUnavailable(
            f"HTA (Holistic Trace Analysis) is not installed; install it with `{INSTALL_HINT}`"
        ) from exc
    return hta


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def hta_breakdown(
    paths: Sequence[Path] | Path,
    *,
    ranks: Sequence[int] | None = None,
    include_last_profiler_step: bool = False,
    ns_rounding: bool = True,
    parallel: bool = False,
) -> list[HtaBreakdown]:
    """Run HTA's temporal breakdown and comm/comp overlap on per-rank trace files.

    `paths` is a folder (HTA reads every *.json / *.json.gz in it and takes ranks from each
    trace's distributedInfo) or a list of trace files; for files, `ranks` gives their ranks
    (default 0, 1, ... in order), so traces without distributedInfo or from different jobs work.
    `ns_rounding=False` turns off HTA's default rounding of nanosecond-resolution events inward
    to whole microseconds (start rounded up, end down), which shortens every such event by up to
    2 us (restored afterwards; HTA keeps it as process-wide state).
    `parallel=True` lets HTA parse ranks in its forked process pool (its own default, for timing
    comparisons); the default parses them in this process, because a fork from a process whose
    threads hold locks (torch's, a test runner's) can deadlock or crash the children.
    Raises HtaUnavailable when HTA is not installed and HtaFailed (naming the traces and HTA's
    error) when HTA cannot analyze them. Results are sorted by rank.
    """
    import_hta()
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

    trace_dir, trace_files, label = _hta_inputs(paths, ranks)

    from hta.configs.env_options import HTAEnvOptions

    options = HTAEnvOptions.instance()
    saved_rounding_off = options.disable_ns_rounding()
    options.set_disable_ns_rounding(not ns_rounding)
    hta_logger = logging.getLogger("hta")
    saved_level = hta_logger.level
    hta_logger.setLevel(logging.ERROR)  # HTA logs progress at INFO on stderr; analysis is quiet
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HTA's divide-by-zero warnings on comm-free traces
            if parallel:
                analysis = TraceAnalysis(
                    trace_files=trace_files,
                    trace_dir=trace_dir,
                    include_last_profiler_step=include_last_profiler_step,
                )
            else:  # TraceAnalysis.__init__ without its process pool (same two calls)
                trace = Trace(trace_files, trace_dir)
                trace.load_traces(include_last_profiler_step, use_multiprocessing=False)
                analysis = TraceAnalysis.__new__(TraceAnalysis)
                analysis.t = trace
            breakdown = analysis.get_temporal_breakdown(visualize=False)
            overlap = analysis.get_comm_comp_overlap(visualize=False)
    except (HtaUnavailable, InputError):
        raise
    except Exception as exc:  # HTA signals bad input with IndexError, AssertionError, ...
        raise HtaFailed(f"HTA failed on {label}: {type(exc).__name__}: {exc}") from exc
    finally:
        hta_logger.setLevel(saved_level)
        options.set_disable_ns_rounding(saved_rounding_off)

    return _breakdowns(breakdown, overlap)


def _hta_inputs(
    paths: Sequence[Path] | Path, ranks: Sequence[int] | None
) -> tuple[str, dict[int, str] | None, str]:
    """(HTA's trace folder, its rank -> file map or None for the whole folder, the paths as
    errors name them); InputError for what HTA cannot be given."""
    if isinstance(paths, Path):
        if not paths.is_dir():
            raise InputError(f"{paths}: not a folder of traces")
        return str(paths), None, str(paths)
    given = [Path(p) for p in paths]
    files = [p.resolve() for p in given]  # HTA needs one real folder holding them all
    if not files:
        raise InputError("no trace files given to HTA")
    rank_list = list(ranks) if ranks is not None else list(range(len(files)))
    if len(rank_list) != len(files) or len(set(rank_list)) != len(rank_list):
        raise InputError("give one distinct rank per trace file")
    trace_files = {r: str(f) for r, f in zip(rank_list, files, strict=True)}
    label = ", ".join(str(p) for p in given)  # errors name the paths the user gave
    return str(files[0].parent), trace_files, label


def _breakdowns(breakdown: Any, overlap: Any) -> list[HtaBreakdown]:
    """HTA's temporal breakdown and overlap tables as HtaBreakdowns, by rank."""
    # HTA returns the overlap as a percentage rounded to 0.01
    ratio_by_rank: dict[int, float | None] = {}
    for r, pct in zip(overlap["rank"], overlap["comp_comm_overlap_pctg"], strict=True):
        v = _finite(pct)
        ratio_by_rank[int(r)] = None if v is None else v / 100.0
    out = []
    for row in breakdown.to_dict("records"):
        rank = int(row["rank"])
        out.append(
            HtaBreakdown(
                rank=rank,
                kernel_time_us=float(row["kernel_time(us)"]),
                idle_us=float(row["idle_time(us)"]),
                compute_us=float(row["compute_time(us)"]),
                non_compute_us=float(row["non_compute_time(us)"]),
                comm_comp_overlap_ratio=ratio_by_rank.get(rank),
            )
        )
    return sorted(out, key=lambda b: b.rank)
