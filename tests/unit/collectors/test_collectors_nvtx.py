"""NVTX ranges per FSDP unit, checked with the NVTX functions replaced by a recorder (this machine
has no CUDA: a CPU build of torch has no NVTX library), on a world-size-1 gloo FSDP2 model."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import zdiag
from zdiag.collectors.nvtx import UnitRanges, unit_name

DIM = 16


@dataclass
class NvtxRecorder:
    """Stand-in for torch.cuda.nvtx: every call in order, with the thread it came from."""

    calls: list[tuple[str, int, str]] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _names: dict[int, str] = field(default_factory=dict)

    def range_start(self, msg: str) -> int:
        rid = next(self._ids)
        self._names[rid] = msg
        self.calls.append(("start", rid, threading.current_thread().name))
        return rid

    def range_end(self, rid: int) -> None:
        self.calls.append(("end", rid, threading.current_thread().name))

    def names(self) -> list[str]:
        return [self._names[rid] for kind, rid, _ in self.calls if kind == "start"]

    def check_balanced_and_nested(self) -> None:
        """Each range ends once, after it starts; any two are nested or disjoint."""
        began: dict[int, int] = {}
        spans: list[tuple[int, int]] = []
        for i, (kind, rid, _) in enumerate(self.calls):
            if kind == "start":
                assert rid not in began
                began[rid] = i
            else:
                assert rid in began, f"range {rid} ended but never started (or twice)"
                spans.append((began.pop(rid), i))
        assert not began, f"ranges left open: {[self._names[r] for r in began]}"
        for (a0, a1), (b0, b1) in itertools.combinations(sorted(spans), 2):
            assert b1 < a1 or b0 > a1, f"overlapping ranges: {self.calls[a0]} .. {self.calls[b0]}"


@pytest.fixture
def nvtx(monkeypatch: pytest.MonkeyPatch) -> NvtxRecorder:
    """Pretend CUDA is there and record the NVTX calls (step push/pop included)."""
    rec = NvtxRecorder()
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nsight/libToolsInjection64.so")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", rec.range_start)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", rec.range_end)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: 0)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: 0)
    return rec


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A 1-rank gloo group on an in-memory store (as the harness does without torchrun)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


class Block(nn.Module):
    """A residual MLP; `ac="inner"` checkpoints its body (as the harness's `--ac block`)."""

    def __init__(self, ac: str) -> None:
        super().__init__()
        self.up, self.down, self.ac = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), ac

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ac == "inner" and torch.is_grad_enabled():
            return x + checkpoint(self._body, x, use_reentrant=False)
        return x + self._body(x)


class Model(nn.Module):
    """Embedding, blocks (each an FSDP unit), head; `ac="outer"` checkpoints each unit's call,
    so activation checkpointing re-runs the FSDP unit's own forward inside backward."""

    def __init__(self, layers: int, ac: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, DIM)
        self.layers = nn.ModuleList(Block(ac) for _ in range(layers))
        self.head = nn.Linear(DIM, 64)
        self.ac = ac

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            if self.ac == "outer" and torch.is_grad_enabled():
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.head(h)


def fsdp_model(layers: int = 3, ac: str = "none", wrap_root: bool = True) -> Model:
    """`fully_shard` on each block and, with `wrap_root`, on the whole model (else only blocks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = Model(layers, ac)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    if wrap_root:
        fully_shard(model, mesh=mesh)
    return model


def train(
    model: Model, steps: int, ranges: UnitRanges | None = None, before: nn.Module | None = None
) -> None:
    """`steps` SGD steps; `before` is a module the loop calls first each step (not the model)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 64, (2, 8))
    for _ in range(steps):
        if before is not None:
            before(tokens)
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if ranges is not None:
            ranges.step_end()


def expected_step(layers: int, recompute: bool = False, root: bool = True) -> list[str]:
    """The range names of one step, in order (`root`: the whole model is a unit too)."""
    fwd = ["zdiag forward root"] if root else []
    fwd += [f"zdiag forward layers.{i}" for i in range(layers)]
    bwd = ["zdiag backward root"] if root else []
    for i in reversed(range(layers)):
        bwd += [f"zdiag backward layers.{i}"]
        bwd += [f"zdiag recompute layers.{i}"] if recompute else []
    return fwd + bwd


@pytest.mark.parametrize("ac", ["none", "inner", "outer"])
def test_unit_ranges_are_named_balanced_and_nested(
    nvtx: NvtxRecorder, process_group: None, ac: str
) -> None:
    reports: list[str] = []
    model = fsdp_model(3, ac)
    ranges = UnitRanges(enabled=True, report=reports.append)
    ranges.attach(model)
    assert ranges.unit_names == ["root", "layers.0", "layers.1", "layers.2"]
    train(model, steps=2, ranges=ranges)
    assert reports == []
    assert nvtx.names() == expected_step(3, recompute=ac == "outer") * 2
    nvtx.check_balanced_and_nested()
    ranges.close()
    assert not model._forward_pre_hooks or all(
        "UnitRanges" not in repr(h) for h in model._forward_pre_hooks.values()
    )


def test_backward_ranges_close_where_each_unit_ends(
    nvtx: NvtxRecorder, process_group: None
) -> None:
    # layers.0's backward ends when its input's gradient is computed, before the rest of the root's
    # backward (the embedding); the root's ends with the backward pass, not at the step end.
    model = fsdp_model(2)
    ranges = UnitRanges(enabled=True, report=lambda msg: None)
    ranges.attach(model)
    train(model, steps=1)  # no step_end: the backward pass must have closed everything itself
    names = dict(zip(itertools.count(1), nvtx.names()))
    order = [(kind, names[rid]) for kind, rid, _ in nvtx.calls]
    assert order[-3:] == [
        ("start", "zdiag backward layers.0"),
        ("end", "zdiag backward layers.0"),
        ("end", "zdiag backward root"),
    ]
    nvtx.check_balanced_and_nested()


def test_ranges_left_open_are_closed_at_step_end(nvtx: NvtxRecorder, process_group: None) -> None:
    model = fsdp_model(2)
    ranges = UnitRanges(enabled=True, report=lambda msg: None)
    ranges.attach(model)
    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad():
            model.layers[1].register_forward_hook(_boom)
            model(torch.randint(0, 64, (2, 8)))
    ranges.step_end()
    nvtx.check_balanced_and_nested()


def _boom(*args: object) -> None:
    raise RuntimeError("boom")


def test_a_failing_range_is_reported_once_and_switches_them_off(
    nvtx: NvtxRecorder, process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports: list[str] = []
    model = fsdp_model(2)
    ranges = UnitRanges(enabled=True, report=reports.append)
    ranges.attach(model)
    calls = itertools.count()

    def flaky_start(msg: str) -> int:
        if next(calls) == 4:
            raise RuntimeError("nvtx broke")
        return nvtx.range_start(msg)

    monkeypatch.setattr(ranges, "_start", flaky_start)
    train(model, steps=3, ranges=ranges)  # training goes on
    assert len(reports) == 1 and "nvtx broke" in reports[0]
    nvtx.check_balanced_and_nested()
    assert len(nvtx.names()) == 4  # nothing after the failure


@pytest.mark.parametrize("ac", ["none", "outer"])
def test_units_are_found_when_the_root_is_not_a_unit(
    nvtx: NvtxRecorder, process_group: None, ac: str
) -> None:
    # `fully_shard` on each block only: the first FSDP forward is layers.0's, but every block is
    # a unit, named as in the model (a plain module called before the model changes nothing).
    reports: list[str] = []
    model = fsdp_model(3, ac, wrap_root=False)
    ranges = UnitRanges(enabled=True, report=reports.append)
    ranges.watch()
    train(model, steps=2, ranges=ranges, before=nn.Identity())
    assert reports == []
    assert ranges.unit_names == ["layers.0", "layers.1", "layers.2"]
    assert nvtx.names() == expected_step(3, recompute=ac == "outer", root=False) * 2
    nvtx.check_balanced_and_nested()
    ranges.close()


def test_units_are_found_at_a_unit_called_directly(nvtx: NvtxRecorder, process_group: None) -> None:
    # The script calls one FSDP block itself: its units are looked for under that block.
    model = fsdp_model(2, wrap_root=False)
    ranges = UnitRanges(enabled=True, report=lambda msg: None)
    ranges.watch()
    h = model.emb(torch.randint(0, 64, (2, 8)))
    model.layers[1](h).sum().backward()
    ranges.step_end()
    assert ranges.unit_names == ["root"]
    assert nvtx.names() == ["zdiag forward root", "zdiag backward root"]
    nvtx.check_balanced_and_nested()


def test_ranges_open_and_close_holding_the_lock(nvtx: NvtxRecorder, process_group: None) -> None:
    # Backward hooks run on autograd's thread, forward hooks on the training thread: every range
    # call is made holding the lock (checkpointing puts forward hooks inside backward as well).
    model = fsdp_model(2, ac="outer")
    ranges = UnitRanges(enabled=True, report=lambda msg: None)
    unlocked: list[str] = []

    def check(call: str) -> None:
        if not ranges._lock._is_owned():  # type: ignore[attr-defined]
            unlocked.append(call)

    def start(msg: str) -> int:
        check(f"start {msg}")
        return nvtx.range_start(msg)

    def end(rid: int) -> None:
        check(f"end {rid}")
        nvtx.range_end(rid)

    ranges._start, ranges._end = start, end
    ranges.attach(model)
    train(model, steps=2, ranges=ranges)
    ranges.close()
    assert unlocked == [] and len(nvtx.names()) == 2 * len(expected_step(2, recompute=True))
    nvtx.check_balanced_and_nested()


@pytest.mark.parametrize("wrap_root", [True, False])
def test_session_finds_the_units_at_the_first_fsdp_forward(
    nvtx: NvtxRecorder, process_group: None, tmp_path: Path, wrap_root: bool
) -> None:
    model = fsdp_model(2, wrap_root=wrap_root)
    with zdiag.profile(out=tmp_path, enabled=False, auto_step=True):
        train(model, steps=3)
    assert nvtx.names() == expected_step(2, root=wrap_root) * 3
    nvtx.check_balanced_and_nested()
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["ranks"][0]["collector_errors"] == []


def test_nothing_is_registered_without_cuda_or_with_nvtx_off(
    process_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.nn.modules import module as nn_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = fsdp_model(2)
    before = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()}
    global_before = len(nn_module._global_forward_pre_hooks)
    for enabled in (True, False):
        ranges = UnitRanges(enabled=enabled, report=lambda msg: None)
        ranges.watch()
        ranges.attach(model)
        assert not ranges.enabled and ranges.unit_names == []
        assert len(nn_module._global_forward_pre_hooks) == global_before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nsight/libToolsInjection64.so")
    ranges = UnitRanges(enabled=False, report=lambda msg: None)  # --no-nvtx on a GPU machine
    ranges.watch()
    ranges.attach(model)
    assert ranges.unit_names == [] and len(nn_module._global_forward_pre_hooks) == global_before
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    ranges = UnitRanges(enabled=True, report=lambda msg: None)  # a GPU, no Nsight listening
    ranges.watch()
    ranges.attach(model)
    assert ranges.unit_names == [] and len(nn_module._global_forward_pre_hooks) == global_before
    after = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()}
    assert after == before


def test_ranges_off_build_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Off (no CUDA, --no-nvtx, or no NVTX tool listening: the usual case) costs nothing: not even
    # the torch.compile-safe wrapper of the gradient hook (torch.compiler.disable, dynamo import).
    from zdiag.collectors import nvtx as nvtx_module

    def no_wrapping(fn: object) -> None:
        raise AssertionError("eager_or_opaque called while the ranges are off")

    monkeypatch.setattr(nvtx_module, "eager_or_opaque", no_wrapping)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_INJECTION32_PATH", raising=False)
    for enabled in (True, False):
        ranges = UnitRanges(enabled=enabled, report=lambda msg: None)
        ranges.watch()
        ranges.attach(nn.Linear(2, 2))
        ranges.step_end()
        ranges.close()
        assert not ranges.enabled and ranges._grad_hook is None


def test_unit_names_drop_wrapper_parts() -> None:
    assert unit_name("") == "root"
    assert unit_name("_fsdp_wrapped_module.layers.0") == "layers.0"
    assert unit_name("_orig_mod.layers.3._checkpoint_wrapped_module.") == "layers.3"
