"""Communication by mesh dimension on a real FSDP2 + tensor-parallel run: examples/mesh/fsdp_tp.py
on 4 gloo ranks under `zdiag run --nproc-per-node 4`, default options. The report attributes the
TP all-reduces to the "tp" dimension and FSDP's all-gathers and reduce-scatters (all-reduces on
gloo) to "dp", with the roles the captured mesh gives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.processes import zdiag

pytestmark = [pytest.mark.slow, pytest.mark.dist]

TP_CALLS_PER_STEP = 8  # 4 stages: the rowwise output's all-reduce forward, colwise input's backward


def test_fsdp_tp_communication_is_split_into_dp_and_tp(tmp_path: Path) -> None:
    run = zdiag("run", "--nproc-per-node", "4", "--out", str(tmp_path), "examples/mesh/fsdp_tp.py")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    proc = zdiag("analyze", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)

    dims = {d["name"]: d for d in report["comm_dimensions"]}
    dp, tp = dims["dp"], dims["tp"]
    assert (dp["role"], dp["role_source"], dp["group_size"]) == ("dp-shard", "mesh", 2)
    assert (tp["role"], tp["role_source"], tp["group_size"]) == ("tp", "mesh", 2)
    assert tp["kinds"] == ["all_reduce"]
    assert "all_gather" in dp["kinds"]  # FSDP's gathers; its reduce-scatters are gloo all-reduces
    assert dp["ranks"] == tp["ranks"] == [0, 1, 2, 3]

    for rank in report["ranks"]:
        assert rank["steps"]
        for step in rank["steps"]:
            split = {d["dimension"]: d for d in step["comm_by_dimension"]}
            assert split["tp"]["calls"] == TP_CALLS_PER_STEP
            assert split["dp"]["calls"] > 0 and split["dp"]["comm_ms"] > 0
            assert split["tp"]["comm_ms"] > 0
            assert sum(d["comm_ms"] for d in split.values()) == pytest.approx(
                step["comm_ms"], abs=1e-4
            )
            assert sum(d["exposed_comm_ms"] for d in split.values()) == pytest.approx(
                step["exposed_comm_ms"], abs=1e-4
            )

    text = zdiag("analyze", str(tmp_path))
    assert "Communication by mesh dimension (mean per step)" in text.stdout
