"""`fragmentation`: the caching allocator reserves much more than is allocated.

From a CUDA snapshot: the free blocks inside segments that also hold live blocks. A wholly free
segment is not counted (the allocator releases cached segments and retries before it reports
out of memory); free space beside live blocks cannot be released and serves only requests that
fit one free block. It is a problem when it is at least FRAGMENTATION_SHARE of what is reserved
and at least MIN_FRAGMENTED_BYTES, and critical when the allocation that failed would have fit
into the fragmented bytes. Expandable
segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`) let segments grow instead of
splitting, which returns most of it; the gain is the fragmented bytes.
"""

from __future__ import annotations

from ..report import Finding, Severity
from .context import DetectorContext
from .memory_common import MIB
from .rule import Rule, Threshold

# (the reasoning behind each value: RULE's thresholds, at the end of the module)
FRAGMENTATION_SHARE = 0.3
MIN_FRAGMENTED_BYTES = 256 * MIB


def detect(ctx: DetectorContext) -> list[Finding]:
    """The fragmentation finding (the rank with the most fragmented bytes), or none."""
    hits = []
    for b in ctx.memory_breakdowns:
        if b.reserved_bytes is None or b.fragmented_bytes is None or not b.reserved_bytes:
            continue  # unknown stays unknown
        frag = b.fragmented_bytes
        if frag >= MIN_FRAGMENTED_BYTES and frag >= FRAGMENTATION_SHARE * b.reserved_bytes:
            hits.append((frag, b))
    if not hits:
        return []
    frag, worst = max(hits, key=lambda h: h[0])
    assert worst.reserved_bytes is not None
    request = worst.oom_request_bytes
    would_fit = worst.oom and request is not None and request <= frag
    severity: Severity = "critical" if would_fit else "warning"
    largest = worst.largest_free_block_bytes
    return [
        Finding(
            id="fragmentation",
            severity=severity,
            title=(
                f"{frag / MIB:.0f} MiB free but stranded between live blocks "
                f"({frag / worst.reserved_bytes:.0%} of {worst.reserved_bytes / MIB:.0f} MiB "
                "reserved): the allocator's cache is fragmented"
            ),
            ranks=sorted(b.rank for _, b in hits),
            evidence={
                "source": worst.source,
                "reserved_bytes": worst.reserved_bytes,
                "allocated_bytes": worst.allocated_bytes,
                "fragmented_bytes": frag,
                "largest_free_block_bytes": largest,
                "segments": worst.segments,
                "oom_request_bytes": request,
                "threshold_share": FRAGMENTATION_SHARE,
                "threshold_bytes": MIN_FRAGMENTED_BYTES,
            },
            recommendation=(
                "Let the caching allocator grow segments instead of splitting them: set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts."
                + (
                    f" The failed {request / MIB:.0f} MiB allocation would fit in the "
                    f"fragmented {frag / MIB:.0f} MiB (largest free block "
                    f"{(largest or 0) / MIB:.0f} MiB)."
                    if would_fit and request is not None
                    else ""
                )
            ),
            code='import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"'
            "  # before importing torch",
            expected_gain_bytes=frag,
            gain_method="free bytes in segments that also hold live blocks (snapshot): memory "
            "the cache holds and cannot release, which expandable segments return for reuse",
        )
    ]


RULE = Rule(
    id="fragmentation",
    summary="the caching allocator holds free memory stranded between live blocks",
    detect=detect,
    what=(
        "The caching allocator holds free bytes it cannot release: in a CUDA snapshot, the "
        "free blocks inside segments that also hold live blocks are >= 30% of what is reserved "
        "and >= 256 MiB (wholly free segments are not counted: the allocator releases them "
        "before it reports out of memory). Critical when the allocation that failed would have "
        "fit into the fragmented bytes."
    ),
    why=(
        "Free space beside live blocks serves only requests that fit one free block: a run can "
        "fail with gigabytes free. Expandable segments let segments grow instead of splitting, "
        "which returns most of it."
    ),
    example=(
        "1210 MiB free but stranded between live blocks (38% of 3200 MiB reserved): the "
        "allocator's cache is fragmented."
    ),
    fix="`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` before the process starts.",
    gain="The fragmented bytes (memory the cache holds and cannot release).",
    scope="CUDA runs with an allocator snapshot (`zdiag run --profile-memory`, or given)",
    thresholds=(
        Threshold(
            "FRAGMENTATION_SHARE",
            FRAGMENTATION_SHARE,
            "Reserved-but-unallocated share of reserved memory from which fragmentation is "
            "reported.",
            evidence="threshold_share",
        ),
        Threshold(
            "MIN_FRAGMENTED_BYTES",
            MIN_FRAGMENTED_BYTES,
            "Below this the allocator's own rounding and caching explain the gap: not worth a "
            "change.",
            evidence="threshold_bytes",
        ),
    ),
)
