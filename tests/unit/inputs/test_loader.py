"""Loading: decoding, rank inference, discovery of run directories, classification, collectives."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from support.stages import load_run
from support.traces import TraceBuilder
from zdiag.analyzers.engine.summary_pipeline import analyze_paths
from zdiag.analyzers.inputs.events import EventKind, classify, collective_kind
from zdiag.analyzers.inputs.loader import load_rank_trace, rank_from_file_name
from zdiag.analyzers.rank.collective_table import collectives_of
from zdiag.errors import InputError


def _small(rank: int | None = 0) -> TraceBuilder:
    b = TraceBuilder(rank=rank)
    b.step(1, 0, 100)
    b.kernel("gemm", 10, 20, launch_at=5)
    return b


# --- rank inference ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("rank-3.json.gz", 3),
        ("rank3.json", 3),
        ("trace_rank_12.pt.trace.json", 12),
        ("v100_ddp_rank1_of_2.json.gz", 1),
        ("job_5_of_8.json", 5),
        ("worker.r7.json", 7),
        ("trace.json", None),
        ("host123.1700000000.pt.trace.json", None),
    ],
)
def test_rank_from_file_name(name: str, rank: int | None) -> None:
    assert rank_from_file_name(Path(name)) == rank


def test_rank_precedence_distributed_info_then_file_name_then_default(tmp_path: Path) -> None:
    _small(rank=5).write(tmp_path / "rank-2.json")
    run = load_run([tmp_path / "rank-2.json"])
    assert (run.ranks[0].rank, run.ranks[0].rank_source) == (5, "distributedInfo")

    _small(rank=None).write(tmp_path / "rank-4.json")
    run = load_run([tmp_path / "rank-4.json"])
    assert (run.ranks[0].rank, run.ranks[0].rank_source) == (4, "file name")
    assert any("file name" in w for w in run.ranks[0].warnings)

    _small(rank=None).write(tmp_path / "trace.json")
    run = load_run([tmp_path / "trace.json"])
    assert (run.ranks[0].rank, run.ranks[0].rank_source) == (0, "default")
    assert any("assumed rank 0" in w for w in run.ranks[0].warnings)


def test_run_directory_with_manifest(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "traces").mkdir(parents=True)
    (run_dir / "memory").mkdir()
    for r in (0, 1):
        _small(rank=None).write(run_dir / "traces" / f"worker{r}.json.gz")
    (run_dir / "memory" / "rank-1.timeline.json.gz").write_bytes(gzip.compress(b"[]"))
    manifest = {
        "schema": "zdiag.manifest/1",
        "world_size": 2,
        "ranks": [
            {"rank": 1, "trace": "traces/worker0.json.gz"},
            {"rank": 0, "trace": "traces/worker1.json.gz"},
        ],
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    run = load_run([run_dir])
    assert run.run_dir == run_dir
    assert run.manifest is not None and run.manifest.world_size == 2
    assert [(t.rank, t.source.name, t.rank_source) for t in run.ranks] == [
        (0, "worker1.json.gz", "manifest"),
        (1, "worker0.json.gz", "manifest"),
    ]
    assert set(run.memory_timelines) == {1}


def test_folder_of_traces_and_several_files(tmp_path: Path) -> None:
    for r in (2, 0, 1):
        _small(rank=r).write(tmp_path / f"rank-{r}.json.gz")
    (tmp_path / "notes.txt").write_text("not a trace")
    (tmp_path / ".rank-3.json.gz.tmp-x1.json.gz").write_bytes(b"\x1f\x8b half-written")
    run = load_run([tmp_path])
    assert [t.rank for t in run.ranks] == [0, 1, 2]
    run = load_run([tmp_path / "rank-2.json.gz", tmp_path / "rank-0.json.gz"])
    assert [t.rank for t in run.ranks] == [0, 2]


def test_duplicate_ranks_warn(tmp_path: Path) -> None:
    _small(rank=0).write(tmp_path / "a.json")
    _small(rank=0).write(tmp_path / "b.json")
    run = load_run([tmp_path])
    assert any("several files" in w for w in run.warnings)


# --- decoding ------------------------------------------------------------------------------


def test_gzip_and_plain_give_the_same_columns(tmp_path: Path) -> None:
    b = _small()
    a = load_rank_trace(b.write(tmp_path / "t.json"))
    z = load_rank_trace(b.write(tmp_path / "t.json.gz"))
    assert np.array_equal(a.ts_us, z.ts_us) and np.array_equal(a.kind, z.kind)
    assert a.names == z.names


def test_bare_array_trace_and_sorted_columns(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 50, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": 10, "dur": 5},
        {"ph": "i", "name": "marker", "pid": 0, "tid": 7, "ts": 1},
    ]
    path = tmp_path / "arr.json"
    path.write_text(json.dumps(events))
    t = load_rank_trace(path)
    assert [t.name(i) for i in range(len(t))] == ["k1", "k2"]
    assert t.ts_us.tolist() == [10.0, 50.0]
    assert t.lanes[0].is_device


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_small().to_dict()).encode())
    assert len(load_rank_trace(path)) > 0


def test_numeric_strings_are_accepted_and_bad_values_rejected(tmp_path: Path) -> None:
    ok = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": "10.5", "dur": "2"}]}
    (tmp_path / "ok.json").write_text(json.dumps(ok))
    assert load_rank_trace(tmp_path / "ok.json").ts_us.tolist() == [10.5]
    bad = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": "soon"}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match="non-numeric 'dur'"):
        load_rank_trace(tmp_path / "bad.json")


def test_lanes_events_ids_and_kept_args(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0)
    b.step(1, 0, 100)
    ext = b.cpu_op(
        "record_param_comms",
        5,
        10,
        args={"Collective name": "_allgather_base", "In msg nelems": 1024, "dtype": "BFloat16"},
    )
    b.kernel(
        "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
        20,
        30,
        stream=20,
        launch_at=8,
        external_id=ext,
    )
    b.cpu_op("aten::mm", 40, 5)
    t = load_rank_trace(b.write(tmp_path / "t.json"))
    k = int(t.of_kind(EventKind.COMM_KERNEL)[0])
    assert t.lanes[int(t.lane_id[k])].name == "stream 20"
    assert t.external_id[k] == ext and t.correlation[k] > 0
    call = int(t.launch_calls(np.array([k]))[0])
    assert t.name(call) == "cudaLaunchKernel"
    mm = int(t.matching(r"^aten::mm$")[0])
    assert mm not in t.args  # plain ops keep no args
    assert len(collectives_of(t)) == 1
    assert collectives_of(t).kind_name(0) == "all_gather"
    assert collectives_of(t).bytes[0] == 1024 * 2
    assert collectives_of(t).dtype[0] == "BFloat16"


def test_generic_nccl_kernel_gets_its_kind_from_the_launching_op(tmp_path: Path) -> None:
    """No args, no External id: the nccl:* range around the launch call names it."""
    b = TraceBuilder(rank=0)
    b.step(1, 0, 200)
    b.cpu_op("nccl:reduce_scatter", 10, 20)
    b.kernel(
        "ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)", 40, 50, stream=20, launch_at=15
    )
    t = load_rank_trace(b.write(tmp_path / "t.json"))
    assert collectives_of(t).kind_name(0) == "reduce_scatter"


def test_kernel_args_carry_collective_sizes(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0)
    b.step(1, 0, 200)
    b.kernel(
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
        10,
        50,
        stream=40,
        launch_at=5,
        args={
            "Collective name": "allreduce",
            "In msg nelems": 100,
            "Out msg nelems": 100,
            "Group size": 2,
            "dtype": "Float",
            "Process Group Name": "0",
        },
    )
    t = load_rank_trace(b.write(tmp_path / "t.json"))
    c = collectives_of(t)
    assert (c.kind_name(0), int(c.bytes[0]), int(c.group_size[0]), c.process_group[0]) == (
        "all_reduce",
        400,
        2,
        "0",
    )


@pytest.mark.parametrize(
    ("cat", "name", "kind"),
    [
        ("kernel", "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", EventKind.COMM_KERNEL),
        (
            "kernel",
            "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
            EventKind.COMM_KERNEL,
        ),
        ("kernel", "void rccl_main_kernel<...>", EventKind.COMM_KERNEL),
        ("kernel", "void deep_ep::intranode::dispatch<8, 768>(...)", EventKind.COMM_KERNEL),
        ("kernel", "void deep_ep::internode_ll::combine<...>", EventKind.COMM_KERNEL),
        (
            "kernel",
            "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16>",
            EventKind.COMM_KERNEL,
        ),
        ("kernel", "void vllm::cross_device_reduce_1stage<...>", EventKind.COMM_KERNEL),
        ("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", EventKind.COMPUTE_KERNEL),
        ("kernel", "void at::native::reduce_kernel<512, 1>", EventKind.COMPUTE_KERNEL),
        ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", EventKind.MEMCPY),
        ("gpu_memset", "Memset (Device)", EventKind.MEMSET),
        ("gpu_user_annotation", "ProfilerStep#3", EventKind.GPU_ANNOTATION),
        ("cuda_runtime", "cudaLaunchKernel", EventKind.RUNTIME_LAUNCH),
        ("cuda_runtime", "hipExtModuleLaunchKernel", EventKind.RUNTIME_LAUNCH),
        ("cuda_driver", "cuLaunchKernelEx", EventKind.RUNTIME_LAUNCH),
        ("cuda_runtime", "cudaStreamSynchronize", EventKind.RUNTIME_OTHER),
        ("user_annotation", "ProfilerStep#12", EventKind.PROFILER_STEP),
        ("user_annotation", "gloo:all_reduce", EventKind.COMM_OP),
        ("cpu_op", "c10d::_allgather_base_", EventKind.COMM_OP),
        ("cpu_op", "record_param_comms", EventKind.COMM_OP),
        ("user_annotation", "FSDP::all_gather (layers.0)", EventKind.FSDP_ANNOTATION),
        ("user_annotation", "## forward ##", EventKind.USER_ANNOTATION),
        ("cpu_op", "aten::mm", EventKind.CPU_OP),
        # older Kineto spellings
        ("Kernel", "volta_sgemm_128x64_nn", EventKind.COMPUTE_KERNEL),
        ("Memcpy", "Memcpy HtoD (Pageable -> Device)", EventKind.MEMCPY),
        ("Memset", "Memset (Device)", EventKind.MEMSET),
        ("Runtime", "cudaLaunchKernel", EventKind.RUNTIME_LAUNCH),
        ("Operator", "aten::conv2d", EventKind.CPU_OP),
    ],
)
def test_classify(cat: str, name: str, kind: EventKind) -> None:
    assert classify(cat, name) == kind


@pytest.mark.parametrize(
    ("label", "kind"),
    [
        ("allreduce", "all_reduce"),
        ("_allgather_base", "all_gather"),
        ("_reduce_scatter_base", "reduce_scatter"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
        ("nccl:all_to_all", "all_to_all"),
        ("alltoall_base", "all_to_all"),
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "send_recv"),
        ("broadcast", "broadcast"),
        ("gloo:all_reduce", "all_reduce"),
        ("ncclDevKernel_Generic_4", "unknown"),
    ],
)
def test_collective_kind(label: str, kind: str) -> None:
    assert collective_kind(label) == kind


def test_rocm_is_detected(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0, gpu_name="AMD Instinct MI250X")
    b.step(1, 0, 100)
    b.kernel("Cijk_Alik_Bljk_SB_MT64x16x32", 10, 20, launch_at=5, launch_name="hipLaunchKernel")
    t = load_rank_trace(b.write(tmp_path / "t.json"))
    assert t.device == "rocm"
    assert len(t.of_kind(EventKind.RUNTIME_LAUNCH)) == 1


# --- memory timelines ----------------------------------------------------------------------


def test_memory_timeline_coalesced_format_in_a_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "traces").mkdir(parents=True)
    (run_dir / "memory").mkdir()
    _small(rank=0).write(run_dir / "traces" / "rank-0.json.gz")
    base = 1_000_000  # the synthetic trace's clock origin, in us
    sizes = [
        [0, 100, 0, 0, 0, 0, 0, 0, 0],
        [0, 100, 0, 0, 0, 700, 0, 0, 0],  # activations peak
        [0, 100, 0, 0, 0, 50, 200, 0, 0],
    ]
    data = json.dumps([[base + 10, base + 20, base + 30], sizes]).encode()
    (run_dir / "memory" / "rank-0.timeline.json.gz").write_bytes(gzip.compress(data))
    (run_dir / "memory" / "rank-0.oom.json").write_text("{}")

    report = analyze_paths([run_dir])
    (mem,) = report.memory
    assert mem.rank == 0 and mem.oom
    assert mem.peak_bytes == 800
    assert mem.peak_category_bytes == {"PARAMETER": 100, "ACTIVATION": 700}
    assert mem.bytes_by_category["GRADIENT"] == [0, 0, 200]
    assert mem.times_ms[0] == pytest.approx(0.01)  # 10 us after the trace's first event
    assert mem.capacity_bytes is None  # the synthetic GPU has no totalGlobalMem


def test_memory_timeline_raw_format_passed_explicitly(tmp_path: Path) -> None:
    trace = _small(rank=0).write(tmp_path / "trace.json")
    ns = 1_000_000_000  # raw times are ns on the trace clock
    raw = [
        [-1, 1, 100, 0],  # PREEXISTING parameter
        [ns + 10_000, 2, 300, 4],  # CREATE activation
        [ns + 20_000, 3, -300, 4],  # INCREMENT_VERSION: activation -> gradient
        [ns + 20_000, 3, 300, 5],
        [ns + 30_000, 4, 300, 5],  # DESTROY gradient
    ]
    mem_path = tmp_path / "memory_timeline.raw.gz"
    mem_path.write_bytes(gzip.compress(json.dumps(raw).encode()))

    report = analyze_paths([trace, mem_path])
    (mem,) = report.memory
    assert mem.peak_bytes == 400
    # the pre-existing allocation is placed at the first real time, like torch's own plot
    assert mem.bytes_by_category["ACTIVATION"] == [300, 0, 0]
    assert mem.bytes_by_category["GRADIENT"] == [0, 300, 0]
    assert mem.bytes_by_category["PARAMETER"] == [100, 100, 100]
    with pytest.raises(InputError, match="memory timeline, not a profiler trace"):
        load_run([mem_path])


def test_a_bad_memory_timeline_is_a_warning(tmp_path: Path) -> None:
    trace = _small(rank=0).write(tmp_path / "trace.json")
    bad = tmp_path / "rank-0.timeline.json"
    bad.write_text('{"not": "a timeline"}')

    report = analyze_paths([trace, bad])
    assert report.memory == []
    assert any("memory timeline skipped" in w for w in report.warnings)


def test_real_raw_memory_timeline(real_traces: Path) -> None:
    from zdiag.analyzers.inputs.memory_timeline import MAX_MEMORY_POINTS, load_memory_timeline

    mem = load_memory_timeline(real_traces / "hta" / "memory_timeline.raw.gz", 0)
    assert 0 < len(mem.times_ms) <= MAX_MEMORY_POINTS
    assert mem.peak_bytes == sum(mem.peak_category_bytes.values())
    assert all(min(v) >= 0 for v in mem.bytes_by_category.values())
    assert max(mem.bytes_by_category["ACTIVATION"]) > 0


def test_a_damaged_trace_among_several_is_named(tmp_path: Path) -> None:
    for r in (0, 1):
        _small(rank=r).write(tmp_path / f"rank-{r}.json.gz")
    assert [t.rank for t in load_run([tmp_path]).ranks] == [0, 1]
    (tmp_path / "rank-1.json.gz").write_bytes(b"\x1f\x8b broken")
    with pytest.raises(InputError, match=r"rank-1\.json\.gz"):
        analyze_paths([tmp_path])


def test_gloo_op_sizes_from_recorded_shapes(tmp_path: Path) -> None:
    b = TraceBuilder(rank=0, backend="gloo", gpu_name=None)
    b.step(1, 0, 100)
    b.cpu_op(
        "gloo:all_gather",
        10,
        20,
        tid=77,
        args={"Input Dims": [[32896], []], "Input type": ["float", "Scalar"]},
    )
    t = load_rank_trace(b.write(tmp_path / "t.json"))
    c = collectives_of(t)
    assert (c.kind_name(0), int(c.in_nelems[0]), int(c.bytes[0]), c.dtype[0]) == (
        "all_gather",
        32896,
        32896 * 4,
        "float",
    )


def test_memory_timeline_on_the_epoch_clock_is_aligned_with_base_time(tmp_path: Path) -> None:
    """The memory profiler stamps epoch time; Kineto ts = epoch - baseTimeNanoseconds."""
    b = _small(rank=0)
    base_ns = 1_790_000_000_000_000_000
    b.doc["baseTimeNanoseconds"] = base_ns
    trace = b.write(tmp_path / "rank-0.json")
    epoch_us = base_ns / 1000 + 1_000_000  # the synthetic trace's first event, on the epoch clock
    data = [[epoch_us + 50, epoch_us + 60], [[0, 10, 0, 0, 0, 0, 0, 0, 0]] * 2]
    mem_path = tmp_path / "rank-0.timeline.json"
    mem_path.write_text(json.dumps(data))

    (mem,) = analyze_paths([trace, mem_path]).memory
    assert mem.times_ms == [pytest.approx(0.05), pytest.approx(0.06)]
