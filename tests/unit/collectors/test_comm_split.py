"""The in-rank comm split (`collectors/comm_split.py`) on a real 1-rank gloo group: what it
counts, that it puts torch back, and that its own failures never reach the training."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from zdiag.collectors import comm_split
from zdiag.collectors.comm_split import CommTimer, union_ms


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def timer() -> Iterator[CommTimer]:
    t = CommTimer().install()
    try:
        yield t
    finally:
        t.uninstall()


def test_union_clips_to_the_step_and_merges_overlaps() -> None:
    assert union_ms([(0.0, 0.002), (0.001, 0.003), (0.010, 0.020)], 0.0, 0.015) == pytest.approx(
        8.0
    )
    assert union_ms([(-1.0, 0.5)], 0.0, 1.0) == pytest.approx(500.0)
    assert union_ms([], 0.0, 1.0) == 0.0


def test_blocking_and_async_collectives_are_counted(group: None, timer: CommTimer) -> None:
    x = torch.ones(1 << 18)  # 1 MiB
    start = time.perf_counter()
    dist.all_reduce(x)
    work = dist.all_reduce(x, async_op=True)
    assert isinstance(work, dist.Work)  # the real Work: FSDP2 checks its type
    work.wait()
    time.sleep(0.02)  # compute
    split = timer.take(start, time.perf_counter())
    assert split is not None
    assert split.comm_ms > 0 and 0 < split.exposed_comm_ms <= split.comm_ms + 1.0
    assert split.compute_ms >= 20.0
    assert split.last_collective == "all_reduce 1.0 MiB"
    again = timer.take(start, time.perf_counter())  # consumed: the next step starts empty
    assert again is not None and again.comm_ms == 0.0


def test_uninstall_puts_torch_back() -> None:
    before = (dist.all_reduce, distributed_c10d.all_gather_single, dist.Work.wait)
    timer = CommTimer().install()
    assert dist.all_reduce is not before[0] and dist.all_reduce is distributed_c10d.all_reduce
    timer.uninstall()
    assert (dist.all_reduce, distributed_c10d.all_gather_single, dist.Work.wait) == before
    assert timer.take(0.0, 1.0) is None


def test_a_collectives_own_error_passes_through(group: None, timer: CommTimer) -> None:
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        dist.all_reduce("not a tensor")  # type: ignore[arg-type]
    assert timer.active and timer.error is None


def test_an_error_of_the_timer_switches_it_off_not_the_collective(
    group: None, timer: CommTimer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("clock broke")

    monkeypatch.setattr(timer, "_add", broken)
    x = torch.ones(4)
    dist.all_reduce(x)  # the timer fails inside; the collective still runs
    assert x.tolist() == [1.0] * 4
    assert not timer.active and timer.error == "RuntimeError: clock broke"
    assert timer.take(0.0, 1.0) is None


def test_intervals_are_bounded(
    group: None, timer: CommTimer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(comm_split, "MAX_INTERVALS", 3)
    x = torch.ones(4)
    for _ in range(5):
        dist.all_reduce(x)
    assert len(timer._flight) == 3 and len(timer._waits) == 3
    assert timer.overflow >= 4  # 2 calls past the bound, each with a flight and a wait


def test_calls_are_split_by_mesh_dimension(group: None, timer: CommTimer) -> None:
    """A (1, 1) ("dp", "tp") mesh: a c10d all-reduce on the dp group and a functional
    all-reduce over the tp dimension (what DTensor calls) land in their own dimension."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    # on one rank DeviceMesh reuses the default group for its dimensions: a group of its own
    dp = dist.new_group([0], group_desc="mesh_dp")
    x = torch.ones(1 << 16)
    start = time.perf_counter()
    dist.all_reduce(x, group=dp)
    reduced = funcol.all_reduce(x, "sum", (mesh, 1))
    funcol.wait_tensor(getattr(reduced, "elem", reduced))
    split = timer.take(start, time.perf_counter())
    assert split is not None and split.comm_by_dim is not None
    assert set(split.comm_by_dim) == {"dp", "tp"}
    for comm, exposed in split.comm_by_dim.values():
        assert comm > 0 and 0 <= exposed <= comm
    assert split.last_collective is not None and split.last_collective.startswith("all_reduce")


def test_one_dimension_gives_no_split(group: None, timer: CommTimer) -> None:
    start = time.perf_counter()
    dist.all_reduce(torch.ones(8))
    split = timer.take(start, time.perf_counter())
    assert split is not None and split.comm_by_dim is None


def test_group_labels() -> None:
    class Pg:
        def __init__(self, desc: str) -> None:
            self.group_desc = desc

    class Mesh:
        mesh_dim_names = ("replicate", "shard")

    assert comm_split.group_label(None) == "world"
    assert comm_split.group_label(Pg("default_pg")) == "world"
    assert comm_split.group_label(Pg("mesh_tp")) == "tp"
    assert comm_split.group_label(Pg("my_group")) == "my_group"
    assert comm_split.group_label((Mesh(), 1)) == "shard"
    assert comm_split.group_label(object()) == "other"
    assert len(comm_split.group_label(Pg("mesh_" + "x" * 100))) == 32
