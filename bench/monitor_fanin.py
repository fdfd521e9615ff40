"""The monitor at thousands of ranks through per-node relays (issue 16): record lag and RSS.

    python bench/monitor_fanin.py --nodes 512 --ranks-per-node 8 --hz 1 --seconds 60
    python bench/monitor_fanin.py --nodes 512 --ranks-per-node 8 --hz 4 --seconds 60

Topology, all on 127.0.0.1: every simulated node has a `Relay` (the real class, as
``relay_from_env`` runs it inside a node's local-rank-0 process) and ``--ranks-per-node`` rank
sockets connected to it, set up as a real rank's publisher sets its socket up
(`wire.push_socket`, CURVE with ``--token``); the relays forward to one monitor process.
The nodes are spread over ``--workers`` processes (each runs its nodes' relay threads and one
loop sending for all its ranks), because the machine has only a few cores.

Every rank sends one step record per step at ``--hz``; by default all ranks finish a step at the
same moment, as synchronous data parallel does (``--spread`` spaces them evenly instead). Rank 7
is 1.3x slower, a planted straggler. The monitor process runs the headless monitor's loop
(`LiveReceiver.poll(timeout_ms=50)`, `MonitorState.ingest`) and, as the TUI does once a second,
`MonitorState.view`. It measures each step record's lag from its ``ts`` (stamped when the rank
sent it) to the end of the `ingest` that folded it in, in a fixed-size histogram (0.1 ms bins,
so measuring costs no memory that grows), and to the receiver's ``recv_ts`` stamp (before
decoding), its own RSS every second, its CPU time, and the time of each view. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import random
import resource
import subprocess
import sys
import time
from typing import Any

from monitor_load import step_record

LAG_BIN_MS = 0.1
LAG_BINS = 200_000  # up to 20 s; later records land in the last bin
DRAIN_S = 3.0  # the monitor keeps receiving this long after the last step


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _lag_bin(lag_s: float) -> int:
    return max(0, min(LAG_BINS - 1, int(lag_s * 1000 / LAG_BIN_MS)))


def _percentile_ms(hist: array.array[int], q: float) -> float | None:
    total = sum(hist)
    if not total:
        return None
    want = q * total
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= want:
            return round((i + 1) * LAG_BIN_MS, 1)  # the bin's upper edge
    return None


def run_monitor(token: str, start: float, seconds: float) -> dict[str, Any]:
    """The monitor process: receive, fold in, view once a second; print its port first."""
    from zdiag.live.receiver import LiveReceiver
    from zdiag.live.state import MonitorState

    rx = LiveReceiver("127.0.0.1:0", token=token)
    state = MonitorState()
    hist = array.array("q", bytes(8 * LAG_BINS))  # lag to the end of ingest
    hist_recv = array.array("q", bytes(8 * LAG_BINS))  # lag to the receiver's recv_ts stamp
    print(rx.endpoint.port, flush=True)
    rss: list[int] = []
    view_ms: list[float] = []
    end = start + seconds + DRAIN_S
    next_second = time.time()
    cpu_at_start: float | None = None
    while (now := time.time()) < end:
        records = rx.poll(timeout_ms=50)
        state.ingest(records, time.time())
        folded = time.time()
        for rec in records:
            if rec["kind"] == "step":
                hist[_lag_bin(folded - rec["ts"])] += 1
                hist_recv[_lag_bin(rec["recv_ts"] - rec["ts"])] += 1
        if now >= next_second:
            next_second += 1.0
            if cpu_at_start is None and now >= start:
                usage = resource.getrusage(resource.RUSAGE_SELF)
                cpu_at_start = usage.ru_utime + usage.ru_stime
            rss.append(_rss_bytes())
            t = time.perf_counter()
            state.view(time.time())
            view_ms.append((time.perf_counter() - t) * 1000)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    state.sync_rejections(rx)
    view = state.view(time.time())
    rx.close()
    views = sorted(view_ms)
    straggler = next((f for f in view.findings if f.id == "straggler"), None)
    return {
        "records": state.records,
        "ranks": len(view.rows),
        "relays": view.relays,
        "status_counts": view.status_counts,
        "straggler_ranks": list(straggler.ranks) if straggler else [],
        "findings": [f.id for f in view.findings],
        "dropped_reported": view.dropped,
        "rejected": view.rejected,
        "lag_to_state_ms": {
            "p50": _percentile_ms(hist, 0.5),
            "p99": _percentile_ms(hist, 0.99),
            "max": _percentile_ms(hist, 1.0),
        },
        "lag_to_receive_ms": {
            "p50": _percentile_ms(hist_recv, 0.5),
            "p99": _percentile_ms(hist_recv, 0.99),
            "max": _percentile_ms(hist_recv, 1.0),
        },
        "view_ms": {"p50": round(views[len(views) // 2], 1), "max": round(views[-1], 1)},
        "cpu_s_per_s": round(
            (usage.ru_utime + usage.ru_stime - (cpu_at_start or 0.0)) / (seconds + DRAIN_S), 3
        ),
        "rss_mib_every_10s": [round(b / 2**20, 1) for b in rss[::10]],
        "rss_mib_max": round(max(rss) / 2**20, 1),
    }


def run_worker(args: argparse.Namespace, first_node: int, nodes: int, port: int) -> dict[str, Any]:
    """One worker process: `nodes` relays and their ranks, sending on the common schedule."""
    import zmq

    from zdiag.live.publisher import SEND_HWM
    from zdiag.live.receiver import Relay
    from zdiag.live.wire import Endpoint, encode, push_socket

    monitor = Endpoint("127.0.0.1", port)
    token = args.token.encode()
    relays = [
        Relay("127.0.0.1:0", monitor, token=args.token, host=f"node{n}", stats_interval_s=2.0)
        for n in range(first_node, first_node + nodes)
    ]
    for relay in relays:
        relay.start_thread()
    ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, 2 * nodes * args.ranks_per_node)  # zmq's default cap is 1023
    ranks = [
        (rank, node, push_socket(ctx, relays[node - first_node].receiver.endpoint, SEND_HWM, token))
        for node in range(first_node, first_node + nodes)
        for rank in range(node * args.ranks_per_node, (node + 1) * args.ranks_per_node)
    ]
    rng = random.Random(first_node)
    sent = dropped = 0
    behind_s = 0.0
    try:
        for tick in range(int(args.seconds * args.hz)):
            for j, (rank, node, sock) in enumerate(ranks):
                offset = j / len(ranks) if args.spread else 0.0
                wait = args.start + (tick + offset) / args.hz - time.time()
                if wait > 0.001:
                    time.sleep(wait)
                behind_s = max(behind_s, -wait)
                try:
                    sock.send_multipart(
                        encode(step_record(rank, node, tick, rng), token), zmq.NOBLOCK
                    )
                    sent += 1
                except zmq.Again:
                    dropped += 1
        time.sleep(1.0)  # let the relays forward the last step
    finally:
        for _, _, sock in ranks:
            sock.close(linger=0)
        ctx.term()
        for relay in relays:
            relay.stop(timeout_s=0)
        for relay in relays:
            relay.stop()
    return {
        "sent": sent,
        "dropped_at_sender": dropped,
        "relay_forwarded": sum(r.forwarded for r in relays),
        "relay_dropped": sum(r.dropped for r in relays),
        "relay_rejected": sum(r.receiver.rejected for r in relays),
        "sender_max_behind_s": round(behind_s, 3),
    }


def _spawn(role: str, args: argparse.Namespace, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", role, "--token", args.token]
    cmd += ["--start", repr(args.start), "--seconds", str(args.seconds), "--hz", str(args.hz)]
    cmd += ["--ranks-per-node", str(args.ranks_per_node), *(["--spread"] if args.spread else [])]
    return subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, text=True)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Start the monitor, then the workers; wait for all; gather their reports."""
    args.start = time.time() + args.setup_s
    monitor = _spawn("monitor", args)
    procs = [monitor]
    try:
        port = int(monitor.stdout.readline())  # type: ignore[union-attr]
        per_worker = -(-args.nodes // args.workers)
        for first in range(0, args.nodes, per_worker):
            count = min(per_worker, args.nodes - first)
            procs.append(_spawn("worker", args, "--first-node", str(first), "--nodes", str(count),
                                "--port", str(port)))  # fmt: skip
        reports = []
        for i, p in enumerate(procs):
            out = p.communicate(timeout=args.seconds + args.setup_s + 120)[0]
            if p.returncode != 0:
                role = "worker" if i else "monitor"
                raise SystemExit(f"the {role} process failed (exit {p.returncode}); see above")
            reports.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    workers = reports[1:]
    load = {k: sum(w[k] for w in workers) for k in workers[0] if k != "sender_max_behind_s"}
    load["sender_max_behind_s"] = max(w["sender_max_behind_s"] for w in workers)
    return {
        "nodes": args.nodes,
        "ranks": args.nodes * args.ranks_per_node,
        "hz": args.hz,
        "seconds": args.seconds,
        "pattern": "spread" if args.spread else "synchronous steps",
        "token": bool(args.token),
        "workers": len(workers),
        "load": load,
        "monitor": reports[0],
    }


def main() -> int:
    """Parse options; run a role (internal) or the whole measurement; print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--hz", type=float, default=1.0, help="steps per second per rank")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=4, help="processes simulating the nodes")
    parser.add_argument("--token", default="bench-token", help='"" for none (NULL mechanism)')
    parser.add_argument("--spread", action="store_true", help="space the ranks' records evenly")
    parser.add_argument("--setup-s", type=float, default=10.0, help="time to connect before step 0")
    parser.add_argument("--role", choices=("all", "monitor", "worker"), default="all")
    parser.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--first-node", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "monitor":
        result = run_monitor(args.token, args.start, args.seconds)
    elif args.role == "worker":
        result = run_worker(args, args.first_node, args.nodes, args.port)
    else:
        result = run_all(args)
    print(json.dumps(result, indent=None if args.role != "all" else 1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
