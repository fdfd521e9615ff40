"""Fuzzing the live stream: mutated and generated step records through the decoder, the
monitor's state and renderers, and a batch of them through a real receiver on 127.0.0.1.

The decoder may only return a record in its fixed schema or raise WireError; the state and the
renderers must take whatever the decoder returns; `--json`'s data must hold no NaN/Infinity;
a receiver must account for every message sent (received + rejected)."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

pytest.importorskip("hypothesis")

import fuzz_inputs as fz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zdiag.live.receiver import LiveReceiver
from zdiag.live.state import MonitorState
from zdiag.live.wire import (
    RELAY_FIELDS,
    SCHEMA_FRAME,
    STEP_FIELDS,
    WireError,
    decode,
)
from zdiag.tui.monitor_text import render_summary, view_to_json

FIELDS = (*STEP_FIELDS, "junk", "recv_ts")


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def good_record(step: int, rank: int = 0) -> dict[str, Any]:
    return {
        "kind": "step",
        "rank": rank,
        "host": "h",
        "step": step,
        "ts": 1.7e9 + step,
        "step_time_ms": 100.0 + step,
        "compute_ms": 80.0,
        "comm_ms": 30.0,
        "exposed_comm_ms": 10.0,
        "mem_allocated_bytes": 1e9 + step * 1e7,
        "mem_reserved_bytes": 2e9,
        "mem_peak_bytes": 1.5e9,
        "samples_per_s": 50.0,
        "seq": step,
        "dropped": 0,
        "pid": 42,
    }


def mutated_payload(rng: random.Random) -> bytes:
    rec: dict[str, Any] = good_record(rng.randrange(100), rng.randrange(4))
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(FIELDS)
        if rng.random() < 0.2:
            rec.pop(key, None)
        else:
            rec[key] = fz.hostile(rng)
    text = fz.dumps(rec)
    if rng.random() < 0.25:
        text = fz.flip_bytes(rng, text, rng.randint(1, 3))
    return text


def decoded_or_none(payload: bytes) -> dict[str, Any] | None:
    try:
        rec = decode([SCHEMA_FRAME, b"", payload])
    except WireError as exc:
        assert exc.reason in ("oversize", "json", "nested", "field", "range"), exc.reason
        return None
    assert set(rec) == set(RELAY_FIELDS if rec["kind"] == "relay" else STEP_FIELDS)
    return rec


def fold_and_render(records: list[dict[str, Any]]) -> None:
    state = MonitorState()
    now = 1.7e9 + 200
    state.ingest([dict(r, recv_ts=now) for r in records], now)
    view = state.view(now)
    render_summary(view)
    json.dumps(view_to_json(view), allow_nan=False)


@fuzz(300)
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_records(seed: int) -> None:
    rng = random.Random(seed)
    records = [good_record(s) for s in range(10)]
    for _ in range(5):
        rec = decoded_or_none(mutated_payload(rng))
        if rec is not None:
            records.append(rec)
    fold_and_render(records)


number = st.one_of(
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**70), 2**70),
    st.text(max_size=4),
    st.booleans(),
)


@fuzz(200)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "kind": st.sampled_from(["step", "step", "relay", "x"]),
                "rank": st.one_of(st.integers(-5, 2**40), number),
                "step": st.one_of(st.integers(-5, 2**70), number),
                "ts": number,
                "host": st.one_of(st.text(max_size=200), number),
            },
            optional={k: number for k in STEP_FIELDS if k.endswith(("_ms", "_bytes", "_s"))}
            | {"dropped": number, "pid": number, "forwarded": number},
        ),
        max_size=20,
    )
)
def test_generated_records(records: list[dict[str, Any]]) -> None:
    decoded = [decoded_or_none(json.dumps(r).encode()) for r in records]
    fold_and_render([r for r in decoded if r is not None])


def test_a_fuzzed_batch_through_a_real_receiver_is_fully_accounted_for() -> None:
    import zmq

    rng = random.Random(14)
    payloads = [mutated_payload(rng) for _ in range(150)]
    expected_ok = sum(1 for p in payloads if decoded_or_none(p) is not None)
    rx = LiveReceiver("127.0.0.1:0")
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx.endpoint.connect_url)
    try:
        for p in payloads:
            sock.send_multipart([SCHEMA_FRAME, b"", p])
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        while len(got) + rx.rejected < len(payloads) and time.monotonic() < deadline:
            got += rx.poll(timeout_ms=50)
        assert len(got) == expected_ok
        assert rx.rejected == len(payloads) - expected_ok
        fold_and_render(got)
    finally:
        sock.close()
        ctx.term()
        rx.close()
