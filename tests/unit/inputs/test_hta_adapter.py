"""The HTA adapter: a clear error without HTA, clear errors on bad input, no leaked HTA state."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from zdiag.analyzers.inputs import hta_adapter
from zdiag.analyzers.inputs.hta_adapter import HtaFailed, HtaUnavailable, hta_breakdown, import_hta
from zdiag.errors import InputError, UserError


def test_missing_hta_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hta", None)  # makes `import hta` raise ImportError
    with pytest.raises(HtaUnavailable) as err:
        import_hta()
    assert "pip install 'zdiag[hta]'" in str(err.value)
    assert isinstance(err.value, UserError)  # the CLI prints it as one line, no traceback
    with pytest.raises(HtaUnavailable):
        hta_breakdown([Path("whatever.json")])


def test_importing_the_adapter_does_not_import_hta() -> None:
    # the module is imported at the top of this file; hta must still be lazily imported
    src = Path(hta_adapter.__file__).read_text()
    top_level = [ln for ln in src.splitlines() if ln.startswith(("import hta", "from hta"))]
    assert top_level == []


@pytest.fixture
def hta_installed() -> None:
    pytest.importorskip("hta", reason="HTA is not installed (pip install 'zdiag[hta]')")


@pytest.mark.usefixtures("hta_installed")
def test_bad_arguments_are_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a folder"):
        hta_breakdown(tmp_path / "nope")
    with pytest.raises(InputError, match="no trace files"):
        hta_breakdown([])
    f = tmp_path / "a.json"
    f.write_text("{}")
    with pytest.raises(InputError, match="one distinct rank"):
        hta_breakdown([f, f], ranks=[0, 0])


@pytest.mark.usefixtures("hta_installed")
def test_hta_failure_names_the_trace_and_restores_hta_state(real_traces: Path) -> None:
    from hta.configs.env_options import HTAEnvOptions

    options = HTAEnvOptions.instance()
    before_rounding = options.disable_ns_rounding()
    before_level = logging.getLogger("hta").level
    src = real_traces / "hta" / "no_distributed_info.json.gz"
    with pytest.raises(HtaFailed) as err:
        hta_breakdown([src], ns_rounding=not before_rounding)
    assert str(src) in str(err.value)
    assert options.disable_ns_rounding() == before_rounding
    assert logging.getLogger("hta").level == before_level


@pytest.mark.usefixtures("hta_installed")
def test_two_ranks_from_files_and_from_folder_agree(real_traces: Path) -> None:
    folder = real_traces / "hta" / "sampled_128"
    by_files = hta_breakdown([folder / "rank-0.json.gz", folder / "rank-1.json.gz"])
    by_folder = hta_breakdown(folder)  # ranks from distributedInfo
    assert [b.rank for b in by_files] == [b.rank for b in by_folder] == [0, 1]
    assert by_files == by_folder
    for b in by_files:
        assert 0 < b.compute_us < b.kernel_time_us
        assert b.idle_us + b.compute_us + b.non_compute_us == pytest.approx(b.kernel_time_us)
        assert b.comm_comp_overlap_ratio is not None and 0 <= b.comm_comp_overlap_ratio <= 1
