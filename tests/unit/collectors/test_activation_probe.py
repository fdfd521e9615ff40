"""What one forward saves for backward, by block (collectors/activation_probe.py), measured on a
real model and autograd, and written into the model description."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from zdiag.collectors.activation_probe import ActivationProbe, is_compiled
from zdiag.collectors.model_capture import ModelCapture, probed_blocks
from zdiag.collectors.model_schema import ActivationSizes

BATCH, DIM, HIDDEN = 8, 16, 32
F32 = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, fail_in: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        self.fail_in = fail_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            if k == self.fail_in:
                raise ValueError("boom")
            x = block(x)
        return self.head(x)


def _probe(model: nn.Module) -> tuple[ActivationProbe, list[ActivationSizes], list[str]]:
    got: list[ActivationSizes] = []
    errors: list[str] = []
    probe = ActivationProbe(probed_blocks(model), got.append, errors.append)
    return probe, got, errors


def test_each_block_is_charged_what_its_forward_saved_and_its_inputs() -> None:
    torch.manual_seed(0)
    model = Net()
    probe, got, errors = _probe(model)
    probe.start(model)
    model(torch.randn(BATCH, DIM)).sum().backward()
    assert errors == [] and len(got) == 1
    sizes = got[0]
    assert sizes.containers == ("blocks",)
    assert [b.path for b in sizes.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    # a block saves its input (up's), up's output (gelu's input) and gelu's output (down's
    # input); the weights' transposes are views of parameters and are left out
    per_block = (BATCH * DIM + 2 * BATCH * HIDDEN) * F32
    assert [b.saved_bytes for b in sizes.blocks] == [per_block] * 3
    assert [b.input_bytes for b in sizes.blocks] == [BATCH * DIM * F32] * 3
    assert sizes.outside_blocks_bytes == BATCH * DIM * F32  # the head's input
    assert sizes.saved_bytes == 3 * per_block + BATCH * DIM * F32


def test_the_probe_changes_nothing_and_leaves_no_hook_behind() -> None:
    torch.manual_seed(0)
    plain, probed = Net(), Net()
    probed.load_state_dict(plain.state_dict())
    x = torch.randn(BATCH, DIM)
    plain(x).sum().backward()
    probe, got, _ = _probe(probed)
    probe.start(probed)
    probed(x).sum().backward()
    for a, b in zip(plain.parameters(), probed.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)
    assert not probed._forward_hooks and not probed._forward_pre_hooks
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in probed.blocks)
    probed(x).sum().backward()  # a second forward: nothing more is measured
    assert len(got) == 1 and got[0].tensors > 0


def test_a_forward_that_raises_still_takes_the_hooks_off() -> None:
    model = Net(fail_in=1)
    probe, got, _ = _probe(model)
    probe.start(model)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(BATCH, DIM))
    assert len(got) == 1  # what the forward saved before it failed
    assert got[0].blocks[0].saved_bytes > 0 and got[0].blocks[1].saved_bytes == 0
    model.fail_in = None
    model(torch.randn(BATCH, DIM)).sum().backward()  # the saved-tensor hooks are gone
    assert len(got) == 1


def test_a_compiled_model_is_recognised() -> None:
    model = Net()
    assert not is_compiled(model)
    assert is_compiled(torch.compile(model))  # compiles nothing until called


def test_the_model_capture_writes_the_sizes_into_the_description(tmp_path: Path) -> None:
    errors: list[str] = []
    capture = ModelCapture(tmp_path, 0, errors.append, probe_activations=True).arm()
    try:
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(BATCH, DIM)).sum().backward()
            opt.step()
    finally:
        capture.disarm()
    assert errors == []
    desc = json.loads((tmp_path / "model" / "rank-0.json").read_text())
    assert desc["schema"] == "zdiag.model/1.3"
    act = desc["activations"]
    assert [b["path"] for b in act["blocks"]] == ["blocks.0", "blocks.1", "blocks.2"]
    assert desc["optimizers"][0]["cls"] == "SGD"  # the later rewrite keeps them


def test_without_the_flag_nothing_is_measured(tmp_path: Path) -> None:
    capture = ModelCapture(tmp_path, 0, lambda _m: None).arm()
    try:
        Net()(torch.randn(BATCH, DIM)).sum().backward()
    finally:
        capture.disarm()
    desc = json.loads((tmp_path / "model" / "rank-0.json").read_text())
    assert desc["activations"] is None


def test_a_first_forward_without_gradients_is_not_measured_and_says_so(tmp_path: Path) -> None:
    capture = ModelCapture(tmp_path, 0, lambda _m: None, probe_activations=True).arm()
    try:
        model = Net()
        with torch.no_grad():
            model(torch.randn(BATCH, DIM))  # an evaluation before training
        model(torch.randn(BATCH, DIM)).sum().backward()
    finally:
        capture.disarm()
    desc = json.loads((tmp_path / "model" / "rank-0.json").read_text())
    assert desc["activations"] is None
    assert any("ran without gradients" in n for n in desc["notes"])


def test_a_probe_that_cannot_start_removes_its_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entering the saved-tensor hooks fails (a library disabled them): the block hooks
    registered first come off when the probe is stopped, and nothing is handed over."""
    model = Net()
    probe, got, _ = _probe(model)

    def refuse(*_a: object) -> None:
        raise RuntimeError("saved tensors default hooks are disabled")

    monkeypatch.setattr(torch.autograd.graph.saved_tensors_hooks, "__enter__", refuse)
    with pytest.raises(RuntimeError, match="disabled"):
        probe.start(model)
    monkeypatch.undo()
    probe.stop()
    assert not model._forward_hooks
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in model.blocks)
    model(torch.randn(BATCH, DIM)).sum().backward()
    assert got == []
