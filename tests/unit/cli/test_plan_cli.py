"""`zdiag plan RUN`: the grid replayed, the best plan as the framework's own code, refusals in
one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.cli import main

TINY = REPO_ROOT / "sample_traces" / "tiny-layer-wrap"


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZDIAG_CACHE", "off")


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_per_linear_wrap_is_planned_back_to_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _plan([str(TINY), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == "zdiag.plan/1"
    steps = [p["predicted_ms"] for p in data["plans"]]
    assert steps == sorted(steps)  # no budget: fastest first
    assert "--wrap layers" in data["best"]
    assert "for block in model.layers:\n    fully_shard(block)" in data["code"]
    measured = next(p for p in data["plans"] if p["change"].startswith("(nothing"))
    assert measured["predicted_ms"] == pytest.approx(data["measured_ms"])
    assert data["plans"][0]["predicted_ms"] < data["measured_ms"]
    assert len(data["plans"]) == 8  # wrap x prefetch x reshard, every combination


def test_a_budget_without_a_recorded_peak_says_it_cannot_be_judged(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _plan([str(TINY), "--memory-budget-gb", "1"], capsys)
    assert code == 0
    assert out.startswith("best plan (FSDP2 (fully_shard)): ")
    flowing = " ".join(out.split())  # the prose is wrapped at the terminal's width
    assert "the budget cannot be judged" in flowing
    assert "searched exactly, every combination replayed" in flowing


def test_a_run_without_fsdp_is_refused_in_one_sentence(
    real_traces: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _plan([str(real_traces / "hta" / "v100_ddp_rank1_of_2.json.gz")], capsys)
    assert code == 2
    assert "no FSDP or ZeRO collective" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_budget_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(TINY), "--memory-budget-gb", "0"])
    assert exc.value.code == 2
    assert "more than 0 GiB" in capsys.readouterr().err
