"""The text report: summary first, wrapped to the terminal, coloured only where it should be."""

from __future__ import annotations

import io
import re

import msgspec
import pytest

from conftest import REPO_ROOT
from zdiag.analyzers.report import Finding, Report
from zdiag.render._sample import sample_report
from zdiag.render.format import evidence_item
from zdiag.render.output import write_stdout
from zdiag.render.renderer import Destination
from zdiag.render.terminal import color_enabled, terminal_width
from zdiag.render.text import TextRenderer, render_text

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SAMPLE_RUN = REPO_ROOT / "sample_traces" / "missing-overlap"


def _long_prose() -> Report:
    report = sample_report(ranks=2, steps=4)
    report.findings[0].recommendation = " ".join(["reshard_after_forward=True"] + ["word"] * 200)
    report.warnings.append("x" * 300)  # one unbreakable word: cut, never past the width
    report.fsdp_units[0].name = "model.encoder.stages.0.blocks.11.attention.qkv_projection_layer"
    return report


@pytest.mark.parametrize("width", [80, 120])
def test_every_line_fits_the_width(width: int) -> None:
    from zdiag.render.memory_view import memory_lines

    for report in (sample_report(), _long_prose(), sample_report(ranks=12, steps=50)):
        text = render_text(report, width=width)
        code = {line.strip() for f in report.findings for line in (f.code or "").splitlines()}
        # the memory section (render/memory_view.py) draws fixed-width sparklines: not wrapped
        memory = set(memory_lines(report))
        long = [
            x
            for x in text.splitlines()
            if len(x) > width and x.strip() not in code and x not in memory
        ]
        assert long == []


def test_real_run_fits_80_columns() -> None:
    from zdiag.analyzers.engine.summary_pipeline import analyze_paths

    text = render_text(analyze_paths([SAMPLE_RUN]), width=80)
    assert max(len(x) for x in text.splitlines()) <= 80
    # the CPU-only run shows no GPU-only columns
    header = next(x for x in text.splitlines() if x.strip().startswith("step  verdict"))
    assert "kernels" not in header and "launch" not in header and "memcpy" not in header
    assert "GPU-only columns hidden: memcpy, launch, kernels" in text


def test_gpu_runs_keep_the_gpu_columns() -> None:
    text = render_text(sample_report(ranks=2, steps=2), width=200)
    header = next(x for x in text.splitlines() if x.strip().startswith("step  verdict"))
    assert "kernels" in header and "launch" in header


def test_summary_comes_first_with_ranks_grouped_and_findings_by_gain() -> None:
    report = sample_report()
    text = render_text(report, width=100)
    summary = text.index("\nSummary\n")
    assert summary < text.index("\nRank 0 (") < text.index("\nFindings (")
    block = text[summary : text.index("\nRank 0 (")]
    assert "ranks 0–" in block and "median step" in block
    gains = [f for f in report.findings if f.expected_gain_ms]
    best = max(gains, key=lambda f: f.expected_gain_ms or 0.0)
    assert re.search(rf"\n +1\. \[{best.severity.upper()}\] {best.id}:", block)


def test_evidence_is_labelled_text_with_units() -> None:
    assert evidence_item("all_gather_ms_per_step", 34.24) == ("all gather per step", "34.2 ms")
    assert evidence_item("peak_bytes", 3 * 2**30) == ("peak", "3.0 GiB")
    assert evidence_item("serialized_share", 0.5) == ("serialized", "50%")
    assert evidence_item("alpha_us", 12) == ("alpha", "12.0 µs")
    assert evidence_item("category_bytes", {"ACTIVATION": 2**20}) == (
        "category",
        "ACTIVATION: 1.0 MiB",
    )
    report = Report(
        findings=[
            Finding(
                id="x",
                severity="warning",
                title="t",
                evidence={"peak_bytes": 2**31, "exposed_share": 0.25},
            )
        ]
    )
    text = render_text(report)
    assert "peak     2.0 GiB" in text and "exposed  25%" in text
    assert "{" not in text and "peak_bytes" not in text


def test_a_failed_detector_is_never_reported_as_no_findings() -> None:
    report = Report(
        warnings=["detector straggler failed (KeyError: 3); its finding is missing"],
        failed_detectors=["straggler"],
    )
    text = render_text(report)
    assert "nothing in the traces crossed a threshold" not in text
    assert "1 detector failed" in text and "straggler" in text
    clean = render_text(Report())
    assert "none: nothing in the traces crossed a threshold" in clean


def test_colour_only_on_a_tty_and_never_with_no_color() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert color_enabled(Tty(), {}) and not color_enabled(io.StringIO(), {})
    assert not color_enabled(Tty(), {"NO_COLOR": "1"})
    assert color_enabled(io.StringIO(), {"FORCE_COLOR": "1"})
    report = sample_report(ranks=2, steps=3)
    coloured = render_text(report, width=100, color=True)
    assert "\x1b[" in coloured and ANSI.sub("", coloured) == render_text(report, width=100)


def test_stdout_honours_no_color_and_columns(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    write_stdout(TextRenderer().render(_long_prose(), Destination.stdout()).data())
    out = capsysbinary.readouterr().out.decode()
    assert "\x1b[" not in out
    from zdiag.render.memory_view import memory_lines

    report = _long_prose()
    code = {line.strip() for f in report.findings for line in (f.code or "").splitlines()}
    memory = set(memory_lines(report))  # fixed-width sparklines
    assert all(len(x) <= 80 for x in out.splitlines() if x.strip() not in code and x not in memory)


def test_width_comes_from_columns_else_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "132")
    assert terminal_width(io.StringIO()) == 132
    monkeypatch.delenv("COLUMNS")
    assert terminal_width(io.StringIO()) == 100


def test_no_findings_never_contradicts_the_step_verdicts() -> None:
    """Issue 30: a trace whose only step was comm-bound (85% exposed) read "nothing crossed a
    threshold"."""
    from zdiag.analyzers.report import RankReport, StepBreakdown

    step = StepBreakdown(
        step=0, duration_ms=100.0, compute_ms=10.0, comm_ms=85.0, overlapped_ms=0.0,
        exposed_comm_ms=85.0, idle_ms=5.0, verdict="comm-bound",
    )  # fmt: skip
    text = render_text(Report(ranks=[RankReport(rank=0, steps=[step])]))
    assert "nothing in the traces crossed a threshold" not in text
    assert "comm-bound in 1 of 1 steps" in " ".join(text.split())
    # one noisy step among healthy ones (the CPU demo): the summary calls it compute-bound
    healthy = [
        msgspec.structs.replace(step, step=i, compute_ms=90.0, verdict="compute-bound")
        for i in range(1, 6)
    ]
    text = render_text(Report(ranks=[RankReport(rank=0, steps=[step, *healthy])]))
    assert "none: nothing in the traces crossed a threshold" in text


def test_verbose_shows_all_evidence_and_thresholds_and_verdicts_say_why() -> None:
    from zdiag.analyzers.report import RankReport, StepBreakdown

    step = StepBreakdown(
        step=0, duration_ms=100.0, compute_ms=10.0, comm_ms=85.0, overlapped_ms=0.0,
        exposed_comm_ms=85.0, idle_ms=5.0, verdict="comm-bound",
        verdict_reason="comm/compute 8.50 >= 1.00",
    )  # fmt: skip
    finding = Finding(
        id="straggler", severity="warning", title="t", evidence={f"k{i}": i for i in range(14)}
    )
    report = Report(
        ranks=[RankReport(rank=0, steps=[step])],
        findings=[finding],
        thresholds={"comm_bound_comm_to_compute": 1.0},
    )
    short, full = render_text(report), render_text(report, verbose=True)
    assert "why: comm/compute 8.50 >= 1.00" in short
    assert "(+4 more: --verbose, or --json)" in short and "k13" not in short
    assert "k13" in full and "more: --verbose" not in full
    assert "Verdict thresholds" not in short and "Verdict thresholds" in full


def test_the_busiest_hosts_cores_get_their_own_line() -> None:
    """Report.run's host_cores (analyzers/run/core_use.py): one line for the busiest host,
    which says when its cores are full and how many hosts were measured."""

    def host(name: str, busy: float, cores: int, full: bool) -> dict[str, object]:
        return {"host": name, "ranks": [0], "cores": cores, "busy": busy, "full": full,
                "sentence": f"the 1 rank on {name} kept {busy} of its {cores} cores busy"}  # fmt: skip

    report = sample_report()
    report.run = {
        "world_size": 2,
        "host_cores": [host("a", 1.0, 8, False), host("b", 1.9, 2, True)],
    }
    text = " ".join(render_text(report, width=100).split())
    assert (
        "cores: the 1 rank on b kept 1.9 of its 2 cores busy: full (the busiest of 2 hosts)" in text
    )
    assert "host_cores=" not in text  # not in the run line's key=value list
    report.run = {"world_size": 2}
    assert "cores:" not in render_text(report, width=100)
