"""FSDP2's unshard async op on CPU/gloo: the one setting that lets its gathers overlap compute there.

On a CPU, FSDP2's default all-gather blocks the only thread whatever the prefetch lists; with
`model._set_unshard_async_op(True)` on the root (a private API) gloo's worker thread runs the
prefetched gather while the training thread computes. The captured description records it per
unit (`unshard_async_op`); every remedy for an FSDP2 CPU run without it adds that line, and no
finding claims the run has every overlap setting while it lacks it.
"""

from __future__ import annotations

from ..frameworks import Framework, Remedy
from .fact_sheet import RunFactSheet

ASYNC_OP_LINE = (
    "# CPU/gloo only: lets prefetched gathers overlap\nmodel._set_unshard_async_op(True)"
)


def lacks_unshard_async_op(sheet: RunFactSheet, fw: Framework | None) -> bool:
    """Whether `fw` is FSDP2 on a CPU-only run whose gathers cannot overlap: it does not set the
    unshard async op (the description's units, the harness)."""
    return (
        fw is not None and fw.name == "fsdp2" and sheet.cpu_only and not sheet.gathers_can_overlap()
    )


def with_unshard_async_op(
    sheet: RunFactSheet, fw: Framework | None, remedy: Remedy | None
) -> Remedy | None:
    """FSDP2 on CPU/gloo without its unshard async op: `remedy` plus that setting, set last
    (without it nothing overlaps there), or that setting alone when `remedy` is None; any other
    run: `remedy` as it is."""
    if not lacks_unshard_async_op(sheet, fw):
        return remedy
    if remedy is None:
        return Remedy(
            "Set FSDP2's unshard async op on the root (a private API): on CPU/gloo the run's "
            "prefetch lists overlap nothing without it.",
            ASYNC_OP_LINE,
        )
    return Remedy(remedy.text, f"{remedy.code}\n{ASYNC_OP_LINE}" if remedy.code else None)
