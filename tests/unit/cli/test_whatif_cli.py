"""`zdiag whatif RUN ...`: the text, --json, the Perfetto overlay and the page; refusals in one
sentence; outputs that never overwrite an input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from zdiag.cli import main

TINY = REPO_ROOT / "sample_traces" / "tiny-layer-wrap"


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZDIAG_CACHE", "off")  # never write .zdiag-cache beside the samples


def _whatif(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["whatif", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_gives_predicted_against_measured_and_the_model_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _whatif([str(TINY), "--wrap", "layers"], capsys)
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("what-if --wrap layers: step ")
    assert "model check: the unchanged replay gives back the measured step within 0.00%" in out
    assert "FSDP unit overhead fit" in out


def test_json_is_versioned_and_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _whatif([str(TINY), "--prefetch", "2", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "zdiag.whatif/1"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert r["replayed_ms"] == pytest.approx(r["measured_ms"], rel=1e-6)
        assert r["predicted_ms"] <= r["measured_ms"] + 1e-6  # prefetching further never slows here
    assert data["memory_delta_bytes"] > 0  # one more unit gathered ahead


def test_overlay_and_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overlay, page = tmp_path / "replay.json", tmp_path / "replay.html"
    code, _, err = _whatif(
        [str(TINY), "--prefetch", "2", "--perfetto", str(overlay), "--html", str(page)], capsys
    )
    assert code == 0, err
    events = json.loads(overlay.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any(n.endswith("as measured") for n in names)
    assert any(n.endswith("--prefetch 2") for n in names)
    assert sum(1 for e in events if e["ph"] == "X" and e["name"].startswith("all_gather")) > 10
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "fig-whatif-timeline" in html


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([str(TINY)], "say what to change"),
        ([str(TINY), "--wrap", "nowhere"], "no FSDP unit of this run lies under 'nowhere'"),
        (["/nonexistent/run", "--prefetch", "1"], "does not exist"),
        ([str(TINY), "--prefetch", "99"], "prefetch depth is 0 to 8"),
        ([str(TINY), "--without-straggler", "7"], "rank 7 has no modelled step"),
        ([str(TINY), "--without-straggler", "x"], "not a rank list"),
        ([str(TINY), "--micro-batches", "1"], "micro-batches are 2 to 64 per step, got 1"),
        ([str(TINY), "--mesh-shape", "2,2"], "needs R x S = 2 (got 2,2)"),
        ([str(TINY), "--mesh-shape", "1,2"], "the run is already 1 x 2"),
        ([str(TINY), "--mesh-shape", "two"], "a mesh shape is REPLICATE,SHARD"),
        (
            [str(TINY), "--intra-node-speedup", "4"],
            "give it with --mesh-shape R,S or --mesh-order DIMS",
        ),
        ([str(TINY), "--mesh-order", "dp"], "a mesh order is the mesh's dimension names"),
        ([str(TINY), "--mesh-order", "dp,tp"], "needs the run's device mesh"),
        ([str(TINY), "--intra-node-speedup", "0.5"], "a speedup is between 1 and 1000"),
        ([str(TINY), "--pipeline-rebalance"], "no pipeline to replay: the run has no pipeline"),
        (
            [str(TINY), "--pipeline-rebalance", "--prefetch", "1"],
            "give --pipeline-microbatches or --pipeline-rebalance without the other changes",
        ),
        (
            [str(TINY), "--pipeline-rebalance", "--pipeline-microbatches", "8"],
            "give one pipeline change",
        ),
        (
            [str(TINY), "--pipeline-rebalance", "--html", "/tmp/never.html"],
            "--perfetto and --html draw the FSDP step replay",
        ),
    ],
)
def test_refusals_are_one_sentence_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argparse_exits = (
        "99" in argv
        or "x" in argv
        or "--micro-batches" in argv
        or "two" in argv
        or "0.5" in argv
        or "dp" in argv
    )
    with pytest.raises(SystemExit) if argparse_exits else _nullcontext() as exc:
        code, _, err = _whatif(argv, capsys)
    if exc is not None and getattr(exc, "value", None) is not None:
        code, err = exc.value.code, capsys.readouterr().err  # argparse exits itself
    assert code == 2
    assert says in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 or "usage:" in err


def test_an_output_never_replaces_an_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(TINY, run)
    trace = run / "traces" / "rank-0.json.gz"
    before = trace.read_bytes()
    code, _, err = _whatif([str(run), "--prefetch", "1", "--html", str(trace)], capsys)
    assert code == 2
    assert trace.read_bytes() == before
    assert "Traceback" not in err


class _nullcontext:
    value = None

    def __enter__(self) -> _nullcontext:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_micro_batches_replay_the_passes_and_leave_memory_unestimated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _whatif([str(TINY), "--micro-batches", "2", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["change"] == "--micro-batches 2"
    # every modelled step's passes run twice: their hooks and gathers at full length each time
    assert result["predicted_ms"] > result["measured_ms"]
    assert result["memory_delta_bytes"] is None and "activation" in result["memory_basis"]


def test_a_mesh_shape_replays_the_gathers_on_the_new_groups_and_grows_the_shards(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _whatif([str(TINY), "--mesh-shape", "2,1", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["change"] == "--mesh-shape 2,1"
    assert any("replayed as 2 x 1" in n for n in result["notes"])
    # whole copies on each rank: the gathered bytes held twice over (no captured model here)
    assert result["memory_delta_bytes"] > 0
    assert "summed from the FSDP gathers" in result["memory_basis"]


def test_bf16_reduces_are_refused_on_a_cpu_run_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _whatif([str(TINY), "--reduce-dtype", "bf16", "--json"], capsys)
    assert code == 2
    assert "a bf16 reduce is not cheaper" in err and "Traceback" not in err
