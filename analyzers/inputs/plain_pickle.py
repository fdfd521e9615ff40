"""Loading plain pickles with bounds: no class or function, a memory budget, a time limit.

`PlainUnpickler` accepts only the pickle protocol's own containers and scalars (dict, list,
tuple, str, bytes, numbers, None): a file that names any class or function is refused, so a
crafted pickle cannot run code. Its `load` runs under an address-space budget,
`memory_budget(size)` (a 10-byte pickle can otherwise ask for gigabytes of memo table), and,
for in-memory input, stops after PICKLE_LOAD_SECONDS. CUDA memory snapshots
(analyzers/memory/memory_snapshot.py) and flight-recorder dumps (flight_dumps.py) are read
with it.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from .safe_read import current_limits

PICKLE_MEMORY_BASE_BYTES = 256 << 20
PICKLE_MEMORY_PER_BYTE = 16
"""While a snapshot loads (and, in `run_isolated`, is analyzed), the process may grow by at most
BASE + PER_BYTE x its pickle's size (Linux: an address-space limit). Measured: a loaded snapshot
takes 7x its pickle's size with stacks and 10.6x without (small event dicts), so 16 leaves
room for the analysis; hostile pickles that ask for more stop at the budget."""
PICKLE_MEMORY_MAX_BYTES = 8 << 30
"""... and never more than this (8 GiB), whatever the size ..."""
PICKLE_MEMORY_MAX_SHARE = 0.5
"""... nor more than this share of the machine's physical memory. `--max-trace-gb` (the user
vouches for the input) lifts both caps; the per-byte budget stays."""
PICKLE_LOAD_SECONDS = 60.0
"""An in-process load stops after this long (checked each time the unpickler asks for more
input, every 64 KiB frame of a pickle protocol 4 file)."""


class PlainUnpickler(pickle.Unpickler):
    """Refuses every global: only the pickle protocol's own containers and scalars load.

    `load` runs under the memory budget of `memory_budget` (a memo bomb raises MemoryError
    instead of taking gigabytes) for an in-memory `io.BytesIO` input or a real file, and, for an
    in-memory input, stops after `seconds` (default PICKLE_LOAD_SECONDS; None: no limit),
    checked each time the unpickler asks for more input. The flight-recorder reader uses this
    class too.
    """

    def __init__(self, file: BinaryIO, *, seconds: float | None = PICKLE_LOAD_SECONDS) -> None:
        self._input_bytes = _input_size(file)
        if type(file) is io.BytesIO:  # the same bytes, read through the clock
            timed = _TimedInput(file.getvalue(), seconds)
            timed.seek(file.tell())
            file = timed
        super().__init__(file)

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def load(self) -> Any:
        """The unpickled object (`PickleMemoryError` beyond the budget, `PickleTimeError`
        beyond the time)."""
        try:
            with address_space_budget(memory_budget(self._input_bytes)):
                return super().load()
        except MemoryError:
            raise PickleMemoryError(
                f"it asks for more memory than its {self._input_bytes} bytes can hold "
                f"(over {memory_budget(self._input_bytes) >> 20} MiB: a damaged or hostile "
                "pickle)"
            ) from None


class PickleMemoryError(pickle.UnpicklingError):
    """A pickle that asks for more memory than its size allows (a memo bomb)."""


class PickleTimeError(Exception):
    """A pickle that takes longer to load than the time allowed. (Not an UnpicklingError: the
    C unpickler turns one raised while it reads an opcode into EOFError "Ran out of input".)"""


class _TimedInput(io.BytesIO):
    """In-memory pickle input that raises PickleTimeError once its deadline has passed, checked
    whenever the unpickler reads (it prefetches through `peek`, so every 64 KiB or so)."""

    def __init__(self, data: bytes, seconds: float | None) -> None:
        super().__init__(data)
        self._seconds = seconds
        self._deadline = None if seconds is None else time.monotonic() + seconds

    def _check(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise PickleTimeError(f"it took longer than {self._seconds:g} s to load")

    def read(self, size: int | None = -1, /) -> bytes:
        self._check()
        return super().read(size)

    def readinto(self, buffer: Any, /) -> int:
        self._check()
        return super().readinto(buffer)

    def readline(self, size: int | None = -1, /) -> bytes:
        self._check()
        return super().readline(size)

    def peek(self, size: int = 0, /) -> bytes:
        """The next `size` bytes, not consumed (lets the unpickler read ahead in chunks)."""
        self._check()
        data = super().read(size)
        self.seek(-len(data), io.SEEK_CUR)
        return data


def _input_size(file: BinaryIO) -> int:
    """Bytes in an unpickler's input: a BytesIO's buffer, else the file's size (0 if unknown)."""
    if isinstance(file, io.BytesIO):
        return file.getbuffer().nbytes
    try:
        return os.fstat(file.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        return 0


def memory_budget(input_bytes: int) -> int:
    """Bytes a process may grow by to load (and analyze) a pickle of `input_bytes`:
    PICKLE_MEMORY_BASE_BYTES + PICKLE_MEMORY_PER_BYTE x its size, capped at
    PICKLE_MEMORY_MAX_BYTES and PICKLE_MEMORY_MAX_SHARE of physical memory unless the user
    vouched for the input (`--max-trace-gb`)."""
    budget = PICKLE_MEMORY_BASE_BYTES + PICKLE_MEMORY_PER_BYTE * max(0, input_bytes)
    if current_limits().max_gzip_ratio is None:  # limits set by the user: they vouch for it
        return budget
    cap = PICKLE_MEMORY_MAX_BYTES
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if physical > 0:
            cap = min(cap, int(physical * PICKLE_MEMORY_MAX_SHARE))
    except (OSError, ValueError, AttributeError):
        pass
    return min(budget, cap)


@contextmanager
def address_space_budget(extra_bytes: int) -> Iterator[None]:
    """Let the process grow by at most `extra_bytes` of address space inside the block (Linux;
    a no-op where the limit cannot be read or set). Allocations past it raise MemoryError."""
    try:
        with open("/proc/self/statm") as f:
            vm_bytes = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError, IndexError, AttributeError):
        yield
        return
    soft = vm_bytes + extra_bytes
    if old[1] != resource.RLIM_INFINITY:
        soft = min(soft, old[1])
    if old[0] != resource.RLIM_INFINITY and old[0] <= soft:
        yield  # an existing, tighter limit stays
        return
    resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)
