"""Where rendered output goes, with one rule set for every output of every command: the one
place that writes what the renderers make (`write_rendered`).

- An output never overwrites an input of the same command: `check_outputs` refuses, before any
  work, a target that is an input file or any existing file inside an input folder (compared by
  resolved path and by inode, so a symlink or a hard link to `manifest.json` is caught too), and
  two outputs aimed at the same file.
- A regular file (or a new name) is written atomically: a temporary file beside it, then a rename
  (`zdiag.collectors.fsio.write_atomically`, the one atomic writer of the project), so a reader
  never sees half a report and a failure leaves the old file as it was.
- A symlink is followed: the file it points to is written (atomically), the link stays a link.
- A character device (`/dev/null`, a terminal) or a FIFO is written through (opened and written),
  never replaced by a regular file. Block devices, sockets and folders are refused.
- Standard output and files report a full disk (or any other write error) as one sentence
  (`UserError`, exit 2).
- Files a renderer names beyond the one it was given (Perfetto's `{rank}` file per rank) obey
  the same refusal: they are checked against the inputs before the first one is written.
- Each file written is named on stderr (`zdiag: wrote the HTML report to FILE`), then the
  renderer's notes.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zdiag.collectors.fsio import write_atomically
from zdiag.errors import ConfigError, UserError
from zdiag.render.renderer import Destination, OutputFormat, Rendered

MAX_INPUT_FILES_COMPARED = 200_000
"""Files of an input folder whose inodes are compared with an existing output (a bound on the walk)."""


@dataclass(frozen=True)
class OutputTarget:
    """One output file of a command: the option that named it and its path."""

    option: str  # "--output", "--html", "--perfetto"
    path: Path


def _remedy(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "free some space or write elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "choose a writable place"
    return "check the path"


def _write_error(where: str, exc: OSError) -> UserError:
    reason = exc.strerror or type(exc).__name__
    return UserError(f"cannot write {where} ({reason.lower()}); {_remedy(exc)}.")


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _is_within(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # different drives
        return False


def _input_files(folder: Path) -> Iterable[os.stat_result]:
    """stat results of the regular files under `folder` (links not followed), at most a bound."""
    seen = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            seen += 1
            if seen > MAX_INPUT_FILES_COMPARED:
                return
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield st


def _check_kind(option: str, path: Path) -> None:
    """Refuse targets that are folders, block devices or sockets; check a new file's folder."""
    try:
        st = os.stat(path)  # follows a symlink: the node that would be written
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {exc.strerror}; choose another path.") from exc
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{option} {path}: is a folder; give a file name.")
        if stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            kind = "a block device" if stat.S_ISBLK(st.st_mode) else "a socket"
            raise ConfigError(f"{option} {path}: is {kind}; write the report to a file.")
        if not stat.S_ISREG(st.st_mode):
            return  # a character device or a FIFO: written through, the folder does not matter
    real = Path(os.path.realpath(path))
    folder = real.parent
    if not folder.is_dir():
        raise ConfigError(
            f"{option} {path}: the folder {path.parent} does not exist; create it first."
        )
    if not os.access(folder, os.W_OK):
        raise ConfigError(
            f"{option} {path}: the folder {path.parent} is not writable; choose another."
        )


def check_outputs(targets: Sequence[OutputTarget], inputs: Sequence[Path]) -> None:
    """Refuse, before any work, outputs that would overwrite an input or each other, or that
    cannot be written there. Raises ConfigError (one sentence, exit 2); writes nothing."""
    resolved_inputs = [(p, os.path.realpath(p)) for p in inputs]
    claimed: dict[str, str] = {}
    for target in targets:
        option, path = target.option, Path(target.path)
        _check_kind(option, path)
        real = os.path.realpath(path)
        if real in claimed:
            raise ConfigError(
                f"{option} {path}: {claimed[real]} writes the same file; give each output its own."
            )
        claimed[real] = option
        try:
            target_st: os.stat_result | None = os.stat(path)
        except OSError:
            target_st = None
        if target_st is not None and not stat.S_ISREG(target_st.st_mode):
            continue  # a device or FIFO is never an input trace
        for given, real_input in resolved_inputs:
            refusal = (
                f"{option} {path}: is an input of this command ({given}); "
                "write the output to another file."
            )
            if os.path.isdir(real_input):
                if target_st is None:
                    continue  # a new file inside an input folder reads nothing
                if _is_within(real, real_input) or any(
                    _identity(st) == _identity(target_st) for st in _input_files(Path(real_input))
                ):
                    raise ConfigError(refusal)
            elif real == real_input:
                raise ConfigError(refusal)
            elif target_st is not None:
                try:
                    same = _identity(os.stat(real_input)) == _identity(target_st)
                except OSError:
                    same = False
                if same:
                    raise ConfigError(refusal)


def _write_through(path: Path, data: bytes) -> None:
    """Open `path` (a character device or FIFO) and write `data` into it, no rename."""
    try:
        with open(path, "wb", buffering=0) as out:
            view = memoryview(data)
            while view:
                written = out.write(view)
                view = view[written or len(view) :]
    except OSError as exc:
        raise _write_error(str(path), exc) from exc


def write_output(path: Path, data: bytes) -> None:
    """Write `data` to `path` under the rules of the module docstring (atomic for files, written
    through for devices and FIFOs, symlinks followed). Raises UserError with one sentence."""
    path = Path(path)
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _write_error(str(path), exc) from exc
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        _write_through(path, data)
        return
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"cannot write {path}: it is not a regular file; choose a file name.")
    real = Path(os.path.realpath(path))  # a symlink stays a link: its target is replaced
    if not real.parent.is_dir():
        raise UserError(
            f"cannot write {path}: the folder {path.parent} does not exist; create it first."
        )

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(data)

    try:
        write_atomically(real, write)
    except OSError as exc:
        raise _write_error(str(path), exc) from exc


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so that the interpreter's last flush of stdout cannot fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def write_stdout(data: bytes) -> None:
    """Write `data` to standard output; a write error (a full disk) is one sentence, exit 2.

    A closed pipe (`| head`) re-raises BrokenPipeError, which the CLI treats as a normal end."""
    try:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        raise
    except OSError as exc:
        _silence_stdout()
        raise _write_error("to standard output", exc) from exc


def write_rendered(
    rendered: Rendered, destination: Destination, fmt: OutputFormat, inputs: Sequence[Path] = ()
) -> None:
    """Write what a renderer of `fmt` made for `destination` (`check_outputs` has passed it),
    then name the file on stderr (`fmt.wrote`) and print the renderer's notes.

    Files the renderer named beside `destination` are refused first when they would overwrite
    one of `inputs` (or cannot be written), before anything is written."""
    option = "--output" if fmt.kind == "stream" else fmt.flag
    extra = [p for p in rendered.paths if p is not None and p != destination.path]
    if extra:
        check_outputs([OutputTarget(option, p) for p in extra], inputs)
    for output in rendered.outputs:
        if output.path not in rendered.paths:
            raise RuntimeError(
                f"the {fmt.name} renderer wrote {output.path}, which it did not name"
            )
        if output.path is None:
            write_stdout(output.data)
        else:
            write_output(output.path, output.data)
    if fmt.wrote and destination.path is not None:
        print(f"zdiag: wrote {fmt.wrote} to {destination.path}", file=sys.stderr)
    for note in rendered.notes:
        print(f"zdiag: note: {note}", file=sys.stderr)


def deliver(render: Callable[[int], bytes], output: Path | None, what: str) -> None:
    """A command's main output: `render(width)` to `output` (at DEFAULT_WIDTH, then one line on
    stderr naming the file) or to stdout (at the terminal's width)."""
    from zdiag.render.terminal import DEFAULT_WIDTH, terminal_width

    if output is not None:
        write_output(output, render(DEFAULT_WIDTH))
        print(f"zdiag: wrote {what} to {output}", file=sys.stderr)
    else:
        write_stdout(render(terminal_width(sys.stdout)))
