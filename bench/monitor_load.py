"""Load on the live monitor: N simulated ranks at H records/s each, directly or through relays.

    python bench/monitor_load.py --ranks 512 --hz 1 --seconds 60 --target 127.0.0.1:5599 --spawn-monitor
    python bench/monitor_load.py --ranks 512 --hz 1 --seconds 60 --target 127.0.0.1:5599 --relays 8 --spawn-monitor
    python bench/monitor_load.py --publish-cost

Each simulated rank has its own ZeroMQ PUSH socket (as a real rank's publisher has) and sends
wire-format step records (`zdiag.live.wire.encode`) spread evenly over each period;
with ``--relays K`` the ranks connect to K in-process `Relay`s that forward to the target, as
per-node relays would. With ``--spawn-monitor`` the script starts
``zdiag monitor --headless --json`` on the target, and reports what it saw: records received vs
sent, receive lag (monitor receive time minus the record's timestamp) and the monitor's RSS
over time. Without it, point ``--target`` at a monitor you started yourself.

``--ui-cost`` times one refresh of the Textual app (view, table update, render) at ``--ranks``.
``--publish-cost`` measures the real `StepPublisher.publish()` per call with no monitor and with
one, and a small torch training loop's step time without a publisher, with one and no monitor,
and with one and a monitor: the cost training pays.
Loopback only; every process and thread it starts is stopped before it exits.
Thousands of ranks through per-node relays (the relays in their nodes' processes, the lag
measured to the monitor state's update): `bench/monitor_fanin.py`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import zmq

from zdiag.live.publisher import SEND_HWM, StepPublisher
from zdiag.live.receiver import LiveReceiver, Relay
from zdiag.live.wire import SCHEMA, encode, parse_endpoint, push_socket

STRAGGLER_RANK = 7
"""The simulated rank whose steps are 30% slower (the monitor must flag it alone)."""


def step_record(rank: int, node: int, tick: int, rng: random.Random) -> dict[str, Any]:
    """One simulated rank's step record (wire fields of `zdiag.live/1`, 100 ms steps +-3%)."""
    step_ms = 100.0 * (1.3 if rank == STRAGGLER_RANK else 1.0) * rng.uniform(0.97, 1.03)
    return {
        "kind": "step",
        "rank": rank,
        "host": f"node{node}",
        "job": "bench",
        "pid": 10_000 + rank,
        "step": tick,
        "ts": time.time(),
        "seq": tick,
        "step_time_ms": step_ms,
        "compute_ms": step_ms * 0.7,
        "comm_ms": step_ms * 0.4,
        "exposed_comm_ms": step_ms * 0.1,
        "mem_allocated_bytes": 20e9,
        "mem_reserved_bytes": 24e9,
        "mem_peak_bytes": 30e9,
        "samples_per_s": 80.0,
        "dropped": 0,
    }


def run_load(
    ranks: int, hz: float, seconds: float, target: str, relays: int, token: str
) -> dict[str, Any]:
    """Send ``ranks * hz * seconds`` records; return what was sent and dropped."""
    endpoint = parse_endpoint(target, option="--target")
    relay_objs = [
        Relay("127.0.0.1:0", endpoint, token=token, host=f"node{i}", stats_interval_s=2.0)
        for i in range(relays)
    ]
    for r in relay_objs:
        r.start_thread()
    targets = [r.receiver.endpoint for r in relay_objs] or [endpoint]
    ctx: zmq.Context[Any] = zmq.Context()
    # each simulated rank's socket is set up exactly as the real publisher's
    socks = [push_socket(ctx, targets[i % len(targets)], SEND_HWM) for i in range(ranks)]
    rng = random.Random(0)
    token_b = token.encode()
    sent = dropped = 0
    behind_s = 0.0
    time.sleep(1.0)  # let the connections complete, as a real job's setup would
    start = time.time()
    periods = int(seconds * hz)
    try:
        for tick in range(periods):
            for i, sock in enumerate(socks):
                due = start + (tick + i / ranks) / hz
                wait = due - time.time()
                if wait > 0.001:
                    time.sleep(wait)
                behind_s = max(behind_s, -wait)
                record = {"schema": SCHEMA, **step_record(i, i // 8, tick, rng)}
                try:
                    sock.send_multipart(encode(record, token_b), flags=zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    dropped += 1
        time.sleep(0.5)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        for r in relay_objs:
            r.stop(timeout_s=0)  # all at once, then wait for each
        for r in relay_objs:
            r.stop()
    return {
        "ranks": ranks,
        "hz": hz,
        "seconds": seconds,
        "relays": relays,
        "sent": sent,
        "dropped_at_sender": dropped,
        "relay_dropped": sum(r.dropped for r in relay_objs),
        "sender_max_behind_s": round(behind_s, 3),
    }


def spawn_monitor(target: str, duration_s: float, token: str) -> subprocess.Popen[str]:
    """``zdiag monitor --headless --json`` on `target`."""
    cmd = [sys.executable, "-m", "zdiag", "monitor", "--headless", "--json", "--listen", target]
    cmd += ["--duration", str(duration_s)]
    if token:
        cmd += ["--token", token]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def measure_publish_cost(rounds: int = 6, steps_per_round: int = 100) -> dict[str, Any]:
    """A small torch training loop's step time and publish() cost, with and without a monitor.

    Three configurations, interleaved round by round so machine load drifts affect all alike:
    no publisher; a publisher whose monitor is absent; a publisher to a live
    ``zdiag monitor --headless`` process.
    """
    import torch

    torch.set_num_threads(1)
    weights = torch.randn(256, 256)
    free = LiveReceiver("127.0.0.1:0")
    absent_port = free.endpoint.port
    free.close()
    live_port = LiveReceiver("127.0.0.1:0")
    port = live_port.endpoint.port
    live_port.close()
    monitor = spawn_monitor(f"127.0.0.1:{port}", 600, "")
    time.sleep(1.5)
    pubs: dict[str, StepPublisher | None] = {
        "no publisher": None,
        "publisher, no monitor": StepPublisher(f"127.0.0.1:{absent_port}", rank=0, host="h"),
        "publisher, monitor listening": StepPublisher(f"127.0.0.1:{port}", rank=1, host="h"),
    }
    step_s: dict[str, list[float]] = {k: [] for k in pubs}
    publish_ns: dict[str, list[int]] = {k: [] for k in pubs}
    step = 0
    try:
        time.sleep(0.5)
        for _ in range(rounds):
            for label, pub in pubs.items():
                for _ in range(steps_per_round):
                    t = time.perf_counter()
                    for _ in range(16):
                        weights @ weights
                    if pub is not None:
                        c = time.perf_counter_ns()
                        pub.publish(
                            {"rank": pub.rank, "host": "h", "step": step, "step_time_ms": 1.0}
                        )
                        publish_ns[label].append(time.perf_counter_ns() - c)
                    step_s[label].append(time.perf_counter() - t)
                    step += 1
    finally:
        for pub in pubs.values():
            if pub is not None:
                pub.close()
        monitor.send_signal(signal.SIGTERM)
        out, _ = monitor.communicate(timeout=60)
    seen = json.loads(out)
    result: dict[str, Any] = {}
    for label, pub in pubs.items():
        entry: dict[str, Any] = {
            "median_step_ms": round(statistics.median(step_s[label]) * 1000, 3),
        }
        if pub is not None:
            costs = sorted(publish_ns[label])
            entry["publish_us"] = {
                "p50": round(costs[len(costs) // 2] / 1000, 2),
                "p99": round(costs[int(len(costs) * 0.99)] / 1000, 2),
                "max": round(costs[-1] / 1000, 1),
            }
            entry["sent"] = pub.sent
            entry["dropped"] = pub.dropped
        result[label] = entry
    result["monitor_received"] = seen["records"]
    return result


class _FakeSource:
    """A `MonitorSource` that hands out one batch of records, then nothing."""

    def __init__(self, batch: list[dict[str, Any]]) -> None:
        self.batch = batch
        self.rejected = 0

    def poll(self) -> list[dict[str, Any]]:
        batch, self.batch = self.batch, []
        return batch

    def close(self) -> None:
        pass


def _step_records(ranks: int, step: int, now: float) -> list[dict[str, Any]]:
    return [
        {
            "kind": "step",
            "rank": r,
            "host": f"node{r // 8}",
            "job": "bench",
            "pid": r,
            "step": step,
            "ts": now,
            "recv_ts": now,
            "step_time_ms": 100.0 + (r * 7 + step) % 5,
            "compute_ms": 70.0,
            "comm_ms": 40.0,
            "exposed_comm_ms": 10.0,
            "mem_allocated_bytes": 20e9,
            "mem_peak_bytes": 30e9,
            "dropped": 0,
        }
        for r in range(ranks)
    ]


def measure_ui_refresh(ranks: int, refreshes: int = 10) -> dict[str, Any]:
    """Wall time of one TUI refresh (view + table update + render) with `ranks` ranks reporting."""
    import asyncio

    from zdiag.tui.monitor_app import MonitorApp

    now = time.time()
    history = [rec for step in range(30) for rec in _step_records(ranks, step, now - 30 + step)]

    async def run() -> list[float]:
        app = MonitorApp(_FakeSource(history), clock=lambda: now, refresh_interval_s=3600)
        times = []
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            for k in range(refreshes):
                app.state.ingest(_step_records(ranks, 30 + k, now), now)
                t = time.perf_counter()
                app.refresh_view()
                await pilot.pause()  # let Textual lay out and render
                times.append(time.perf_counter() - t)
        return times

    times = sorted(asyncio.run(run()))
    return {
        "ranks": ranks,
        "refresh_ms_median": round(times[len(times) // 2] * 1000, 1),
        "refresh_ms_max": round(times[-1] * 1000, 1),
    }


def main() -> int:
    """Parse options and run the chosen measurement; prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--hz", type=float, default=1.0, help="records per second per rank")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--target", default="127.0.0.1:5599", help="the monitor, HOST:PORT")
    parser.add_argument("--relays", type=int, default=0, help="forward through K relays")
    parser.add_argument("--token", default="")
    parser.add_argument("--spawn-monitor", action="store_true")
    parser.add_argument("--publish-cost", action="store_true")
    parser.add_argument("--ui-cost", action="store_true", help="time TUI refreshes at --ranks")
    args = parser.parse_args()
    if not parse_endpoint(args.target, option="--target").is_loopback:
        parser.error("--target must be a loopback address (this is a local benchmark)")
    if args.ui_cost:
        print(json.dumps(measure_ui_refresh(args.ranks), indent=1))
        return 0
    if args.publish_cost:
        print(json.dumps(measure_publish_cost(), indent=1))
        return 0
    monitor = None
    if args.spawn_monitor:
        monitor = spawn_monitor(args.target, args.seconds + 30, args.token)
        time.sleep(1.5)
    try:
        result: dict[str, Any] = {
            "load": run_load(
                args.ranks, args.hz, args.seconds, args.target, args.relays, args.token
            )
        }
        if monitor is not None:
            time.sleep(1.0)
            monitor.send_signal(signal.SIGTERM)
            out, err = monitor.communicate(timeout=60)
            if monitor.returncode != 0:
                print(err, file=sys.stderr)
                return 1
            seen = json.loads(out)
            rss = seen["rss_bytes"]
            result["monitor"] = {
                "records": seen["records"],
                "ranks": len(seen["rows"]),
                "status_counts": seen["status_counts"],
                "findings": [f["id"] for f in seen["findings"]],
                "lag_ms": {k: round(seen[f"lag_{k}_ms"], 2) for k in ("p50", "p99", "max")},
                "rss_mib_every_10s": [round(b / 2**20, 1) for _, b in rss[::10]],
                "rss_mib_max": round(max(b for _, b in rss) / 2**20, 1),
                "relays": seen["relays"],
            }
    finally:
        if monitor is not None and monitor.poll() is None:
            monitor.kill()
            monitor.communicate()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
