"""Traces in object storage (or any fsspec filesystem): `s3://bucket/job/`, `gs://...`, ...

`is_url(text)` tells such an input from a local path (a `scheme://` prefix other than
`file://`). `list_remote_traces(url)` lists the trace files under a URL (the URL itself when it
names a file; trace names as for local folders). `fetched(url)` copies one trace to a temporary
local file of the same name (the loader memory-maps or streams local files only) and removes it
afterwards: the map runs where the task runs, e.g. on a Ray worker, so only the summary travels
back to the driver. fsspec (and the filesystem's own package, e.g. s3fs) must be installed where
the map runs; stored summaries (in-job, cache) are not used for remote traces.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from zdiag.errors import ConfigError, InputError

from .loader import is_trace_name
from .reader import Reader

COPY_CHUNK_BYTES = 8 * 1024 * 1024


def is_url(text: str | Path) -> bool:
    """A `scheme://` input other than `file://` (read through fsspec)."""
    s = str(text)
    return "://" in s and not s.startswith("file://")


def _fsspec() -> Any:
    try:
        return importlib.import_module("fsspec")
    except ImportError:
        raise ConfigError(
            "reading traces from a URL needs fsspec (and the filesystem's package, e.g. s3fs): "
            "pip install fsspec."
        ) from None


def _filesystem(fsspec: Any, url: str) -> tuple[Any, str]:
    """fsspec's filesystem for `url`; ConfigError when its package is missing (e.g. s3fs)."""
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise ConfigError(f"{url}: reading it needs another package ({exc}).") from None
    return fs, root


def list_remote_traces(url: str) -> list[str]:
    """The trace URLs under `url` (sorted); InputError when there is none or it cannot be read."""
    fsspec = _fsspec()
    try:
        fs, root = _filesystem(fsspec, url)
        if fs.isfile(root):
            return [url]
        found = [p for p in fs.find(root) if is_trace_name(PurePosixPath(p).name)]
    except (OSError, ValueError) as exc:
        raise InputError(
            f"{url}: cannot be listed ({exc}); check the URL and credentials."
        ) from None
    if not found:
        raise InputError(f"{url}: holds no trace files (*.json or *.json.gz).")
    protocol = url.split("://", 1)[0]
    return sorted(
        f"{protocol}://{p.lstrip('/')}" if protocol != "memory" else f"memory://{p}" for p in found
    )


@contextmanager
def fetched(url: str) -> Iterator[Path]:
    """A local copy of the trace at `url` under its own file name, removed afterwards."""
    fsspec = _fsspec()
    with tempfile.TemporaryDirectory(prefix="zdiag-fetch-") as tmp:
        local = Path(tmp) / PurePosixPath(url.split("://", 1)[1]).name
        fs, root = _filesystem(fsspec, url)
        try:
            with fs.open(root, "rb") as src, local.open("wb") as dst:
                shutil.copyfileobj(src, dst, COPY_CHUNK_BYTES)
        except (OSError, ValueError) as exc:
            raise InputError(
                f"{url}: cannot be read ({exc}); check the URL and credentials."
            ) from None
        yield local


READER = Reader(
    name="remote",
    kind="remote",
    what="a trace behind a URL (s3://, gs://, ... through fsspec), copied to a local file",
    sniff=lambda path, head: is_url(path),
    read=fetched,
)
