"""Plain pickles, read with bounds: no class or function loads, under a memory budget and a
time limit, optionally in a forked child process.

Used for CUDA memory snapshots (`cuda_snapshot.py`) and flight-recorder dumps. The unpickler
accepts plain containers only (dict, list, str, int, float, bool, None): a file that names any
class or function is refused, so a crafted pickle can not run code. torch is never imported.

- **Memory.** `load_plain_pickle` reads only a regular file within the size cap of `safe_read`
  and loads it under a memory budget, `memory_budget(size)`: PICKLE_MEMORY_BASE_BYTES +
  PICKLE_MEMORY_PER_BYTE x the file's size, never more than PICKLE_MEMORY_MAX_BYTES nor
  PICKLE_MEMORY_MAX_SHARE of the machine's memory (a 10-byte pickle can otherwise ask the
  unpickler for gigabytes of memo table).
- **Time.** `run_isolated` reads (and analyzes) a file in a forked child process under the
  memory budget, killed after MAX_SNAPSHOT_SECONDS: work inside the C unpickler (hashing a
  tuple that nests itself 2**40 times, as a 200-byte pickle can ask) cannot be interrupted
  in-process. Without fork (not Linux, or other threads running) the work runs in this process
  and the unpickler checks PICKLE_LOAD_SECONDS between input chunks.

Any bound exceeded is an InputError (one sentence).
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import resource
import select
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from zdiag.errors import InputError

from .decode_batches import fork_available
from .safe_read import current_limits, open_regular, read_capped

T = TypeVar("T")

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
MAX_SNAPSHOT_SECONDS = 60.0
"""Wall time to read and analyze one snapshot (`run_isolated` kills the work after it; a
100 MB snapshot takes ~4 s)."""
_RESULT_MAX_BYTES = 1 << 30  # what a child process may send back (a summary, not the data)


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
            with _memory_budget(memory_budget(self._input_bytes)):
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
def _memory_budget(extra_bytes: int) -> Iterator[None]:
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


def load_plain_pickle(path: str | Path, what: str, root: Path | None = None) -> Any:
    """The plain data (dict, list, str, bytes, numbers, None) pickled in `path`, read with
    bounds: a regular file (inside `root`, when given) within `safe_read`'s size cap, no class or
    function (refused: nothing runs), a memory budget and PICKLE_LOAD_SECONDS while loading.

    The loaded object may still share containers (pickle's memo): walk it visiting each
    container once (see `cuda_snapshot.SnapshotReader`). InputError, one sentence naming `what`, otherwise.
    """
    p = Path(path)
    with open_regular(p, what, root) as f:
        data = read_capped(f, p, what, current_limits().max_bytes)
    try:
        return PlainUnpickler(io.BytesIO(data)).load()
    except (PickleMemoryError, PickleTimeError) as exc:
        raise InputError(f"{p}: the {what} was not loaded: {exc}.") from None
    except RecursionError:
        raise InputError(
            f"{p}: the {what} is nested too deep to read; it was not loaded."
        ) from None
    except Exception as exc:  # truncated, corrupt, or names a class: all the same to the user
        raise InputError(
            f"{p}: not a readable {what} ({type(exc).__name__}: {str(exc)[:100]}); "
            "re-create it or remove the file."
        ) from None


def run_isolated(fn: Callable[..., T], *args: Any, path: Path, what: str) -> T:
    """`fn(*args)` in a forked child process, its result sent back pickled: the child may grow
    by `memory_budget(size of path)` and is killed after MAX_SNAPSHOT_SECONDS, whatever it is
    doing (InputError, naming `path` and `what`, when it is). An InputError in the child is
    raised here; any other exception is a RuntimeError (a bug, not the input's fault). Without
    fork, `fn(*args)` runs here (the unpickler's own bounds still apply)."""
    if not fork_available():
        return fn(*args)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # the child's open says why
    budget = memory_budget(size)
    seconds = MAX_SNAPSHOT_SECONDS
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        _child(fn, args, w, r, budget)
    os.close(w)
    try:
        payload, code = _collect(r, pid, seconds, path, what)
    finally:
        os.close(r)
    try:
        status, value = pickle.loads(payload)
    except Exception:  # no result: killed (the kernel's out-of-memory killer) or crashed
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        status, value = "died", f"the process reading it stopped without a result ({how})"
    if status == "ok":
        return value
    if status == "input":
        raise InputError(value)
    if status == "memory":
        raise InputError(
            f"{path}: the {what} was not read: it needs more than the {budget >> 20} MiB of "
            f"memory its {size} bytes may take (a damaged or hostile file; if it is genuine, "
            "--max-trace-gb lifts the fixed cap)."
        )
    if status == "died":
        raise InputError(f"{path}: the {what} was not read: {value}.")
    raise RuntimeError(f"reading {path} failed: {value}")


def _child(fn: Callable[..., Any], args: tuple[Any, ...], w: int, r: int, budget: int) -> None:
    """The forked child: run `fn` under the memory budget, send (status, value), exit. The
    objects it inherited are frozen out of the cyclic garbage collector: a collection that
    the load triggers walks only what the child made, not the parent's whole heap (whose
    extension objects need not survive a fork; a pytest worker's child once died of a
    segfault while collecting during a load)."""
    code = 0
    try:
        gc.freeze()
        os.close(r)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            with _memory_budget(budget):
                out: tuple[str, Any] = ("ok", fn(*args))
        except InputError as exc:
            out = ("input", exc.message)
        except MemoryError:
            out = ("memory", "")
        except RecursionError:
            out = ("died", "it is nested too deep to read")
        except BaseException as exc:  # a bug: the parent reports it as one
            out = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            payload = pickle.dumps(("error", f"result not picklable: {exc}"))
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _collect(r: int, pid: int, seconds: float, path: Path, what: str) -> tuple[bytes, int]:
    """The child's whole output and its exit code (negative: the signal that ended it); kills
    it once `seconds` have passed (InputError then)."""
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    got = 0
    done = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InputError(
                    f"{path}: the {what} was not read: it takes longer than the "
                    f"{seconds:g} s a snapshot may take (a damaged or hostile file)."
                )
            ready, _, _ = select.select([r], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            got += len(chunk)
            if got > _RESULT_MAX_BYTES:
                raise InputError(f"{path}: the {what} gives a result too large to keep.")
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        done = True
    finally:
        if not done:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return b"".join(chunks), os.waitstatus_to_exitcode(status)
