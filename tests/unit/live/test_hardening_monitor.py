"""Issue 14, part 2: one message never stops the monitor. Each attack over real zmq sockets on
127.0.0.1: deep nesting, absurd numbers, a bad message inside a batch, many-frame and oversize
messages, unknown fields, and what a relay forwards."""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from zdiag.cli import main
from zdiag.live.receiver import LiveReceiver, Relay
from zdiag.live.state import LAST_FIELDS, MonitorState
from zdiag.live.wire import (
    MAX_MESSAGE_BYTES,
    SCHEMA_FRAME,
    STEP_FIELDS,
    WireError,
    decode,
    encode,
)
from zdiag.tui.monitor_text import header_line, render_summary, spark, view_to_json

NESTED_60KB = b'{"kind":"step","rank":0,"step":1,"ts":1.0,"x":' + b"[" * 30000 + b"]" * 30000 + b"}"


def good(rank: int = 0, step: int = 1, **extra: Any) -> dict[str, Any]:
    return {"kind": "step", "rank": rank, "step": step, "ts": time.time(), **extra}


@contextlib.contextmanager
def pusher(endpoint: Any) -> Iterator[zmq.Socket[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint.connect_url)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def poll_until(rx: LiveReceiver, done: Any, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while not done(got) and time.monotonic() < deadline:
        got += rx.poll(timeout_ms=50)
    return got


def test_deeply_nested_record_is_refused_and_counted_without_recursion() -> None:
    assert len(NESTED_60KB) > 60_000
    with pytest.raises(RecursionError):  # the attack is real: the stdlib parser recurses
        json.loads(NESTED_60KB)
    rx = LiveReceiver("127.0.0.1:0")
    try:
        with pusher(rx.endpoint) as sock:
            sock.send_multipart([SCHEMA_FRAME, b"", NESTED_60KB])
            sock.send_multipart(encode(good(), b""))
            got = poll_until(rx, lambda g: len(g) >= 1 and rx.rejections["nested"] >= 1)
        assert [r["step"] for r in got] == [1]
        assert rx.rejections["nested"] == 1 and rx.rejected == 1
    finally:
        rx.close()


def test_decode_raises_only_wire_errors_with_a_reason() -> None:
    cases = {
        b'{"rank":0,"step":1,"ts":1,"step_time_ms":1.7e308}': "range",
        b'{"rank":0,"step":1,"ts":1,"mem_allocated_bytes":-1.7e308}': "range",
        b'{"rank":1e30,"step":1,"ts":1}': "field",
        b'{"rank":-3,"step":1,"ts":1}': "range",
        b'{"rank":0,"step":1,"ts":1e400}': "range",
        b'{"rank":0,"step":1,"ts":1,"comm_ms":"12"}': "field",
        b'{"rank":0,"step":1,"ts":1,"ended":"crashed"}': "field",
        b'{"rank":0,"step":1,"ts":1,"ended":7}': "field",
        b'{"rank":0,"step":' + str(2**64).encode() + b',"ts":1}': "range",
        b'{"rank":0,"step":1,"ts":1,"samples_per_s":' + b"9" * 400 + b"}": "range",
        b"\xff\xfe": "json",
        b"[1]": "json",
        NESTED_60KB: "nested",
    }
    for payload, reason in cases.items():
        with pytest.raises(WireError) as info:
            decode([SCHEMA_FRAME, b"", payload])
        assert info.value.reason == reason, payload[:60]


def test_decoded_record_holds_only_schema_fields() -> None:
    rec = decode(encode(good(junk="x" * 10_000, nested_ok=1, host="h" * 500), b""))
    assert set(rec) == set(STEP_FIELDS)
    assert len(rec["host"]) == 128


def test_one_bad_message_in_a_batch_costs_only_itself() -> None:
    rx = LiveReceiver("127.0.0.1:0")
    try:
        with pusher(rx.endpoint) as sock:
            sock.send_multipart(encode(good(step=1), b""))
            sock.send_multipart([SCHEMA_FRAME, b"", b'{"rank": 0, "step": '])  # cut short
            sock.send_multipart(encode(good(step=2, step_time_ms=1.7e308), b""))
            sock.send_multipart(encode({"kind": "step", "rank": "x", "step": 3, "ts": 1.0}, b""))
            sock.send_multipart(encode(good(step=4), b""))
            time.sleep(0.3)  # all five queued: one poll takes them as one batch
            got = poll_until(rx, lambda g: len(g) >= 2)
        assert [r["step"] for r in got] == [1, 4]
        assert {k: v for k, v in rx.rejections.items() if v} == {"json": 1, "range": 1, "field": 1}
    finally:
        rx.close()


def test_state_isolates_a_record_it_cannot_fold_in() -> None:
    state = MonitorState()
    now = time.time()
    batch = [
        dict(good(step=1), recv_ts=now),
        {"kind": "step", "rank": "x", "step": 2},  # from a source that does not decode
        dict(good(step=3), step_time_ms=float("inf"), recv_ts=now),
        dict(good(step=4), recv_ts=now),
    ]
    state.ingest(batch, now)
    assert [s.step for s in state.ranks[0].steps] == [1, 4]
    view = state.view(now)
    assert view.rejections == {"record": 2} and view.rejected == 2


def test_many_frame_and_oversize_messages_are_counted_and_not_buffered_by_python() -> None:
    rx = LiveReceiver("127.0.0.1:0")
    try:
        with pusher(rx.endpoint) as sock:
            frame = b"a" * 60_000  # each frame under the limit, the message far over it
            sock.send_multipart([SCHEMA_FRAME, b"", *([frame] * 200)])
            sock.send_multipart([SCHEMA_FRAME, b"", b"b" * (MAX_MESSAGE_BYTES + 1)])
            sock.send_multipart([SCHEMA_FRAME, b"", b"{}", b"{}"])  # 4 frames, small
            sock.send_multipart(encode(good(step=9), b""))
            got = poll_until(rx, lambda g: len(g) >= 1 and rx.rejections["oversize"] >= 3)
        assert [r["step"] for r in got] == [9]
        assert rx.rejections["oversize"] == 3
    finally:
        rx.close()


def test_last_record_per_rank_keeps_only_the_table_fields() -> None:
    state = MonitorState()
    rec = dict(good(), junk="x" * 1_000_000, step_time_ms=5.0, recv_ts=time.time())
    state.ingest([rec], time.time())
    assert set(state.ranks[0].last) == set(LAST_FIELDS)


def test_absurd_finite_values_do_not_crash_the_views() -> None:
    state = MonitorState()
    now = time.time()
    records = []
    for step in range(12):
        sign = 1 if step % 2 else -1
        for rank in (0, 1):
            records.append(
                dict(
                    good(rank=rank, step=step),
                    ts=now,
                    recv_ts=now,
                    step_time_ms=sign * 1.7e308,
                    compute_ms=1.7e308,
                    comm_ms=-1.7e308,
                    exposed_comm_ms=1.7e308,
                    mem_allocated_bytes=(-1.7e308 if step < 6 else 1.7e308),
                    mem_peak_bytes=1.7e308,
                )
            )
    state.ingest(records, now)
    assert len(state.ranks[0].steps) == 12
    view = state.view(now)
    text = render_summary(view)
    assert "rank" in text
    out = json.dumps(view_to_json(view), allow_nan=False)  # never Infinity / NaN
    assert "Infinity" not in out and "NaN" not in out
    assert spark((1.7e308, -1.7e308, 0.0)) == "█▁▅"
    assert spark((1.7e308, 1.7e308)) == "▄▄"


def test_relay_forwards_only_valid_records_in_the_schema() -> None:
    monitor = LiveReceiver("127.0.0.1:0")
    relay = Relay("127.0.0.1:0", monitor.endpoint, host="node-a", stats_interval_s=0.2)
    relay.start_thread()
    try:
        with pusher(relay.receiver.endpoint) as sock:
            got: list[dict[str, Any]] = []
            deadline = time.monotonic() + 10
            while not any(r["kind"] == "step" for r in got) and time.monotonic() < deadline:
                sock.send_multipart([SCHEMA_FRAME, b"", NESTED_60KB])
                sock.send_multipart(encode(good(step=5, junk="x" * 5000), b""))
                got += monitor.poll(timeout_ms=100)
        steps = [r for r in got if r["kind"] == "step"]
        assert steps and all(set(r) == {*STEP_FIELDS, "recv_ts"} for r in steps)
        assert monitor.rejected == 0  # nothing invalid was forwarded
        assert relay.receiver.rejections["nested"] >= 1
    finally:
        relay.stop()
        monitor.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _sending(port: int, messages: list[list[bytes]]) -> Iterator[None]:
    """A PUSH socket on a thread sending `messages` to the port every 0.1 s inside the block."""
    stop = threading.Event()

    def send() -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        try:
            while not stop.is_set():
                for frames in messages:
                    sock.send_multipart(frames)
                time.sleep(0.1)
        finally:
            sock.close()
            ctx.term()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        stop.set()
        sender.join(5)


def _headless(port: int, *extra: str) -> tuple[int, str, str]:
    """`zdiag monitor --headless` for 1.5 s on the port: (exit code, stdout, stderr)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(
            [
                *("monitor", "--headless", *extra, "--duration", "1.5"),
                *("--listen", f"127.0.0.1:{port}"),
            ]
        )
    out.seek(0)
    return rc, out.read(), err.getvalue()


def test_headless_json_counts_rejections_by_reason_and_prints_no_infinity() -> None:
    port = _free_port()
    messages = [
        [SCHEMA_FRAME, b"", NESTED_60KB],
        [SCHEMA_FRAME, b"", b"c" * (MAX_MESSAGE_BYTES + 10)],
        encode(good(step=1, step_time_ms=1.7e308), b""),
        encode(good(step=2, step_time_ms=5.0), b""),
    ]
    with _sending(port, messages):
        rc, text, err = _headless(port, "--json")
    assert rc == 0, err

    def no_constants(name: str) -> None:
        raise AssertionError(f"--json printed {name}")

    data = json.loads(text, parse_constant=no_constants)
    reasons = data["rejections"]
    assert reasons["nested"] >= 1 and reasons["oversize"] >= 1 and reasons["range"] >= 1
    assert data["records"] >= 1 and data["rejected"] == sum(reasons.values())
    # the step-time history: step 2 only (step 1's absurd time was refused on the wire)
    assert data["history"]["steps"] == [2] and data["history"]["ranks"] == {"0": [5.0]}
    assert data["history"]["median_ms"] == [5.0] and data["history"]["slowest_rank"] == [0]


def test_header_shows_rejections_by_reason() -> None:
    state = MonitorState()

    class Source:
        def __init__(self) -> None:
            self.rejected = 4
            self.rejections = {"oversize": 3, "token": 1, "json": 0}

        def poll(self) -> list[dict[str, Any]]:
            return []

        def close(self) -> None:
            pass

    state.sync_rejections(Source())
    assert "rejected 4 (3 oversize, 1 token)" in header_line(state.view(time.time()))


def test_hung_in_is_a_bounded_string_or_none() -> None:
    from zdiag.live.wire import SCHEMA_FRAME, decode

    base = {"kind": "step", "rank": 0, "step": 3, "ts": 1.0}
    frames = lambda obj: [SCHEMA_FRAME, b"", json.dumps(obj).encode()]  # noqa: E731
    assert decode(frames({**base, "hung_in": "x" * 500}))["hung_in"] == "x" * 128
    assert decode(frames({**base, "hung_in": 7}))["hung_in"] is None
    assert decode(frames(base))["hung_in"] is None


def test_end_of_run_and_last_collective_fields() -> None:
    from zdiag.live.wire import SCHEMA_FRAME, decode

    base = {"kind": "step", "rank": 0, "step": 3, "ts": 1.0}
    frames = lambda obj: [SCHEMA_FRAME, b"", json.dumps(obj).encode()]  # noqa: E731
    assert decode(frames({**base, "ended": "finished"}))["ended"] == "finished"
    assert decode(frames({**base, "ended": "failed"}))["ended"] == "failed"
    assert decode(frames(base))["ended"] is None
    assert decode(frames({**base, "last_collective": "a" * 300}))["last_collective"] == "a" * 128
    assert decode(frames({**base, "last_collective": 5}))["last_collective"] is None
    assert decode(frames({**base, "mem_source": "process"}))["mem_source"] == "process"
    assert decode(frames({**base, "mem_source": "disk"}))["mem_source"] is None


def test_comm_by_dim_is_a_bounded_map_of_two_milliseconds() -> None:
    base = {"kind": "step", "rank": 0, "step": 3, "ts": 1.0}
    frames = lambda obj: [SCHEMA_FRAME, b"", json.dumps(obj).encode()]  # noqa: E731
    ok = decode(frames({**base, "comm_by_dim": {"dp": [12.5, 3.0], "tp": [4.0, 9.0]}}))
    assert ok["comm_by_dim"] == {"dp": (12.5, 3.0), "tp": (4.0, 4.0)}  # exposed <= comm
    assert decode(frames(base))["comm_by_dim"] is None
    for bad in (
        [1, 2],
        {"dp": [1.0]},
        {"dp": ["1", 2]},
        {"": [1, 1]},
        {"x" * 33: [1, 1]},
        {f"d{i}": [1, 1] for i in range(10)},
    ):
        with pytest.raises(WireError) as info:
            decode(frames({**base, "comm_by_dim": bad}))
        assert info.value.reason == "field"
    with pytest.raises(WireError) as info:
        decode(frames({**base, "comm_by_dim": {"dp": [-1, 0]}}))
    assert info.value.reason == "range"


def test_comm_by_dim_reaches_the_detail_and_the_json_view() -> None:
    from zdiag.tui.monitor_detail import detail_lines

    state = MonitorState()
    by_dim = {"dp": (12.0, 3.0), "tp": (30.0, 25.0)}
    state.ingest([dict(good(), step_time_ms=50.0, comm_by_dim=by_dim)], time.time())
    view = state.view(time.time())
    assert view_to_json(view)["rows"][0]["comm_by_dim"] == {"dp": [12.0, 3.0], "tp": [30.0, 25.0]}
    lines = detail_lines(state.detail(0, time.time()))
    line = next(x for x in lines if "by mesh dimension" in x)
    assert line.index("tp") < line.index("dp")  # largest first
    assert "exposed" in line


# --- issue 24: names from the wire reach the terminal as text --------------------------------

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\x9b31m\u202eevil\ngpu-0 fake row\t[bold red]x[/]"
"""Clear the screen, retitle the window (OSC ... BEL), a C1 CSI, a bidi override, a newline that
would forge a table row, a tab, and Textual/Rich markup."""
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Terminal controls (tab and newline apart: checked per line) and bidi controls."""


class _OneBatch:
    """A monitor source that yields `records` once, then nothing."""

    rejected = 0

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.batches = [records]

    def poll(self) -> list[dict[str, Any]]:
        return self.batches.pop(0) if self.batches else []

    def close(self) -> None:
        pass


def hostile_records() -> list[dict[str, Any]]:
    now = time.time()
    return [
        dict(
            good(rank=rank, step=step),
            host=HOSTILE,
            job="job\x1b]8;;http://x\x1b\\link",
            ts=now,
            recv_ts=now,
            step_time_ms=10.0,
            **({"hung_in": "all_gather \x1b[31m\u2066x"} if rank == 1 and step == 3 else {}),
        )
        for step in range(4)
        for rank in (0, 1)
    ]


def test_text_summary_shows_hostile_names_as_escapes() -> None:
    state = MonitorState()
    state.ingest(hostile_records(), time.time())
    text = render_summary(state.view(time.time()))
    assert not UNSAFE.search(text), ascii(text)
    assert "\t" not in text
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\x9b31m\\u202eevil\\ngpu-0 fake row\\t[bold red]x[/]" in text
    assert "job job\\x1b]8;;http://x\\x1b\\link" in text
    assert "hung in all_gather \\x1b[31m\\u2066x" in text
    assert not any(line.startswith("gpu-0") for line in text.splitlines())  # no forged row
    table = text.split("\n\n")[-1].splitlines()
    assert len(table) == 3 and table[0].startswith("rank")  # header + one line per rank


def test_headless_text_mode_prints_no_escape_from_the_wire() -> None:
    port = _free_port()
    with _sending(port, [encode(record, b"") for record in hostile_records()]):
        rc, text, err = _headless(port)
    assert rc == 0, err
    assert "pwned" in text, text  # the records arrived ...
    assert not UNSAFE.search(text), ascii(text)  # ... and no control reached the terminal
    assert "\\x1b]0;pwned\\x07" in text and "\\u202eevil" in text


@pytest.mark.tui
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_textual_table_and_header_show_markup_and_escapes_as_text() -> None:
    from textual.widgets import DataTable, Static

    from zdiag.tui.monitor_app import MonitorApp

    now = time.time()

    app = MonitorApp(
        _OneBatch(hostile_records()),
        clock=lambda: now,
        poll_interval_s=0.05,
        refresh_interval_s=3600,
    )
    async with app.run_test(size=(160, 30)) as pilot:
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        cell = app.query_one("#ranks", DataTable).get_row_at(0)[1]
        assert str(cell).endswith("[bold red]x[/]") and not cell.spans  # literal, unstyled
        assert not UNSAFE.search(str(cell))
        header = str(app.query_one("#header", Static).render())
        assert "job job\\x1b]8;;http://x\\x1b\\link" in header and not UNSAFE.search(header)


@pytest.mark.tui
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_textual_rank_screen_shows_hostile_names_as_text() -> None:
    from textual.widgets import Static

    from zdiag.tui.monitor_app import MonitorApp

    now = time.time()
    records = [dict(r, last_collective="[@click=app.quit]c[/]") for r in hostile_records()]

    app = MonitorApp(
        _OneBatch(records), clock=lambda: now, poll_interval_s=0.05, refresh_interval_s=3600
    )
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        shown = [w.render() for w in app.screen.query(Static)]
        text = "\n".join(str(r) for r in shown)
        assert "[bold red]x[/]" in text and "[@click=app.quit]c[/]" in text
        assert not any(getattr(r, "spans", None) for r in shown)
        assert not UNSAFE.search(text.replace("\n", ""))
