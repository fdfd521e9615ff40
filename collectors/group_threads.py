"""Which OS threads each gloo process group runs its collectives on, recorded at group creation.

gloo's trace events (`gloo:all_reduce`, ...) name no process group, but every gloo
`ProcessGroup` runs its collectives on worker threads of its own (`pt_gloo_runloop`, started
when the group is created). `GroupThreads.install()` wraps torch.distributed's group creation
(`distributed_c10d._new_process_group_helper`, which `init_process_group`, `new_group` and
DeviceMesh's `new_group` path all reach) and lists this process's threads (`/proc/self/task`)
before and after each creation: the new threads named `pt_gloo_runloop` (or still carrying the
creating thread's name: a thread names itself once it runs) belong to the new group, named by
its c10d `group_name` (the trace header's `distributedInfo.pg_config` `pg_name`). The analysis
then gives a gloo op the group of the thread it ran on.

It must never slow or break training: it is installed only when the profiler is on; it costs
two directory listings and a few 16-byte reads per group creation (none per collective); its
own errors are caught, switch it off and are kept in `error` (the group creation's own
exceptions pass through untouched); at most `MAX_GROUPS` groups and `MAX_THREADS` threads per
group are kept. Not seen: groups made by `split_group` (a C++ split of an accelerator group),
groups created before the session started, and platforms without /proc (then nothing is
recorded and the analysis says the gloo calls could not be attributed).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

GLOO_THREAD = "pt_gloo_runloop"
"""The name gloo gives its worker threads (`ProcessGroupGloo::runLoop`)."""
TASK_DIR = "/proc/self/task"
MAX_GROUPS = 1024
"""Groups recorded per rank (a 3-D mesh of 1024 ranks has a few per dimension)."""
MAX_THREADS = 16
"""Threads kept per group (gloo starts 2 by default)."""
_WRAPPED = "__zdiag_group_threads_original__"


def thread_ids(task_dir: str = TASK_DIR) -> set[int]:
    """The ids of this process's threads (OSError when the listing cannot be read)."""
    return {int(name) for name in os.listdir(task_dir) if name.isdigit()}


def thread_name(tid: int, task_dir: str = TASK_DIR) -> str | None:
    """Thread `tid`'s name (`comm`), None when it is gone or unreadable."""
    try:
        with open(os.path.join(task_dir, str(tid), "comm"), encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _group_name(result: Any) -> str | None:
    """The c10d group name of what `_new_process_group_helper` returned ((pg, store) or pg),
    None for a rank outside the group (NON_GROUP_MEMBER)."""
    pg = result[0] if isinstance(result, tuple) and result else result
    name = getattr(pg, "group_name", None)
    return name if isinstance(name, str) and name else None


class GroupThreads:
    """Records, per process group created while installed, the gloo threads it started."""

    def __init__(self, task_dir: str = TASK_DIR) -> None:
        """A recorder that records nothing until `install`."""
        self.task_dir = task_dir
        self.active = False
        self.error: str | None = None  # the first error of the recording (it then stops)
        self.groups: dict[str, tuple[int, ...]] = {}  # group name -> its threads' ids
        self.dropped = 0  # groups beyond MAX_GROUPS
        self._patched: tuple[Any, Any] | None = None  # (module, original)

    def install(self) -> GroupThreads:
        """Wrap `distributed_c10d._new_process_group_helper` (raises when it cannot); without a
        thread listing (no /proc) nothing is installed."""
        if not os.path.isdir(self.task_dir):
            return self
        from torch.distributed import distributed_c10d

        fn = getattr(distributed_c10d, "_new_process_group_helper", None)
        if fn is None:
            raise RuntimeError("torch.distributed has no _new_process_group_helper")
        if not hasattr(fn, _WRAPPED):
            distributed_c10d._new_process_group_helper = self._wrap(fn)
            self._patched = (distributed_c10d, fn)
        self.active = True
        return self

    def uninstall(self) -> None:
        """Put the original back (unless someone replaced our wrapper since)."""
        self.active = False
        if self._patched is not None:
            module, original = self._patched
            if getattr(module._new_process_group_helper, _WRAPPED, None) is original:
                module._new_process_group_helper = original
            self._patched = None

    def recorded(self) -> dict[str, list[int]] | None:
        """{group name: thread ids} for the rank's manifest part; None when none was seen."""
        return {name: list(tids) for name, tids in self.groups.items()} or None

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(fn)
        def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
            if not recorder.active:
                return fn(*args, **kwargs)
            before = recorder._before()
            result = fn(*args, **kwargs)
            if before is not None:
                recorder._after(before, result)
            return result

        setattr(new_process_group_helper, _WRAPPED, fn)
        return new_process_group_helper

    def _before(self) -> set[int] | None:
        try:
            return thread_ids(self.task_dir)
        except Exception as exc:
            self._fail(exc)
            return None

    def _after(self, before: set[int], result: Any) -> None:
        """Keep the gloo threads that appeared while the group was created."""
        try:
            name = _group_name(result)
            if name is None:
                return
            new = sorted(thread_ids(self.task_dir) - before)
            if not new:
                return
            creator = thread_name(threading.get_native_id(), self.task_dir)
            tids = tuple(t for t in new if thread_name(t, self.task_dir) in (GLOO_THREAD, creator))[
                :MAX_THREADS
            ]
            if not tids:
                return
            if name not in self.groups and len(self.groups) >= MAX_GROUPS:
                self.dropped += 1
                return
            self.groups[name] = tids
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.active = False
        if self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"
