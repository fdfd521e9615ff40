"""Fuzzing `zdiag analyze` through its CLI entry, in this process: damaged traces (field
mutations and byte flips of small real traces, structured malformed documents, junk bytes,
generated event lists), damaged run directories (manifest, OOM record, memory timeline, CUDA
snapshot, trace) and damaged flight-recorder dumps. Every case must end in exit 0, 1 or 2 (never 70), with no traceback and, for
exit 2, one error sentence, within `CASE_SECONDS`.

Fixed budget for CI: derandomized hypothesis runs with fixed example counts (about 30 s in all
on one core); `bench/fuzz_long.py` runs the same generators for longer.
"""

from __future__ import annotations

import gzip
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis")

import fuzz_inputs as fz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # real processes or engines: seconds per test (make integration)

CASE_SECONDS = 10.0


def fuzz(examples: int) -> settings:
    """Derandomized (fixed seeds), no example database, no deadline, `examples` cases."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="zdiag-fuzz-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def check(argv: list[str]) -> int:
    rc, stderr, seconds = fz.run_zdiag(argv)
    problem = fz.verdict(rc, stderr)
    assert problem is None, problem
    assert seconds < CASE_SECONDS, f"{seconds:.1f} s"
    return rc


def analyze_bytes(workdir: Path, data: bytes, name: str = "rank-0.json") -> int:
    path = workdir / name
    path.write_bytes(data)
    return check(["analyze", "-q", str(path)])


@fuzz(120)
@given(seed=SEEDS)
def test_trace_field_mutations(workdir: Path, seed: int) -> None:
    rng = random.Random(seed)
    doc = fz.mutate_trace_fields(rng, fz.base_trace(seed % 2), rng.randint(1, 4))
    analyze_bytes(workdir, fz.trace_bytes(doc))


@fuzz(120)
@given(seed=SEEDS)
def test_trace_byte_flips(workdir: Path, seed: int) -> None:
    rng = random.Random(seed)
    data = fz.flip_bytes(rng, fz.trace_bytes(fz.base_trace(seed % 2)), rng.randint(1, 4))
    if rng.random() < 0.3:
        data = gzip.compress(data, 1)
    analyze_bytes(workdir, data, "rank-0.json.gz" if data[:2] == b"\x1f\x8b" else "rank-0.json")


@fuzz(100)
@given(seed=SEEDS)
def test_structured_malformed_traces(workdir: Path, seed: int) -> None:
    analyze_bytes(workdir, fz.structured_trace(random.Random(seed)))


@fuzz(40)
@given(seed=SEEDS)
def test_junk_bytes(workdir: Path, seed: int) -> None:
    analyze_bytes(workdir, fz.raw_junk(random.Random(seed)))


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
event = st.fixed_dictionaries(
    {
        "ph": st.one_of(st.sampled_from(["X", "M", "i", "f", "s"]), json_value),
        "name": st.one_of(
            st.sampled_from(
                ["ProfilerStep#3", "ncclDevKernel_AllGather", "FSDP::all_gather (layers.0)"]
            ),
            st.text(max_size=30),
            json_value,
        ),
        "cat": st.one_of(st.sampled_from(["kernel", "cpu_op", "user_annotation"]), json_value),
        "pid": json_value,
        "tid": json_value,
        "ts": st.one_of(st.floats(-1e20, 1e20), json_value),
        "dur": st.one_of(st.floats(-10, 1e6), json_value),
    },
    optional={
        "args": st.one_of(
            json_value,
            st.fixed_dictionaries(
                {},
                optional={
                    "External id": json_value,
                    "In msg nelems": json_value,
                    "Group size": json_value,
                    "Collective name": json_value,
                    "Input Dims": json_value,
                    "dtype": json_value,
                },
            ),
        )
    },
)


@fuzz(100)
@given(
    events=st.lists(event, max_size=12),
    header=st.dictionaries(
        st.sampled_from(["distributedInfo", "deviceProperties", "baseTimeNanoseconds"]),
        json_value,
    ),
)
def test_generated_event_lists(workdir: Path, events: list[Any], header: dict[str, Any]) -> None:
    analyze_bytes(workdir, fz.dumps({"traceEvents": events, **header}))


@pytest.fixture(scope="module")
def base_run(workdir: Path) -> Path:
    run = fz.make_run_dir(workdir / "base-run")
    assert check(["analyze", "-q", str(run)]) in (0, 1)
    return run


@fuzz(40)
@given(seed=SEEDS)
@pytest.mark.parametrize("target", fz.RUN_DIR_TARGETS)
def test_run_dir_files(base_run: Path, workdir: Path, target: str, seed: int) -> None:
    run = workdir / f"run-{target}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base_run, run)
    fz.mutate_run_dir(random.Random(seed), run, target)
    check(["analyze", "-q", str(run)])


@pytest.fixture(scope="module")
def base_dumps(workdir: Path) -> Path:
    dumps = fz.make_dump_dir(workdir / "base-dumps")
    assert check(["analyze", "-q", str(dumps)]) in (0, 1)
    return dumps


@fuzz(40)
@given(seed=SEEDS)
def test_flight_recorder_dumps(base_dumps: Path, workdir: Path, seed: int) -> None:
    rng = random.Random(seed)
    dumps = workdir / "dumps"
    shutil.rmtree(dumps, ignore_errors=True)
    shutil.copytree(base_dumps, dumps)
    fz.mutate_dump(rng, dumps / f"nccl_trace_rank_{rng.randrange(4)}")
    check(["analyze", "-q", str(dumps)])
