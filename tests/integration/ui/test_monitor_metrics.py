"""`zdiag monitor --headless --metrics-port`: a real monitor process, four simulated ranks
publishing through the real `StepPublisher`, and the endpoint scraped over HTTP while it runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.live import free_port, reap
from zdiag.live.publisher import StepPublisher

pytestmark = pytest.mark.slow

RANKS = 4


def scrape(url: str) -> dict[tuple[str, str, str], float]:
    """``zdiag_step_time_seconds`` by (job, node, rank); {} while the endpoint is not up."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    return {
        (s.labels["job"], s.labels["node"], s.labels["rank"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "zdiag_step_time_seconds"
    }


def test_headless_monitor_serves_every_ranks_step_time() -> None:
    listen, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    monitor = subprocess.Popen(
        [
            *(sys.executable, "-m", "zdiag", "monitor", "--headless", "--json"),
            *("--duration", "8", "--listen", listen, "--metrics-port", str(metrics_port)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pubs = [
        StepPublisher(listen, rank=r, host=f"node{r // 2}", job="metrics-it") for r in range(RANKS)
    ]
    expected = {
        ("metrics-it", f"node{r // 2}", str(r)): (100 + 10 * r) / 1000 for r in range(RANKS)
    }
    seen: dict[tuple[str, str, str], float] = {}
    try:
        deadline = time.monotonic() + 6.0
        step = 0
        while seen != pytest.approx(expected) and time.monotonic() < deadline:
            for r, pub in enumerate(pubs):
                pub.publish(
                    {
                        "rank": r,
                        "host": f"node{r // 2}",
                        "step": step,
                        "step_time_ms": 100.0 + 10 * r,
                        "comm_ms": 30.0,
                        "exposed_comm_ms": 5.0,
                        "mem_allocated_bytes": 1e9,
                        "mem_reserved_bytes": 2e9,
                        "mem_peak_bytes": 3e9,
                        "samples_per_s": 80.0,
                    }
                )
            step += 1
            time.sleep(0.1)
            if step % 5 == 0:
                seen = scrape(url)
        monitor.send_signal(signal.SIGTERM)  # the headless monitor stops and prints its summary
        out, err = monitor.communicate(timeout=30)
    finally:
        for pub in pubs:
            pub.close(timeout_s=0.5)
        reap(monitor)
    assert seen == pytest.approx(expected)
    assert monitor.returncode == 0, err
    assert f"metrics on {url}" in err
    assert {row["rank"] for row in json.loads(out)["rows"]} == set(range(RANKS))
    assert scrape(url) == {}  # the endpoint closed with the monitor
