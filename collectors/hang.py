"""What a rank is doing when it stops making progress: its stacks, its collective, its flight recorder.

`HangWatchdog` is a daemon thread fed by one O(1) `beat()` per finished step. When no step
finishes within the hang timeout it calls `on_hang` once (again only after a step finishes), off
the training thread, which keeps running or stays blocked as it was: the watchdog only reads.

`describe_hang()` is what `on_hang` records: the Python stacks of every thread
(`sys._current_frames`, readable while the training thread sits in a C++ collective that released
the GIL), the collective the rank is in (the innermost `torch.distributed` frame, its process group
and sequence number, and the FSDP unit whose gather or reduction it is, read from the frames'
locals), the innermost frame of the user's own code, and the flight recorder's last entries when
the backend keeps them (NCCL, and gloo on torch >= 2.7 when `TORCH_FR_BUFFER_SIZE` is set).

Default timeout: `HANG_FIRST_STEP_S` until `HANG_MIN_STEPS` steps have finished (start-up,
compilation and the first gathers make the first steps slow), then the larger of
`HANG_FLOOR_S` and `HANG_MEDIAN_MULTIPLE` times the median of the last `HANG_WINDOW` step times.
"""

from __future__ import annotations

import json
import linecache
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

from .run_records import HangRecord, SourceLine

HANG_FIRST_STEP_S = 300.0
"""Timeout before `HANG_MIN_STEPS` steps have finished: start-up can take minutes (compilation,
checkpoint loading); NCCL's own collective timeout (10 min by default) is longer."""
HANG_FLOOR_S = 60.0
"""The shortest default timeout once steps are timed: a stall of a minute is never noise."""
HANG_MEDIAN_MULTIPLE = 20.0
"""A step 20x slower than the median is a hang, not a slow step (a checkpoint save or an
evaluation pass between steps takes a few step times, rarely twenty)."""
HANG_MIN_STEPS = 3
HANG_WINDOW = 64
POLL_S = 0.5
"""How often the watchdog looks: the dump comes at most this late after the timeout."""

MAX_FRAMES_PER_THREAD = 64
MAX_THREADS = 64
MAX_FLIGHT_RECORDER_ENTRIES = 200

_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
_FSDP = os.sep + "fsdp" + os.sep
_ZDIAG_DIRS = tuple(
    os.path.realpath(d) + os.sep
    for d in (os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "zdiag"))
)
_LIBRARIES = (
    os.sep + "site-packages" + os.sep,
    os.sep + "dist-packages" + os.sep,
    os.path.dirname(os.__file__) + os.sep,  # the standard library
    "<frozen ",
    "<string>",
)


def default_timeout_s(step_durations_s: list[float]) -> float:
    """The hang timeout for these recent step times (see the module docstring)."""
    if len(step_durations_s) < HANG_MIN_STEPS:
        return HANG_FIRST_STEP_S
    return max(HANG_FLOOR_S, HANG_MEDIAN_MULTIPLE * statistics.median(step_durations_s))


class HangWatchdog:
    """Calls `on_hang(stalled_s, timeout_s)` once when no step finishes within the timeout.

    `timeout_s=None` uses `default_timeout_s` over the recent step times. The thread is a daemon:
    it never keeps a finished process alive.
    """

    def __init__(
        self,
        on_hang: Callable[[float, float], None],
        timeout_s: float | None = None,
        *,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_hang = on_hang
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._clock = clock
        self._last = clock()
        self._durations: deque[float] = deque(maxlen=HANG_WINDOW)
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step_duration_s: float) -> None:
        """A step finished (called on the training thread: two stores and an append)."""
        self._last = self._clock()
        self._durations.append(step_duration_s)
        self._fired = False

    def timeout_s(self) -> float:
        """The timeout in force now."""
        if self._timeout_s is not None:
            return self._timeout_s
        return default_timeout_s(list(self._durations))

    def start(self) -> HangWatchdog:
        """Start watching (from now: the time before the first step counts)."""
        self._last = self._clock()
        self._thread = threading.Thread(target=self._run, name="zdiag-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (idempotent; does not wait for a dump in progress)."""
        self._stop.set()

    def check(self) -> bool:
        """One look: call `on_hang` if the timeout has passed since the last step. True if it did."""
        if self._fired:
            return False
        stalled = self._clock() - self._last
        limit = self.timeout_s()
        if stalled < limit:
            return False
        self._fired = True
        self._on_hang(stalled, limit)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check()
            except Exception:  # the watchdog must never take the rank down
                self._fired = True


# --- what the rank is doing ----------------------------------------------------------------


def _frame_entry(frame: FrameType) -> dict[str, Any]:
    code = frame.f_code
    line = frame.f_lineno or 0
    return {
        "file": code.co_filename,
        "line": line,
        "function": code.co_name,
        "code": linecache.getline(code.co_filename, line).strip()[:200],
    }


def _frames(frame: FrameType | None) -> list[FrameType]:
    """Innermost first, at most MAX_FRAMES_PER_THREAD."""
    out: list[FrameType] = []
    while frame is not None and len(out) < MAX_FRAMES_PER_THREAD:
        out.append(frame)
        frame = frame.f_back
    return out


def is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's code (not zdiag, an installed library or the stdlib)."""
    if os.path.realpath(filename).startswith(_ZDIAG_DIRS):
        return False
    return not any(part in filename for part in _LIBRARIES)


def _describe_group(group: Any) -> dict[str, Any]:
    """Name, description, size, ranks and sequence number of a ProcessGroup (what is readable)."""
    out: dict[str, Any] = {}
    for key, read in (
        ("name", lambda g: g.group_name),
        ("description", lambda g: g.group_desc),
        ("size", lambda g: g.size()),
        ("sequence_number", lambda g: g._get_sequence_number_for_group()),
    ):
        try:
            out[key] = read(group)
        except Exception:
            continue
    try:
        import torch.distributed as dist

        out["ranks"] = list(dist.get_process_group_ranks(group))
    except Exception:
        pass
    return out


def _group_in(frame: FrameType) -> Any:
    for name in ("group", "process_group", "pg"):
        value = frame.f_locals.get(name)
        if value is not None and hasattr(value, "size") and hasattr(value, "group_name"):
            return value
    return None


def _fsdp_unit_in(frame: FrameType) -> str | None:
    """The FSDP unit a frame works for: an FSDP2 param group's or an FSDP1 handle's module path."""
    owner = frame.f_locals.get("self")
    for attr in ("_module_fqn", "_fully_sharded_module_fqn"):
        fqn = getattr(owner, attr, None)
        if isinstance(fqn, str):
            return fqn
    group = getattr(owner, "_fsdp_param_group", None)
    fqn = getattr(group, "_module_fqn", None)
    return fqn if isinstance(fqn, str) else None


def find_collective(frames: list[FrameType]) -> dict[str, Any] | None:
    """The collective a stack is in: the innermost torch.distributed frame, its process group
    (from the locals of the torch.distributed frames), and the FSDP unit it serves."""
    dist_frames = [f for f in frames if _TORCH_DIST in f.f_code.co_filename]
    if not dist_frames:
        return None
    innermost = dist_frames[0]
    out: dict[str, Any] = {"op": innermost.f_code.co_name, "frame": _frame_entry(innermost)}
    for f in dist_frames:
        group = _group_in(f)
        if group is not None:
            out["process_group"] = _describe_group(group)
            break
    for f in dist_frames:
        if _FSDP in f.f_code.co_filename:
            unit = _fsdp_unit_in(f)
            if unit is not None:
                out["fsdp_unit"] = unit
                break
    return out


def flight_recorder_entries(limit: int = MAX_FLIGHT_RECORDER_ENTRIES) -> dict[str, Any] | None:
    """The flight recorder's dump as JSON (entries trimmed to the last `limit`), None when the
    backend keeps none (the buffer is off, or this torch has no JSON dump)."""
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(
            c10d, "_dump_nccl_trace_json", None
        )
        if dump is None:
            return None
        data = json.loads(dump(True, True))
    except Exception:
        return None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not entries:
        return None
    data["entries"] = entries[-limit:]
    return data


def describe_hang(main_thread_id: int | None = None) -> dict[str, Any]:
    """Every thread's stack (innermost first), the training thread's collective and user frame."""
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    main_frames: list[FrameType] = []
    for ident, frame in list(sys._current_frames().items())[:MAX_THREADS]:
        if ident == threading.get_ident() and ident != main_thread_id:
            continue  # the watchdog or signal watcher itself (a signal handler on the training
            # thread keeps it: its outer frames are where the signal found the training)
        frames = _frames(frame)
        if ident == main_thread_id:
            main_frames = frames
        threads.append(
            {
                "thread": names.get(ident, str(ident)),
                "ident": ident,
                "training_thread": ident == main_thread_id,
                "frames": [_frame_entry(f) for f in frames],
            }
        )
    collective = find_collective(main_frames)
    if collective is None:  # the training thread may wait on a helper thread's collective
        for frames in (_frames(f) for f in sys._current_frames().values()):
            collective = find_collective(frames)
            if collective is not None:
                break
    user = next((f for f in main_frames if is_user_file(f.f_code.co_filename)), None)
    return {
        "threads": threads,
        "collective": collective,
        "user_frame": _frame_entry(user) if user is not None else None,
        "flight_recorder": flight_recorder_entries(),
    }


def hang_record(
    dump: dict[str, Any], step: int, stalled_s: float, timeout_s: float, dump_relpath: str
) -> HangRecord:
    """The manifest's summary of a `describe_hang` dump (the full dump is a file of its own)."""
    collective = dump.get("collective") or {}
    group = collective.get("process_group") or {}
    user = dump.get("user_frame") or {}
    ranks = group.get("ranks")
    seq = group.get("sequence_number")
    return HangRecord(
        step=step,
        stalled_s=round(stalled_s, 3),
        timeout_s=round(timeout_s, 3),
        time_unix=time.time(),
        op=collective.get("op"),
        group_name=str(group["name"]) if group.get("name") is not None else None,
        group_ranks=tuple(r for r in ranks if isinstance(r, int))
        if isinstance(ranks, list)
        else (),
        sequence_number=seq if isinstance(seq, int) else None,
        fsdp_unit=collective.get("fsdp_unit"),
        user_file=user.get("file"),
        user_line=user.get("line"),
        user_function=user.get("function"),
        user_code=user.get("code"),
        dump=dump_relpath,
    )


def raised_at(exc: BaseException) -> SourceLine | None:
    """The innermost line of the user's code in an exception's traceback (None when the
    traceback never passes through it: an error inside zdiag or a library only)."""
    try:
        frames = traceback.extract_tb(exc.__traceback__, limit=MAX_FRAMES_PER_THREAD * 4)
    except Exception:
        return None
    for fs in reversed(frames):
        if is_user_file(fs.filename):
            code = (fs.line or "").strip()[:200] or None
            return SourceLine(fs.filename, fs.lineno or 0, fs.name, code)
    return None


def hang_line(hang: HangRecord) -> str:
    """Where a hung rank is, in one line: the collective (group, sequence number, FSDP unit) and
    the user's frame, e.g. `all_gather_single #34 (group 0) at train.py:67`."""
    parts = []
    if hang.op is not None:
        seq = f" #{hang.sequence_number}" if hang.sequence_number is not None else ""
        group = f" (group {hang.group_name})" if hang.group_name is not None else ""
        unit = f" for {hang.fsdp_unit or '(root)'}" if hang.fsdp_unit is not None else ""
        parts.append(f"{hang.op}{seq}{group}{unit}")
    if hang.user_file is not None:
        parts.append(f"at {os.path.basename(hang.user_file)}:{hang.user_line}")
    return " ".join(parts) or "an unknown place (no stack)"
