"""Host syncs attributed to their caller (analyzers/rank/host_syncs.py) and the `host-sync` finding."""

from __future__ import annotations

import json
from pathlib import Path

from zdiag.analyzers.detectors import BY_ID, run_context
from zdiag.analyzers.detectors.context import DetectorContext
from zdiag.analyzers.inputs.loader import load_rank_trace
from zdiag.analyzers.rank.host_syncs import host_sync_sites, in_model_mask, sync_events
from zdiag.analyzers.rank.rank_analysis import rank_facts


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict[str, object]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def _sync(ts: float) -> list[dict[str, object]]:
    return [_x("aten::item", ts, 3.0), _x("aten::_local_scalar_dense", ts + 0.5, 2.0)]


LIBRARY_FRAME = (
    "/venv/lib/python3.12/site-packages/transformers/masking_utils.py(712): "
    "find_packed_sequence_indices"
)


def _trace(
    tmp_path: Path,
    per_block_checks: bool,
    with_stack: bool = False,
    library: bool = False,
    library_frame: str = LIBRARY_FRAME,
) -> Path:
    """Two steps of a 2-unit FSDP2 model: AdamW's step-counter syncs inside
    `Optimizer.step#AdamW.step`, a loss `.item()` in the loop, and (optionally) one NaN-check
    sync inside each unit's forward."""
    ev: list[dict[str, object]] = []
    for step in range(2):
        t0 = step * 10_000.0
        ev.append(_x(f"ProfilerStep#{step}", t0, 9_000.0, "user_annotation"))
        for k, unit in enumerate(("encoder.stages.0", "encoder.stages.1")):
            s = t0 + 100 + k * 1000
            ev.append(_x(f"FSDP::pre_forward ({unit})", s, 50.0, "user_annotation"))
            if per_block_checks:
                ev.extend(_sync(s + 300))
                if with_stack:
                    ev.append(_x("examples/net.py(28): forward", s + 200, 300.0, "python_function"))
                    if library:  # the sync is inside transformers' own code, under the model
                        ev.append(_x(library_frame, s + 220, 260.0, "python_function"))
                        # a standard-library wrapper inside it (trimmed as torch records it)
                        ev.append(_x("contextlib.py(81): inner", s + 230, 200.0, "python_function"))
                    ev.append(
                        _x("torch/nn/module.py(1): _call_impl", s + 250, 100.0, "python_function")
                    )
            ev.append(_x(f"FSDP::post_forward ({unit})", s + 800, 50.0, "user_annotation"))
        ev.append(_x("Optimizer.step#AdamW.step", t0 + 5000, 2000.0, "user_annotation"))
        for j in range(4):
            ev.extend(_sync(t0 + 5100 + j * 100))
        ev.extend(_sync(t0 + 8000))  # loss.item() for logging
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_syncs_go_to_the_optimizer_the_units_and_the_loop(tmp_path: Path) -> None:
    sites = host_sync_sites(load_rank_trace(_trace(tmp_path, per_block_checks=True)))
    assert sites.total == 2 * (4 + 1 + 2)  # the inner op only, not aten::item as well
    assert sites.optimizer == {"Optimizer.step#AdamW.step": 8}
    assert sites.units == {"encoder.stages.0": 2, "encoder.stages.1": 2}
    assert sites.loop == 2 and sites.in_model == 4
    assert sites.source_lines == {}


def test_the_step_models_mark_the_models_own_syncs(tmp_path: Path) -> None:
    """The mask the replay's `--no-model-syncs` reads: the units' syncs only, in start order."""
    trace = load_rank_trace(_trace(tmp_path, per_block_checks=True))
    mask = in_model_mask(trace, sync_events(trace))
    assert mask == [True, True, False, False, False, False, False] * 2


def test_source_lines_skip_torch_frames(tmp_path: Path) -> None:
    sites = host_sync_sites(load_rank_trace(_trace(tmp_path, True, with_stack=True)))
    assert sites.source_lines == {"examples/net.py:28 forward": 4}


def test_a_sync_in_a_library_is_the_librarys(tmp_path: Path) -> None:
    """Issue 30: a host sync in transformers' own code was described as the user's `.item()`."""
    trace = _trace(tmp_path, True, with_stack=True, library=True)
    sites = host_sync_sites(load_rank_trace(trace))
    assert sites.source_lines == {}
    assert sites.library_lines == {
        "transformers: /venv/lib/python3.12/site-packages/transformers/masking_utils.py:712 "
        "find_packed_sequence_indices": 4
    }
    ctx = DetectorContext(ledgers={}, facts={0: rank_facts(load_rank_trace(trace))})
    (f,) = [f for f in run_context(ctx).findings if f.id == "host-sync"]
    assert f.title.startswith("Host syncs in the transformers library's code: 4.0 per step")
    assert "not in yours" in f.recommendation and "masking_utils.py:712" in f.recommendation
    assert f.code is None  # nothing to paste into the user's script
    assert "library_lines" in f.evidence


def test_host_sync_finding_names_units_and_never_blames_the_optimizer(tmp_path: Path) -> None:
    assert "host-sync" in BY_ID
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bad = DetectorContext(
        ledgers={}, facts={0: rank_facts(load_rank_trace(_trace(tmp_path / "a", True)))}
    )
    (f,) = [f for f in run_context(bad).findings if f.id == "host-sync"]
    assert f.units == ["encoder.stages.0", "encoder.stages.1"]
    assert f.evidence["syncs_in_optimizer"] == {"Optimizer.step#AdamW.step": 8}
    assert "--with-stack" in f.recommendation and f.code
    clean = DetectorContext(
        ledgers={}, facts={0: rank_facts(load_rank_trace(_trace(tmp_path / "b", False)))}
    )
    assert "host-sync" not in {f.id for f in run_context(clean).findings}


def _zero3_trace(tmp_path: Path) -> Path:
    """Two steps of a ZeRO-3 run (no forward range): the forward-time autograd Functions of two
    modules, a NaN-check sync between them, the loss `.item()` after the forward, and the
    backward nodes (`...Backward`) with a sync among them that is not the forward's."""
    ev: list[dict[str, object]] = []
    for step in range(2):
        t0 = step * 10_000.0
        ev.append(_x(f"ProfilerStep#{step}", t0, 9_000.0, "user_annotation"))
        ev.append(_x("PreBackwardFunctionForModule", t0 + 100, 20.0))
        ev.extend(_sync(t0 + 500))  # per-block check inside the model
        ev.append(_x("PostBackwardFunctionModule", t0 + 1000, 20.0))
        ev.extend(_sync(t0 + 1500))  # loss.item(): after the last forward mark
        ev.append(_x("PreBackwardFunctionForModuleBackward", t0 + 2000, 20.0))
        ev.extend(_sync(t0 + 2500))
        ev.append(_x("PostBackwardFunctionModuleBackward", t0 + 3000, 20.0))
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_zero3_forward_marks_bound_the_model_code(tmp_path: Path) -> None:
    sites = host_sync_sites(load_rank_trace(_zero3_trace(tmp_path)))
    assert sites.total == 6
    assert sites.model_forward == 2  # one per step, between the forward marks
    assert sites.loop == 4 and sites.units == {}


def test_trimmed_frames_name_the_library_and_skip_the_standard_library(tmp_path: Path) -> None:
    """torch's profiler trims the sys.path prefixes: transformers' file reads
    `transformers/masking_utils.py` and contextlib's `contextlib.py`, as on a real run."""
    frame = "transformers/masking_utils.py(735): find_packed_sequence_indices"
    trace = _trace(tmp_path, True, with_stack=True, library=True, library_frame=frame)
    sites = host_sync_sites(load_rank_trace(trace))
    assert sites.source_lines == {}
    assert sites.library_lines == {
        "transformers: transformers/masking_utils.py:735 find_packed_sequence_indices": 4
    }


def test_a_sync_in_the_root_units_own_code_is_the_models(tmp_path: Path) -> None:
    """The root unit's ranges carry no module path (`FSDP::pre_forward`): a sync in its own
    forward, outside every block (a Hugging Face model building its mask), is the model's."""
    ev: list[dict[str, object]] = []
    for step in range(2):
        t0 = step * 10_000.0
        ev.append(_x(f"ProfilerStep#{step}", t0, 9_000.0, "user_annotation"))
        ev.append(_x("FSDP::pre_forward", t0 + 10, 50.0, "user_annotation"))
        ev.extend(_sync(t0 + 100))  # the root's own code, before the blocks
        ev.append(_x("FSDP::pre_forward (layers.0)", t0 + 200, 50.0, "user_annotation"))
        ev.extend(_sync(t0 + 300))
        ev.append(_x("FSDP::post_forward (layers.0)", t0 + 400, 50.0, "user_annotation"))
        ev.append(_x("FSDP::post_forward", t0 + 500, 50.0, "user_annotation"))
        ev.extend(_sync(t0 + 8000))  # loss.item() in the loop
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    sites = host_sync_sites(load_rank_trace(path))
    assert sites.units == {"": 2, "layers.0": 2}
    assert sites.loop == 2


def test_a_script_named_like_a_standard_module_stays_the_users() -> None:
    from zdiag.analyzers.rank.host_syncs import _framework_file, _library_of

    assert _framework_file("typing.py") and _framework_file("json/encoder.py")
    assert not _framework_file("test.py") and not _framework_file("examples/net.py")
    assert _library_of("transformers/masking_utils.py") == "transformers"
    assert _library_of("test.py") is None and _library_of("/home/me/model.py") is None
