"""The built wheel adds exactly one top-level name, `zdiag`, and each subpackage imports from it."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(REPO_ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("zdiag-*.whl")
    return whl


def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names}
    dist_info = {r for r in roots if r.endswith(".dist-info")}
    assert roots - dist_info == {"zdiag"}, roots
    for sub in ("collectors", "analyzers", "tui", "commands", "live"):
        assert f"zdiag/{sub}/__init__.py" in names
    assert not any(n.startswith(("tests/", "bench/", "sample_traces/")) for n in names)


@pytest.mark.slow  # starts a program
def test_wheel_installs_and_imports_in_fresh_env(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Install the wheel alone into the fresh env; its dependencies come from this test's env,
    # appended *after* the fresh site-packages so the editable checkout is never picked up.
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    deps = sysconfig.get_paths()["purelib"]
    code = (
        f"import sys; sys.path.append({deps!r});"
        "import zdiag, zdiag.collectors, zdiag.analyzers, zdiag.tui, zdiag.cli, zdiag.analyzers.report;"
        f"assert zdiag.__file__.startswith({site!r}), zdiag.__file__;"
        f"assert zdiag.analyzers.__file__.startswith({site!r}), zdiag.analyzers.__file__;"
        "print(zdiag.__version__)"
    )
    res = subprocess.run([str(py), "-I", "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
