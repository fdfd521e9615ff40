"""torchrun's failure summary names the user's script (zdiag/commands/torchrun_launch.py)."""

from __future__ import annotations

from zdiag.commands.torchrun_launch import BOOTSTRAP_MODULE, _named, target_name


def test_the_bootstraps_target_is_the_name() -> None:
    assert target_name(["-u", "-m", BOOTSTRAP_MODULE, "train.py", "--lr", "1"]) == "train.py"
    assert target_name(["-m", BOOTSTRAP_MODULE, "-m", "pkg.train", "x"]) == "pkg.train"
    assert target_name(["-m", "other.module", "train.py"]) is None
    assert target_name(["-m", BOOTSTRAP_MODULE]) is None


def test_torchruns_own_name_otherwise() -> None:
    named = _named(lambda entrypoint, args: f"torchrun's {entrypoint}")
    assert named("python", ["-m", BOOTSTRAP_MODULE, "train.py"]) == "train.py"
    assert named("python", ["-m", "other.module"]) == "torchrun's python"
