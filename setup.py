"""Maps the owner's top-level folders onto one installed namespace, `zdiag`.

pyproject.toml cannot compute a package list for a package-dir mapping, so this file does:
`collectors/` installs as `zdiag.collectors`, `analyzers/` as `zdiag.analyzers`, `tui/` as
`zdiag.tui`, and the wheel adds the single top-level name `zdiag` to site-packages.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "zdiag": "zdiag",
    "zdiag.collectors": "collectors",
    "zdiag.analyzers": "analyzers",
    "zdiag.tui": "tui",
}


def _packages() -> list[str]:
    packages = []
    for prefix, folder in PACKAGE_DIRS.items():
        packages.append(prefix)
        packages.extend(f"{prefix}.{sub}" for sub in find_packages(folder))
    return sorted(set(packages))


setup(packages=_packages(), package_dir=PACKAGE_DIRS)
