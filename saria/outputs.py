"""Output files of the ``saria`` commands: checked before the work starts, written whole or not at all.

A command that writes results (``--json``, ``--csv``, ``--plot``, ``saria synth OUT``) calls
:func:`check_output` for each path before it does any work, so a typo in a folder name costs a
second, not a replay's results. :func:`atomic_output` then writes into a temporary file beside
the target and renames it over the target only once everything is written and flushed: a reader
sees the old file or the complete new one, never half of it, and a failed write leaves nothing
behind. A path that exists and is not a regular file cannot be replaced by a rename: a named pipe,
``/dev/null`` and the process's own streams (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``) are
written in place; any other device (``/dev/full``, a disk) is refused, since whether it takes the
bytes can only be learnt by writing them, after the work.

Problems are :class:`OutputError` (a ``ValueError``): the command reports one line naming the
option and the path, and exits with status 2.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterator

__all__ = ["OutputError", "atomic_output", "check_output", "is_stream", "same_file_check", "write_output"]


class OutputError(ValueError):
    """An output path that cannot be written, named with the option that gave it."""


def _label(path: Path, flag: str | None) -> str:
    return f"{flag} {path}" if flag else str(path)


def _mode(path: Path) -> int | None:
    """``st_mode`` of ``path`` (following links), or None if nothing is there."""
    try:
        return os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file where a folder should be
        return None


def check_output(path: str | os.PathLike, flag: str | None = None, *, probe: bool = True) -> Path:
    """``path`` as a :class:`Path` if it can be written, else :class:`OutputError` saying why.

    The folder must exist and be a folder, the path must not be a folder, and (``probe``) the
    folder must take a new file (tried for real, with a temporary file removed at once:
    permission bits do not tell about read-only mounts, and root ignores them). A pipe, /dev/null
    or one of this process's own streams must be writable by it; other devices are refused."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise OutputError(f"{flag or 'output'}: an output path must not be empty")
    if "\0" in text:
        raise OutputError(f"{flag or 'output'}: the path {text!r} contains a NUL character")
    path = Path(text)
    what = _label(path, flag)
    try:
        mode = _mode(path)
        if mode is not None and stat.S_ISDIR(mode):
            raise OutputError(f"{what}: is a folder, not a file")
        if _in_place(text, mode):
            if not (stat.S_ISFIFO(mode) or is_stream(text)):
                raise OutputError(f"{what}: is a device, not a file (results go to files, pipes, /dev/null or "
                                  f"/dev/stdout)")
            if not os.access(path, os.W_OK):
                raise OutputError(f"{what}: not writable")
            return path
        folder = path.parent
        folder_mode = _mode(folder)
        if folder_mode is None:
            raise OutputError(f"{what}: the folder {folder} does not exist")
        if not stat.S_ISDIR(folder_mode):
            raise OutputError(f"{what}: {folder} is not a folder")
        if probe:
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        raise OutputError(f"{what}: cannot write there ({exc.strerror or exc})") from None
    return path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, flag: str | None = None, *, mode: str = "w",
                  newline: str | None = None) -> Iterator[IO]:
    """A file to write ``path``'s new contents to; it replaces ``path`` when the block ends
    without an exception (flushed and synced first), and is removed if it raises. Errors while
    writing are :class:`OutputError`."""
    path = check_output(path, flag, probe=False)  # creating the temporary below is the probe
    what = _label(path, flag)
    encoding = None if "b" in mode else "utf-8"
    target_mode = _mode(path)
    if _in_place(os.fspath(path), target_mode):
        fd = _stream_fd(os.fspath(path))
        try:
            if fd is None:
                f = open(path, mode, encoding=encoding, newline=newline)
            else:  # a duplicate shares the stream's offset: what was printed before stays, in order
                sys.stdout.flush()
                sys.stderr.flush()
                f = os.fdopen(os.dup(fd), mode, encoding=encoding, newline=newline)
            with f:
                yield f
        except OSError as exc:
            raise OutputError(f"{what}: cannot write ({exc.strerror or exc})") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"{what}: cannot write there ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if target_mode is not None:
            os.chmod(tmp, stat.S_IMODE(target_mode))
        else:  # what a plain open() would have made: 0666 less the umask
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        raise OutputError(f"{what}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        _remove(tmp)
        raise


def write_output(path: str | os.PathLike, data: str | bytes, flag: str | None = None) -> None:
    """Write ``data`` (text or bytes) to ``path`` whole or not at all (see :func:`atomic_output`)."""
    with atomic_output(path, flag, mode="wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


_STREAMS = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/self/fd/")


def is_stream(text: str | os.PathLike) -> bool:
    """Whether ``text`` names /dev/null or one of this process's own open files (written in place;
    a command whose results go to /dev/stdout says what it did on stderr)."""
    text = os.fspath(text)
    return os.path.realpath(text) == os.devnull or text.startswith(_STREAMS)


def _stream_fd(text: str) -> int | None:
    """The descriptor a stream path names (/dev/stdout: 1, /dev/fd/5: 5), or None."""
    named = {"/dev/stdout": 1, "/dev/stderr": 2}
    if text in named:
        return named[text]
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return int(text[len(prefix):])
    return None


def _in_place(text: str, mode: int | None) -> bool:
    """Whether an output is written in place (it exists and a rename cannot replace it: a pipe, a
    device, or a stream of this process, whatever it leads to) rather than through a temporary."""
    return mode is not None and (not stat.S_ISREG(mode) or is_stream(text))


def same_file_check(paths: dict[str, str | os.PathLike | None], inputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse two outputs naming one file, and an output naming an input (``{flag: path}``; None
    entries and non-files are ignored): one would silently overwrite the other."""
    seen: dict[str, str] = {}
    for flag, path in inputs.items():
        if path is not None and os.path.isfile(path):
            seen[os.path.realpath(path)] = flag
    for flag, path in paths.items():
        if path is None or is_stream(os.fspath(path)) or os.path.exists(path) and not os.path.isfile(path):
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise OutputError(f"{flag} {path}: the same file as {seen[key]}; one would overwrite the other")
        seen[key] = flag


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
