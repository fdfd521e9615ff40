"""Triggered captures without processes: the control message, the controller's decisions (when to
ask, which step, re-sending, following the ranks' answers, the analysis) and the run directory's
list of captures."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from support.monitor_records import NOW, job, rec
from zdiag.analyzers.inputs.run_dir import capture_windows
from zdiag.live import captures as cap
from zdiag.live.state import MonitorState
from zdiag.live.wire import SCHEMA, decode, decode_control, encode


def test_a_control_message_decodes_only_with_the_token_and_sane_fields() -> None:
    good = {"kind": "capture", "id": 1, "step": 40, "steps": 3, "job": "j"}
    expected = {"id": 1, "step": 40, "steps": 3, "job": "j", "reason": ""}
    assert decode_control(encode(good, b"t"), b"t") == expected
    assert decode_control(encode(good, b"x"), b"t") is None  # another token
    for bad in ({"steps": 0}, {"steps": 99}, {"step": -1}, {"id": True}, {"kind": "step"}):
        assert decode_control(encode({**good, **bad}, b"t"), b"t") is None, bad
    assert decode_control([b"zdiag.live/1", b"t", b"{not json"], b"t") is None
    deep = b"[" * 3000 + b"]" * 3000  # once raised RecursionError, stopping a rank's publisher
    assert decode_control([b"zdiag.live/1", b"t", deep], b"t") is None


def test_step_records_carry_the_latest_capture() -> None:
    frames = encode(
        {**rec(1, 5), "schema": SCHEMA, "capture_id": 2, "capture_state": "done",
         "capture_path": "/r/captures/capture-2/rank-1.json.gz"},
        b"",
    )  # fmt: skip
    out = decode(frames)
    assert (out["capture_id"], out["capture_state"]) == (2, "done")
    bad = decode(encode({**rec(1, 5), "capture_state": "exploded"}, b""))
    assert bad["capture_state"] is None


def _slow_job() -> list[dict[str, Any]]:
    return job(ranks=4, steps=40, r2={"compute_ms": lambda s: 370.0 if s >= 10 else 70.0})


def test_a_chronic_straggler_asks_every_rank_once_then_follows_the_answers() -> None:
    sent: list[dict[str, Any]] = []
    analyzed: list[list[str]] = []

    def analyze(paths: list[str]) -> list[dict[str, Any]]:
        analyzed.append(paths)
        return [{"id": "straggler", "severity": "warning", "title": "t", "ranks": [2]}]

    controller = cap.CaptureController(sent.append, analyze=analyze)
    state = MonitorState()
    state.ingest(_slow_job(), NOW)
    controller.update(state, NOW)
    (request,) = sent
    assert request["kind"] == "capture" and request["step"] == 39 + cap.CAPTURE_LEAD_STEPS
    assert request["steps"] == cap.CAPTURE_STEPS and request["job"] == "job-7"
    controller.update(state, NOW + 0.1)
    assert len(sent) == 1  # no second capture (cooldown), no re-send yet
    controller.update(state, NOW + cap.RESEND_S + 0.1)
    assert len(sent) == 2 and sent[1]["id"] == request["id"]  # re-sent until answered
    answers = [
        rec(r, 40, ts=NOW + 1, recv_ts=NOW + 1, capture_id=request["id"], capture_state="done",
            capture_path=f"/run/captures/capture-1/rank-{r}.json.gz")
        for r in range(4)
    ]  # fmt: skip
    state.ingest(answers, NOW + 1)
    controller.update(state, NOW + 1.2)
    deadline = time.monotonic() + 5
    while controller.captures[0].findings is None and time.monotonic() < deadline:
        time.sleep(0.01)
    shown = controller.to_json()[0]
    assert set(shown["states"].values()) == {"done"}
    assert shown["findings"][0]["ranks"] == [2]
    assert len(analyzed) == 1 and len(analyzed[0]) == 4


def test_a_healthy_job_is_never_asked() -> None:
    sent: list[dict[str, Any]] = []
    controller = cap.CaptureController(sent.append)
    state = MonitorState()
    state.ingest(job(ranks=4, steps=40), NOW)
    for i in range(5):
        controller.update(state, NOW + i)
    assert sent == [] and controller.to_json() == []


def test_a_capture_some_rank_never_answers_is_given_up() -> None:
    controller = cap.CaptureController(lambda payload: None)
    state = MonitorState()
    state.ingest(_slow_job(), NOW)
    controller.update(state, NOW)
    controller.update(state, NOW + cap.GIVE_UP_S + 1)
    assert controller.to_json()[0]["error"] == "some ranks never answered"


def test_the_run_directory_lists_its_captures(tmp_path: Path) -> None:
    assert capture_windows(tmp_path) == []
    for k, ranks in ((2, 4), (10, 2)):
        folder = tmp_path / "captures" / f"capture-{k}"
        folder.mkdir(parents=True)
        for r in range(ranks):
            (folder / f"rank-{r}.json.gz").write_bytes(b"")
    (tmp_path / "captures" / "capture-1").symlink_to(tmp_path)
    assert capture_windows(tmp_path) == [("captures/capture-2", 4), ("captures/capture-10", 2)]


def test_zdiag_capture_reaches_the_monitor_and_asks_without_cool_down() -> None:
    from zdiag.cli import main
    from zdiag.live.receiver import LiveReceiver

    receiver = LiveReceiver("127.0.0.1:0")
    try:
        assert main(["capture", "--monitor", str(receiver.endpoint), "--reason", "loss spike"]) == 0
        records: list[dict[str, Any]] = []
        deadline = time.monotonic() + 5
        while not records and time.monotonic() < deadline:
            records = receiver.poll(timeout_ms=100)
    finally:
        receiver.close()
    (ask,) = records
    assert (ask["kind"], ask["reason"], ask["job"]) == ("capture", "loss spike", "")
    sent: list[dict[str, Any]] = []
    controller = cap.CaptureController(sent.append)
    state = MonitorState()
    state.ingest(job(ranks=4, steps=40), NOW)
    controller.request(state, NOW, "earlier")  # a capture a moment ago: cooling down
    state.ingest([ask], NOW + 1)
    controller.update(state, NOW + 1)
    assert [c["reason"] for c in controller.to_json()] == ["earlier", "zdiag capture: loss spike"]
    assert len({p["id"] for p in sent}) == 2
