"""Library models under zdiag (issue 30): a Hugging Face Llama wrapped per `nn.Linear`
(examples/library/llama_per_linear.py) on 2 gloo ranks. The wrap judgement must be the same
every run: each decoder layer split into 7 units whose collectives are latency-bound
(`tiny-layer-wrap`, decided: its bootstrap confidence at least DECIDE_SHARE), which explains the
exposed gathers (`missing-overlap` folded into it); no code names a module that is not an FSDP
unit in a prefetch list, and the words name the blocks the way the code reaches them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import site
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.processes import run as _run

pytestmark = pytest.mark.slow  # real processes (make integration)

SCRIPT = REPO_ROOT / "examples" / "library" / "llama_per_linear.py"
POSITIONS = REPO_ROOT / "examples" / "library" / "llama_position_ids.py"


def _transformers_path() -> list[str]:
    """The folder transformers is imported from when it is not the interpreter's own
    site-packages (a local install beside the venv): the run's processes need it too."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed (the `dev` extra pins it)")
    where = str(Path(spec.origin).parents[1])
    return [] if where in site.getsitepackages() else [where]


def _findings(out: Path, script: Path = SCRIPT, *flags: str) -> dict[str, dict[str, Any]]:
    extra = _transformers_path()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *extra])} if extra else {}
    zdiag = (sys.executable, "-m", "zdiag")
    args = ("run", *flags, "--nproc-per-node", "2", "--out", str(out), str(script))
    proc = _run(*zdiag, *args, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    proc = _run(*zdiag, "analyze", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {f["id"]: f for f in json.loads(proc.stdout)["findings"]}


def test_per_linear_llama_is_judged_tiny_layer_wrap(tmp_path: Path) -> None:
    found = _findings(tmp_path / "run")
    wrap = found["tiny-layer-wrap"]
    ev = wrap["evidence"]
    assert (wrap["severity"], ev["judgement"]) == ("warning", "latency-bound")
    assert ev["latency_bound_confidence"] >= ev["threshold_decide_share"]
    assert ev["units_per_block"] == 7 and ev["fit_sizes"] == 2
    assert ev["median_message_bytes"] < ev["flat_bandwidth_bytes_range"][0]
    assert "missing-overlap" not in found and "missing-overlap" in ev["explains"]
    assert "for block in model.model.layers:\n    fully_shard(block)" in wrap["code"]
    # one spelling, the one the user's `model` reaches, in the words and the code
    assert "model.model.layers[N] (LlamaDecoderLayer x4)" in wrap["title"]
    assert "model.layers.N" not in wrap["recommendation"] + wrap["code"]
    assert "model.model.layers[0].self_attn" in wrap["code"]  # the units it replaces
    for f in found.values():  # prefetch lists name blocks, never a Linear
        for call in re.findall(r"set_modules_to_\w+_prefetch\(\[([^\]]*)\]", f["code"] or ""):
            assert "_proj" not in call and "lm_head" not in call, (f["id"], call)


def test_a_host_sync_in_transformers_own_code_is_the_librarys(tmp_path: Path) -> None:
    """Packed-sequence style training (position_ids, no mask, no cache) makes transformers check
    each batch for packed sequences on the host, once per forward: the finding names the library
    and its line, says the user's code does not hold it, and proposes no code."""
    found = _findings(tmp_path / "run", POSITIONS, "--with-stack")
    sync = found["host-sync"]
    assert sync["title"].startswith("Host syncs in the transformers library's code")
    assert "not in yours" in sync["recommendation"]
    assert "masking_utils.py" in sync["recommendation"]
    assert "find_packed_sequence_indices" in sync["recommendation"]
    assert sync["code"] is None
    lines = sync["evidence"]["library_lines"]
    assert all(line.startswith("transformers: ") for line in lines), lines
