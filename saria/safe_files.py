"""Files and directories opened as a careful daemon opens them (docs/security.md, "Files on the box").

saria's own state on the box (SSD store directories and drive files, the key file) may sit where
other local users can write: a shared scratch mount, a directory made before saria first ran. So
saria opens them without following a symbolic link at the last component (``O_NOFOLLOW``), never
blocks on a FIFO (``O_NONBLOCK`` until the type is checked), checks what it opened on the
descriptor (``fstat``: never a second look-up of the name, which another user could have swapped),
and keeps working relative to a directory's descriptor once it has checked the directory:

* a directory of saria's own state: a real directory (not a symbolic link), owned by the user that
  runs saria (the effective uid), not writable by group or other; made 0700 when saria creates it;
* a file of saria's own state: a regular file, owned by that user, one hard link (no other name
  reaches it); made 0600 (0400 for a key file) whatever the umask.

Each check that fails is one line naming the path and what is wrong (:func:`dir_problem`,
:func:`file_problem`); callers raise it as their own error type. Nothing here truncates, writes
or removes anything.
"""

from __future__ import annotations

import errno
import os
import stat

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class UnsafePath(Exception):
    """A path saria will not use: one line naming it and what is wrong (nothing secret)."""


def shown(path: str | os.PathLike) -> str:
    """``path`` as a one-line message shows it: quoted where it holds a newline or another
    character that would break the line."""
    text = os.fspath(path)
    text = text if isinstance(text, str) else os.fsdecode(text)
    return text if text.isprintable() else repr(text)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words (``"a FIFO"``, ...; ``"a regular file"``)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _owner_problem(st: os.stat_result) -> str | None:
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"is owned by uid {st.st_uid}, not by uid {euid} that runs saria"
    return None


def dir_problem(st: os.stat_result) -> str | None:
    """What is wrong with a directory of saria's own state whose ``fstat`` (or ``lstat``) is
    ``st`` (a phrase after its name), or ``None`` when it is a real directory, owned by the
    effective uid, that group and other cannot write."""
    if not stat.S_ISDIR(st.st_mode):
        return f"is {kind_of(st.st_mode)}, not a directory"
    owner = _owner_problem(st)
    if owner:
        return owner
    if st.st_mode & 0o022:
        return (f"is writable by group or other (mode {stat.S_IMODE(st.st_mode):04o}): another user could "
                "replace what saria keeps in it")
    return None


def file_problem(st: os.stat_result) -> str | None:
    """What is wrong with a file of saria's own state whose ``fstat`` is ``st`` (a phrase after
    its name), or ``None`` when it is a regular file, owned by the effective uid, with one link."""
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind_of(st.st_mode)}, not a regular file"
    owner = _owner_problem(st)
    if owner:
        return owner
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links: another name reaches the same file"
    return None


def open_dir(path: str | os.PathLike, *, follow: bool = False) -> int:
    """A read-only descriptor of directory ``path`` (``O_NOFOLLOW`` unless ``follow``), or
    :class:`UnsafePath` saying why not (missing, a symbolic link, not a directory, ...)."""
    flags = os.O_RDONLY | O_DIRECTORY | O_CLOEXEC | (0 if follow else O_NOFOLLOW)
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        raise UnsafePath(f"{shown(path)} does not exist") from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # O_DIRECTORY|O_NOFOLLOW on a link: ENOTDIR (Linux)
            try:
                what = kind_of(os.lstat(path).st_mode)
            except OSError:
                what = "not a directory"
            raise UnsafePath(f"{shown(path)} is {what}, not a directory") from None
        raise UnsafePath(f"{shown(path)} cannot be opened: {exc.strerror or exc}") from None


def open_private_dir(path: str | os.PathLike, *, create: bool = False, tighten: bool = False) -> int:
    """A descriptor of ``path``, a directory of saria's own state, checked on the descriptor
    (:func:`dir_problem`); with ``create`` made first (mode 0700) when missing. ``tighten``:
    a directory that passes but that group or other can read or enter is made 0700 (saria's own
    directory: without a key its files hold KV in the clear). :class:`UnsafePath` otherwise."""
    created = False
    if create:
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafePath(f"{shown(path)} cannot be created: {exc.strerror or exc}") from None
    fd = open_dir(path)
    try:
        st = os.fstat(fd)
        problem = dir_problem(st)
        if problem:
            raise UnsafePath(f"{shown(path)} {problem}")
        if (created or tighten) and st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


__all__ = ["O_CLOEXEC", "O_DIRECTORY", "O_NOFOLLOW", "O_NONBLOCK", "UnsafePath", "dir_problem", "file_problem",
           "kind_of", "open_dir", "open_private_dir", "shown"]
