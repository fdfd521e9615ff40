"""`zdiag monitor --metrics-port`: the Prometheus collector over the monitor's state, its HTTP
endpoint, the CLI's refusals, and the docs' metric list and Grafana panels."""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from support.monitor_records import NOW, job, rec
from zdiag.commands.monitor import MonitorCommand
from zdiag.errors import ConfigError
from zdiag.live import state as ms
from zdiag.live.metrics import MonitorCollector, SharedMonitorState, families, serve_metrics

ROOT = Path(__file__).resolve().parents[3]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def four_rank_state() -> SharedMonitorState:
    """Job "job-7": ranks 0-3 on node0 (100, 110, 120, 130 ms steps; rank 3 a straggler, rank 2
    with 2-D comm, 5 records dropped by rank 1), rank 4 on node1 silent for 11 s (stale); and
    one rank of a job without an id."""
    records = job(
        ranks=4,
        r0={"step_time_ms": 100.0},
        r1={"step_time_ms": lambda s: 100.0 + s, "dropped": 5},  # window median: 124.5 ms
        r2={"step_time_ms": 120.0, "comm_by_dim": {"dp": (20.0, 4.0), "tp": (10.0, 1.0)}},
        r3={"step_time_ms": 130.0, "compute_ms": 100.0},
    )
    records += [rec(4, s) for s in range(20)]  # last record 11 s before NOW
    state = SharedMonitorState()
    state.ingest(records, NOW)
    state.ingest(
        [rec(0, 0, job="", ts=NOW, recv_ts=NOW), {"rank": "x"}], NOW
    )  # no job id; unusable
    return state


def scrape(state: SharedMonitorState) -> Samples:
    """The collector's output as Prometheus text, parsed back: (name, labels) -> value."""
    registry = CollectorRegistry()
    registry.register(MonitorCollector(state, clock=lambda: NOW))
    return parse(generate_latest(registry).decode())


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_every_ranks_step_time_with_its_labels() -> None:
    samples = scrape(four_rank_state())
    steps = {k: v for k, v in samples.items() if k[0] == "zdiag_step_time_seconds"}
    expected = {
        ("job-7", "node0", "0"): 0.100,
        ("job-7", "node0", "1"): 0.129,  # the last step's
        ("job-7", "node0", "2"): 0.120,
        ("job-7", "node0", "3"): 0.130,
        ("job-7", "node1", "4"): 0.100,
        ("unknown", "node0", "0"): 0.100,
    }
    got = {
        (labels["job"], labels["node"], labels["rank"]): v
        for (_, pairs), v in steps.items()
        if (labels := dict(pairs))
    }
    assert got == pytest.approx(expected)
    assert {tuple(dict(pairs)) for (_, pairs) in steps} == {("job", "node", "rank")}


def test_rank_figures_counters_and_statuses() -> None:
    s = scrape(four_rank_state())
    r1 = {"job": "job-7", "node": "node0", "rank": "1"}
    assert value(s, "zdiag_step_time_median_seconds", **r1) == pytest.approx(0.1245)
    assert value(s, "zdiag_step", **r1) == 29
    assert value(s, "zdiag_comm_seconds", **r1) == pytest.approx(0.030)
    assert value(s, "zdiag_exposed_comm_seconds", **r1) == pytest.approx(0.005)
    assert value(s, "zdiag_memory_allocated_bytes", **r1) == 2 << 30
    assert value(s, "zdiag_memory_peak_bytes", **r1) == 4 << 30
    assert value(s, "zdiag_records_received_total", **r1) == 30
    assert value(s, "zdiag_records_dropped_total", **r1) == 5
    r2 = {"job": "job-7", "node": "node0", "rank": "2"}
    assert value(s, "zdiag_dim_comm_seconds", **r2, dim="dp") == pytest.approx(0.020)
    assert value(s, "zdiag_dim_exposed_comm_seconds", **r2, dim="tp") == pytest.approx(0.001)
    assert not any(k[0] == "zdiag_dim_comm_seconds" and ("rank", "1") in k[1] for k in s)
    statuses = {
        (d["job"], d["rank"]): d["status"]
        for (name, pairs), v in s.items()
        if name == "zdiag_rank_status" and v == 1 and (d := dict(pairs))
    }
    assert statuses == {
        ("job-7", "0"): "ok",
        ("job-7", "1"): "ok",
        ("job-7", "2"): "ok",
        ("job-7", "3"): "straggler",
        ("job-7", "4"): "stale",
        ("unknown", "0"): "ok",
    }
    assert value(s, "zdiag_ranks_seen", job="job-7") == 5
    assert value(s, "zdiag_ranks_stale", job="job-7") == 1
    assert value(s, "zdiag_ranks_seen", job="unknown") == 1
    assert value(s, "zdiag_records_received_total", job="unknown", node="node0", rank="0") == 1


def test_an_empty_state_exposes_the_families_without_samples() -> None:
    text = generate_latest(_registry(SharedMonitorState())).decode()
    assert not [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert "# TYPE zdiag_step_time_seconds gauge" in text


def _registry(state: SharedMonitorState) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(MonitorCollector(state, clock=lambda: NOW))
    return registry


def test_received_counts_stay_bounded_when_jobs_are_evicted() -> None:
    state = SharedMonitorState()
    for j in range(ms.MAX_JOBS + 3):
        state.ingest([rec(r, 0, job=f"j{j}", recv_ts=NOW + j) for r in range(2)], NOW + j)
    assert len(state.jobs) == ms.MAX_JOBS
    assert len(state.received) == 2 * ms.MAX_JOBS


def test_scrapes_while_records_are_folded_in() -> None:
    """The collector reads under the state's lock: no 'changed size during iteration'."""
    state = SharedMonitorState()
    stop = threading.Event()

    def feed() -> None:
        step = 0
        while not stop.is_set():  # batches as the receive loop folds them in, jobs evicted
            state.ingest([rec(r, step, job=f"j{step % 12}") for r in range(32)], NOW)
            step += 1
            time.sleep(0.001)  # the loop's poll (a Lock is not fair: no starving the scraper)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        registry = _registry(state)
        for _ in range(20):
            parse(generate_latest(registry).decode())
    finally:
        stop.set()
        feeder.join()


def test_served_over_http_and_closed() -> None:
    server = serve_metrics(four_rank_state(), "127.0.0.1", 0, clock=lambda: NOW)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            samples = parse(resp.read().decode())
        labels = {"job": "job-7", "node": "node0", "rank": "3"}
        assert value(samples, "zdiag_step_time_seconds", **labels) == pytest.approx(0.130)
        om = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(om, timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert resp.read().decode().endswith("# EOF\n")
    finally:
        server.close()
    assert not server.thread.is_alive()
    server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


LOOPBACK_ANY = ("--headless", "--listen", "127.0.0.1:0")  # a headless monitor on any free port


def monitor_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    MonitorCommand().add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--metrics-port", "0"), "--metrics-port must be a port number from 1 to 65535"),
        (("--metrics-port", "70000"), "--metrics-port must be a port number"),
        (("--metrics-port", "http"), "got 'http'"),
        (("--metrics-host", "0.0.0.0"), "--metrics-host needs --metrics-port"),
        (("--relay", "--forward", "127.0.0.1:1", "--metrics-port", "9"), "not for --relay"),
    ],
)
def test_bad_metrics_options_are_one_sentence(argv: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        MonitorCommand().run(monitor_args(*LOOPBACK_ANY, *argv))
    assert needle in err.value.message and err.value.exit_code == 2
    assert "\n" not in err.value.message


def test_a_busy_metrics_port_is_refused() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            ConfigError, match=rf"^--metrics-port: cannot serve metrics on 127\.0\.0\.1:{port} \("
        ):
            MonitorCommand().run(monitor_args(*LOOPBACK_ANY, "--metrics-port", str(port)))


def test_docs_list_every_metric_and_the_grafana_panels_are_valid() -> None:
    doc = (ROOT / "docs" / "monitor.md").read_text()
    names = [f.name + ("_total" if f.type == "counter" else "") for f in families().values()]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, missing
    assert "docs/grafana/zdiag-panel.json" in doc or "grafana/zdiag-panel.json" in doc
    dashboard: dict[str, Any] = json.loads(
        (ROOT / "docs" / "grafana" / "zdiag-panel.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert [p["type"] for p in dashboard["panels"]] == ["timeseries", "timeseries"]
    used = {m for e in exprs for m in re.findall(r"zdiag_\w+", e)}
    assert used == {"zdiag_step_time_seconds", "zdiag_dim_exposed_comm_seconds"}
    assert used <= set(names)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Source:
    """One batch of records, then nothing (a `MonitorSource`)."""

    rejected = 0

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.batches = [records]

    def poll(self) -> list[dict[str, Any]]:
        return self.batches.pop() if self.batches else []

    def close(self) -> None:
        pass


@pytest.mark.tui
@pytest.mark.anyio
async def test_the_app_folds_records_into_the_state_the_endpoint_reads() -> None:
    """`zdiag monitor --metrics-port` without --headless hands the app a `SharedMonitorState`."""
    from zdiag.tui.monitor_app import MonitorApp

    state = SharedMonitorState()
    app = MonitorApp(_Source(job(ranks=3)), clock=lambda: NOW)
    app.state = state  # as MonitorCommand.run does
    async with app.run_test() as pilot:
        await pilot.pause()
        samples = scrape(state)
    assert value(samples, "zdiag_ranks_seen", job="job-7") == 3
    assert value(samples, "zdiag_records_received_total", job="job-7", node="node0", rank="2") == 30
