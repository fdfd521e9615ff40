"""The gloo threads each process group starts, recorded at group creation from a thread listing
(a fake /proc/self/task here) around `distributed_c10d._new_process_group_helper`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import distributed_c10d

from zdiag.collectors import group_threads
from zdiag.collectors.group_threads import GLOO_THREAD, GroupThreads


class _Group:
    def __init__(self, name: str) -> None:
        self.group_name = name


def _thread(task_dir: Path, tid: int, name: str | None) -> None:
    (task_dir / str(tid)).mkdir()
    if name is not None:
        (task_dir / str(tid) / "comm").write_text(name + "\n")


def _create() -> Any:
    """Call whatever `_new_process_group_helper` is now (the fake, maybe wrapped)."""
    helper: Any = distributed_c10d._new_process_group_helper
    return helper()


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    """A fake /proc/self/task holding the calling thread (named "python") and a helper thread."""
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    _thread(task_dir, threading.get_native_id(), "python")
    _thread(task_dir, 7, "pt_autograd_0")
    return task_dir


@pytest.fixture
def creation(monkeypatch: pytest.MonkeyPatch, tasks: Path) -> list[dict[str, Any]]:
    """A fake `_new_process_group_helper` that starts the threads it is told to (the next entry
    of the returned list: {"name": group name or None, "threads": {tid: comm}, "raise": exc})."""
    plans: list[dict[str, Any]] = []

    def helper(*args: Any, **kwargs: Any) -> Any:
        plan = plans.pop(0)
        for tid, comm in plan.get("threads", {}).items():
            _thread(tasks, tid, comm)
        if plan.get("raise") is not None:
            raise plan["raise"]
        name = plan.get("name")
        return (_Group(name) if name else -100), None  # -100: NON_GROUP_MEMBER

    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper", helper)
    return plans


def test_a_group_gets_the_gloo_threads_it_started(
    tasks: Path, creation: list[dict[str, Any]]
) -> None:
    fake = distributed_c10d._new_process_group_helper
    recorder = GroupThreads(str(tasks)).install()
    assert distributed_c10d._new_process_group_helper is not fake
    creation.append({"name": "0", "threads": {101: GLOO_THREAD, 102: GLOO_THREAD}})
    creation.append(
        # a thread not yet named is the creator's name; other new threads are not gloo's
        {"name": "3", "threads": {201: GLOO_THREAD, 202: "python", 203: "pt_nccl_watchdg"}}
    )
    creation.append({"name": None, "threads": {301: GLOO_THREAD}})  # not a member: no group
    creation.append({"name": "5", "threads": {401: "other"}})  # a group without gloo threads
    for _ in range(4):
        _create()
    assert recorder.recorded() == {"0": [101, 102], "3": [201, 202]}
    assert recorder.error is None and recorder.active
    recorder.uninstall()
    assert distributed_c10d._new_process_group_helper is fake


def test_the_creation_s_own_error_passes_through_and_recording_goes_on(
    tasks: Path, creation: list[dict[str, Any]]
) -> None:
    recorder = GroupThreads(str(tasks)).install()
    creation.append({"raise": ValueError("group name taken"), "threads": {101: GLOO_THREAD}})
    creation.append({"name": "1", "threads": {111: GLOO_THREAD}})
    with pytest.raises(ValueError, match="group name taken"):
        _create()
    _create()
    assert recorder.recorded() == {"1": [111]} and recorder.error is None


def test_a_listing_that_fails_switches_recording_off_and_keeps_the_group(
    tasks: Path, creation: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = GroupThreads(str(tasks)).install()
    creation.append({"name": "0", "threads": {101: GLOO_THREAD}})
    creation.append({"name": "1", "threads": {111: GLOO_THREAD}})
    _create()

    def broken(task_dir: str) -> set[int]:
        raise PermissionError("denied")

    monkeypatch.setattr(group_threads, "thread_ids", broken)
    (result, _) = _create()
    assert result.group_name == "1"  # the creation itself is untouched
    assert not recorder.active and recorder.error == "PermissionError: denied"
    assert recorder.recorded() == {"0": [101]}


def test_groups_and_threads_are_capped(
    tasks: Path, creation: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_threads, "MAX_GROUPS", 2)
    recorder = GroupThreads(str(tasks)).install()
    creation.append({"name": "0", "threads": {100 + i: GLOO_THREAD for i in range(40)}})
    creation.append({"name": "1", "threads": {200: GLOO_THREAD}})
    creation.append({"name": "2", "threads": {300: GLOO_THREAD}})
    for _ in range(3):
        _create()
    recorded = recorder.recorded()
    assert recorded is not None and list(recorded) == ["0", "1"]
    assert len(recorded["0"]) == group_threads.MAX_THREADS and recorder.dropped == 1


def test_off_or_without_a_thread_listing_nothing_is_wrapped(
    tmp_path: Path, creation: list[dict[str, Any]]
) -> None:
    original = distributed_c10d._new_process_group_helper
    recorder = GroupThreads(str(tmp_path / "no-proc")).install()
    assert distributed_c10d._new_process_group_helper is original and not recorder.active
    assert recorder.recorded() is None
