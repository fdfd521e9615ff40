"""A Hugging Face ViT with hand-set FSDP2 prefetch lists (issue 30), on 2 gloo ranks with default
zdiag options (examples/library/vit_prefetch_lists.py):

- lists that name the layer itself (the off-by-one that turns prefetching off) get a finding that
  names that bug, and code that says which calls it replaces;
- the docs' explicit lists, on a CPU run without the unshard async op, are never told the run
  "already sets every FSDP2 overlap option": the finding proposes the async op, and no code
  re-proposes the layers' lists the run has."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO_ROOT
from support.processes import run as _run

pytestmark = pytest.mark.slow  # real processes (make integration)

SCRIPT = REPO_ROOT / "examples" / "library" / "vit_prefetch_lists.py"


def _findings(out: Path, lists: str) -> dict[str, dict[str, Any]]:
    pytest.importorskip("transformers", reason="the `dev` extra pins transformers")
    zdiag = (sys.executable, "-m", "zdiag")
    proc = _run(*zdiag, "run", "--nproc-per-node", "2", "--out", str(out), str(SCRIPT),
                "--lists", lists)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    proc = _run(*zdiag, "analyze", "--json", "--no-cache", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {f["id"]: f for f in json.loads(proc.stdout)["findings"]}


def test_lists_that_name_the_layer_itself_are_named_as_the_bug(tmp_path: Path) -> None:
    found = _findings(tmp_path / "run", "self")
    overlap = found["missing-overlap"]
    assert overlap["recommendation"].startswith("`blocks[i]` prefetches itself")
    code = overlap["code"]
    assert code.startswith("# replaces blocks[i].set_modules_to_forward_prefetch([blocks[i]])")
    assert "blocks = model.vit.layers" in code
    assert "blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])" in code


def test_explicit_lists_without_the_async_op_are_offered_it_and_nothing_they_have(
    tmp_path: Path,
) -> None:
    found = _findings(tmp_path / "run", "explicit")
    for f in found.values():
        assert "already sets every" not in f["recommendation"], f["id"]
        # the chain the run sets is not proposed again (the root's own list, which it lacks, may be)
        assert "blocks[i].set_modules_to" not in (f["code"] or ""), (f["id"], f["code"])
    offers = [f for f in found.values() if "_set_unshard_async_op(True)" in (f["code"] or "")]
    assert offers, sorted(found)
