"""The key file: the secrets a saria deployment seals its shared tiers with.

A key file is a small JSON text file, mode 0400, owned by the user that runs saria::

    {"saria_keys": 1,
     "names": "<64 hex digits>",               # 256-bit root of the naming and tenant keys
     "current": 2,                             # the epoch new objects are sealed under
     "epochs": {"1": "<64 hex>", "2": "<64 hex>"}}   # 256-bit master key of each live epoch

``saria keys new PATH`` writes one with epoch 1; ``saria keys rotate PATH`` adds an epoch and makes
it current (objects sealed under older epochs stay readable); ``saria keys retire PATH --epoch N``
removes an old epoch (its objects become misses). The naming root is kept across rotations, so an
object's name does not change with the epoch it is sealed under. ``saria keys rekey PATH`` is the
recovery from a leaked key file: a new naming root and a new master key, every older epoch
dropped, so every name, store label and key id changes and every object sealed under the old file
is a clean miss. Every secret comes from ``os.urandom``. A file that group or other can read or
write, one that another user owns or that has a second hard link, and one in a directory that
group or other can write is refused when loaded (docs/security.md, "Files on the box").
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from saria.safe_files import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, O_NONBLOCK, file_problem
from saria.seal.errors import KeyFileError

FORMAT = 1
KEY_BYTES = 32
MAX_EPOCH = (1 << 32) - 1
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True, repr=False)
class KeyFile:
    """A loaded key file. ``repr`` shows the epochs only, never a secret."""

    names: bytes
    current: int
    epochs: dict[int, bytes]

    def __repr__(self) -> str:
        return f"KeyFile(current={self.current}, epochs={sorted(self.epochs)})"

    def encode(self) -> bytes:
        doc = {"saria_keys": FORMAT, "names": self.names.hex(), "current": self.current,
               "epochs": {str(e): k.hex() for e, k in sorted(self.epochs.items())}}
        return (json.dumps(doc, indent=1) + "\n").encode()

    @staticmethod
    def load(path: str | os.PathLike) -> "KeyFile":
        """The key file at ``path``; :class:`KeyFileError` (one line naming the path) if it is
        missing, not a regular file, readable or writable by group or other, or malformed."""
        path = Path(path)
        try:
            dir_fd = _open_parent(path)
        except FileNotFoundError:
            dir_fd = -1
        try:
            # O_NONBLOCK: a FIFO at the path must be refused below, not block the open for a writer;
            # relative to the directory just checked, so the file is the one in that directory
            fd = os.open(path.name if dir_fd >= 0 else path, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
                         dir_fd=dir_fd if dir_fd >= 0 else None)
        except FileNotFoundError:
            raise KeyFileError(f"key file {_shown(path)} does not exist "
                               f"(make one with: saria keys new {_shown(path)})") from None
        except OSError as exc:
            raise KeyFileError(f"key file {_shown(path)} cannot be opened: {exc.strerror}") from None
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyFileError(f"key file {_shown(path)} is not a regular file")
            if st.st_mode & 0o077:
                raise KeyFileError(f"key file {_shown(path)} has mode {stat.S_IMODE(st.st_mode):04o}: group and "
                                   f"other must have no access (chmod 0400 {_shown(path)})")
            problem = file_problem(st)  # owned by the user running saria, one link
            if problem:
                raise KeyFileError(f"key file {_shown(path)} {problem}: refused (whoever owns or links it can "
                                   "rewrite the keys)")
            if st.st_size > MAX_FILE_BYTES:
                raise KeyFileError(f"key file {_shown(path)} is {st.st_size} bytes: not a saria key file")
            data = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        return KeyFile.decode(data, _shown(path))

    @staticmethod
    def decode(data: bytes, where: str = "key file") -> "KeyFile":
        def bad(why: str) -> KeyFileError:
            return KeyFileError(f"key file {where} is malformed: {why}")

        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: "[[[[..."
            raise bad("not JSON") from None
        if not isinstance(doc, dict) or type(doc.get("saria_keys")) is not int or doc["saria_keys"] != FORMAT:
            raise bad(f"not a saria key file of format {FORMAT}")
        names = _secret(doc.get("names"), "names", bad)
        epochs_doc = doc.get("epochs")
        if not isinstance(epochs_doc, dict) or not epochs_doc:
            raise bad("no epochs")
        epochs: dict[int, bytes] = {}
        for name, value in epochs_doc.items():
            # ASCII digits, no leading zero: "²" or "١" (str.isdigit) would break int(), "01" would alias "1"
            if not (name.isascii() and name.isdigit() and str(int(name)) == name and 1 <= int(name) <= MAX_EPOCH):
                raise bad(f"epoch {name[:12]!r} is not an integer in 1..{MAX_EPOCH}")
            epochs[int(name)] = _secret(value, f"epoch {int(name)}", bad)
        current = doc.get("current")
        if not isinstance(current, int) or isinstance(current, bool) or current not in epochs:
            raise bad("the current epoch is not one of its epochs")
        if len(set(epochs.values()) | {names}) != len(epochs) + 1:
            raise bad("two of its keys are equal")
        return KeyFile(names, current, epochs)


def _shown(path: str | os.PathLike) -> str:
    """``path`` as a message shows it: quoted where it holds a newline or another character that
    would break the message's one line."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _secret(value, what: str, bad) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * KEY_BYTES:
        raise bad(f"{what} is not {KEY_BYTES} bytes of hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise bad(f"{what} is not {KEY_BYTES} bytes of hex") from None


def _open_parent(path: Path) -> int:
    """A descriptor of the directory holding the key file ``path``, checked: group and other must
    not be able to write it (they could replace the key file), else :class:`KeyFileError`.
    ``FileNotFoundError`` when it does not exist."""
    parent = path.parent
    try:
        fd = os.open(parent, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise KeyFileError(f"key file {_shown(path)}: its directory cannot be opened: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_mode & 0o022:
        os.close(fd)
        raise KeyFileError(f"key file {_shown(path)}: its directory {_shown(parent)} is writable by group or other "
                           f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could replace the key file "
                           f"(chmod go-w {_shown(parent)}): refused")
    return fd


def _write_new(path: Path, data: bytes, parent_fd: int | None = None) -> None:
    """Create ``path`` (mode 0400, never over an existing file nor through a link, in a directory
    that group and other cannot write: ``parent_fd`` when the caller has it open) holding ``data``."""
    dir_fd = _open_parent(path) if parent_fd is None else os.dup(parent_fd)
    try:
        fd = os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o400, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o400)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(path.name, dir_fd=dir_fd)  # made here (O_EXCL) in a directory no one else writes
            raise
        os.close(fd)
    finally:
        os.close(dir_fd)


def _replace(path: Path, keys: KeyFile) -> None:
    """Write ``keys`` to a new file beside ``path`` (a random name, created exclusively) and rename
    it over ``path`` (atomic); :class:`KeyFileError` if it cannot (the new file is then removed,
    ``path`` left as it was)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.new")
    written = False
    try:
        dir_fd = _open_parent(path)
    except FileNotFoundError:
        raise KeyFileError(f"cannot replace key file {_shown(path)}: its directory does not exist") from None
    try:
        try:
            _write_new(tmp, keys.encode(), dir_fd)
            written = True
            os.replace(tmp.name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            if written:
                try:
                    os.unlink(tmp.name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
            raise KeyFileError(f"cannot replace key file {_shown(path)} (by way of a new file beside it): "
                               f"{exc.strerror}") from None
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def new_key_file(path: str | os.PathLike) -> KeyFile:
    """Write a new key file at ``path`` (epoch 1); :class:`KeyFileError` if ``path`` exists."""
    path = Path(path)
    keys = KeyFile(os.urandom(KEY_BYTES), 1, {1: os.urandom(KEY_BYTES)})
    try:
        _write_new(path, keys.encode())
    except FileExistsError:
        raise KeyFileError(f"{_shown(path)} exists: saria keys new never overwrites a key file") from None
    except OSError as exc:
        raise KeyFileError(f"cannot write key file {_shown(path)}: {exc.strerror}") from None
    return keys


def rotate_key_file(path: str | os.PathLike) -> KeyFile:
    """Add an epoch to the key file at ``path`` and make it current; the older epochs stay (their
    objects stay readable until retired)."""
    path = Path(path)
    keys = KeyFile.load(path)
    epoch = max(keys.epochs) + 1
    if epoch > MAX_EPOCH:
        raise KeyFileError(f"key file {_shown(path)} has used every epoch")
    rotated = KeyFile(keys.names, epoch, {**keys.epochs, epoch: os.urandom(KEY_BYTES)})
    _replace(path, rotated)
    return rotated


def rekey_key_file(path: str | os.PathLike) -> KeyFile:
    """Replace the key file at ``path`` with a new naming root and a new master key (every older
    epoch dropped): what a leaked key file needs. Nothing the old file derives survives (names,
    store labels, key id, seal keys), so every object sealed under it is a miss. The new epoch
    follows the old ones (a server still holding the old file knows no key of it)."""
    path = Path(path)
    keys = KeyFile.load(path)
    epoch = max(keys.epochs) + 1
    if epoch > MAX_EPOCH:
        epoch = 1  # every epoch used: start again (the naming root is new, nothing old opens anyway)
    fresh = KeyFile(os.urandom(KEY_BYTES), epoch, {epoch: os.urandom(KEY_BYTES)})
    _replace(path, fresh)
    return fresh


def retire_epoch(path: str | os.PathLike, epoch: int) -> KeyFile:
    """Remove ``epoch`` from the key file at ``path``: objects sealed under it become misses.
    The current epoch cannot be retired (rotate first)."""
    path = Path(path)
    keys = KeyFile.load(path)
    if epoch not in keys.epochs:
        raise KeyFileError(f"key file {_shown(path)} has no epoch {epoch} (it has {sorted(keys.epochs)})")
    if epoch == keys.current:
        raise KeyFileError(f"epoch {epoch} is the current epoch of {_shown(path)}: rotate first "
                           f"(saria keys rotate {_shown(path)})")
    retired = KeyFile(keys.names, keys.current, {e: k for e, k in keys.epochs.items() if e != epoch})
    _replace(path, retired)
    return retired
