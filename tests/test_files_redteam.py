"""Red team: another local user plants things where saria keeps its state on the box (issue 43,
items 1 and 5; docs/security.md, "Files on the box").

Each attack is the real SSD store, the real rank directories of the connector or the real key file
loader over real files in a temp dir: a symbolic link or a hard link at the drive file's name (to a
"victim" file of someone else's), a rank or store directory of another user or one anyone can write,
a FIFO at the drive file's name, a non-saria file under that name, a probe file swapped for a link
while the direct-I/O probe runs, a key file of another user or in a directory anyone can write.
Every one is refused at start in one line naming the path and what is wrong, and the victim is
byte-identical after. "Another user" is real where the suite runs as root (``os.chown`` to an uid
nobody has); as another user, who cannot give a file away, saria is made to run as an uid that is
not the files' (``os.geteuid`` patched for the test), which takes the same path through the checks."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from saria.dataplane import SSDStore, StoreConfigError, probe_direct_io
from saria.dataplane.ssd.format import FILE_NAME
from saria.integrations.vllm.layout import ParallelLayout, rank_directories
from saria.seal import KeyFile, KeyFileError, new_key_file, rotate_key_file

from ssd_cases import PB, Fault, FaultyOps, capacity, payload, read_back

O_TMPFILE = getattr(os, "O_TMPFILE", -1)
IDENTITY = '{"model":"victim-test"}'
OTHER_UID = 54321  # no user of this box: what "another local user" owns


def victim(tmp_path: Path, name: str = "victim.conf") -> tuple[Path, bytes]:
    """Someone else's file the attacker wants saria to destroy, and its bytes."""
    where = tmp_path / "elsewhere"
    where.mkdir(exist_ok=True)
    path = where / name
    data = b"# a precious config file, not saria's\n" * 300  # bigger than a superblock, no saria magic
    path.write_bytes(data)
    return path, data


def store_dir(tmp_path: Path, name: str = "rank0") -> Path:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return d


def refused(directory: Path, match: str, **kw) -> str:
    """Open a store on ``directory``: it must be refused in one line matching ``match``."""
    with pytest.raises(StoreConfigError) as exc:
        SSDStore([directory], capacity(4), PB, identity=IDENTITY, **kw)
    message = str(exc.value)
    assert "\n" not in message, message
    assert match in message, message
    return message


@pytest.fixture
def foreign(monkeypatch):
    """A function that makes ``path`` (not what it points to) another user's, and returns the uid
    the refusal names."""
    def make(path: Path) -> int:
        if os.geteuid() == 0:
            os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
            return OTHER_UID
        owner = os.lstat(path).st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
        return owner
    return make


# ------------------------------------------------------------------ the drive file's name

def test_planted_symlink_is_refused_and_its_target_untouched(tmp_path):
    """The hole of issue 43: ``rank0/saria-ssd-store.bin -> victim`` made before the first start.
    A store that followed it saw a file without a superblock, took it for another store's and
    wiped it (truncated, preallocated, formatted)."""
    target, before = victim(tmp_path)
    d = store_dir(tmp_path)
    (d / FILE_NAME).symlink_to(target)
    message = refused(d, "is a symbolic link")
    assert str(d / FILE_NAME) in message
    assert target.read_bytes() == before
    assert (d / FILE_NAME).is_symlink(), "the planted link is left where it was (saria removes nothing of others')"
    with pytest.raises(StoreConfigError, match="symbolic link"):  # without an identity too
        SSDStore([d], capacity(4), PB)
    assert target.read_bytes() == before


def test_symlink_to_a_missing_file_creates_nothing(tmp_path):
    d = store_dir(tmp_path)
    target = tmp_path / "elsewhere-new"
    (d / FILE_NAME).symlink_to(target)
    refused(d, "is a symbolic link")
    assert not target.exists()


def test_hard_link_is_refused_and_its_target_untouched(tmp_path):
    target, before = victim(tmp_path)
    d = store_dir(tmp_path)
    os.link(target, d / FILE_NAME)
    refused(d, "has 2 hard links")
    assert target.read_bytes() == before


def test_fifo_at_the_drive_file_is_refused_without_hanging(tmp_path):
    d = store_dir(tmp_path)
    os.mkfifo(d / FILE_NAME, 0o600)
    out: list = []
    t = threading.Thread(target=lambda: out.append(refused(d, "is a FIFO, not a regular file")), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "opening the store hung on the FIFO"
    assert out and stat.S_ISFIFO(os.lstat(d / FILE_NAME).st_mode)


def test_a_file_that_is_not_a_saria_store_is_refused_not_wiped(tmp_path):
    """The file is ours, regular, one link, but no saria superblock: not ours to destroy (a store
    of another identity, a damaged superblock and a never-formatted file are still wiped)."""
    d = store_dir(tmp_path)
    data = b"someone's notes, under the wrong name\n" * 500
    (d / FILE_NAME).write_bytes(data)
    message = refused(d, "is not a saria SSD store file")
    assert "not wiped" in message
    assert (d / FILE_NAME).read_bytes() == data


def test_drive_file_of_another_user_is_refused(tmp_path, foreign):
    d = store_dir(tmp_path)
    with SSDStore([d], capacity(4), PB, identity=IDENTITY) as store:
        store.write(b"k", payload(PB, 1)).result()
    before = (d / FILE_NAME).read_bytes()
    uid = foreign(d / FILE_NAME)
    refused(d, f"is owned by uid {uid}")
    assert (d / FILE_NAME).read_bytes() == before


def test_new_files_and_directories_are_private_whatever_the_umask(tmp_path):
    drive = tmp_path / "nvme0"
    drive.mkdir()
    old = os.umask(0)
    try:
        (rank,) = rank_directories((str(drive),), ParallelLayout())
        with SSDStore([rank], capacity(4), PB, identity=IDENTITY) as store:
            store.write(b"k", payload(PB, 2)).result()
            assert torch_equal(read_back(store, b"k", PB), payload(PB, 2))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(rank).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(rank) / FILE_NAME).st_mode) == 0o600


def test_an_older_world_readable_store_is_made_private(tmp_path):
    """Files and rank directories of an older saria (0644 and 0755) are tightened at start:
    they are saria's own, and without a key they hold KV in the clear."""
    drive = tmp_path / "nvme0"
    drive.mkdir()
    (rank,) = rank_directories((str(drive),), ParallelLayout())
    with SSDStore([rank], capacity(4), PB, identity=IDENTITY) as store:
        store.write(b"k", payload(PB, 3)).result()
    os.chmod(rank, 0o755)
    os.chmod(Path(rank) / FILE_NAME, 0o644)
    (rank,) = rank_directories((str(drive),), ParallelLayout())
    with SSDStore([rank], capacity(4), PB, identity=IDENTITY) as store:
        assert store.keys() == [b"k"]
    assert stat.S_IMODE(os.stat(rank).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(rank) / FILE_NAME).st_mode) == 0o600


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


# ------------------------------------------------------------------ rank and store directories

def test_rank_directory_of_another_user_is_refused(tmp_path, foreign):
    """Another user made ``rank0`` before saria's first start (a shared scratch mount)."""
    drive = tmp_path / "scratch"
    drive.mkdir()
    os.chmod(drive, 0o1777)
    planted = drive / "rank0"
    planted.mkdir(mode=0o700)
    uid = foreign(planted)
    with pytest.raises(ValueError, match=f"rank0 is owned by uid {uid}") as exc:
        rank_directories((str(drive),), ParallelLayout())
    assert "\n" not in str(exc.value)
    refused(planted, f"is owned by uid {uid}")  # the store itself checks it too
    assert list(planted.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702], ids=oct)
def test_rank_directory_others_can_write_is_refused(tmp_path, mode):
    drive = tmp_path / "nvme0"
    drive.mkdir()
    planted = drive / "rank0"
    planted.mkdir()
    os.chmod(planted, mode)
    with pytest.raises(ValueError, match="rank0 is writable by group or other") as exc:
        rank_directories((str(drive),), ParallelLayout())
    assert "\n" not in str(exc.value)
    refused(planted, "is writable by group or other")
    assert list(planted.iterdir()) == []


def test_rank_directory_that_is_a_symlink_is_refused(tmp_path):
    drive = tmp_path / "nvme0"
    drive.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (drive / "rank0").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="rank0 is a symbolic link"):
        rank_directories((str(drive),), ParallelLayout())
    refused(drive / "rank0", "is a symbolic link")
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------------------------------ the direct-I/O probe

def swap_probe_files(directory: Path, target: Path) -> None:
    """What an attacker racing the probe does: every probe file in ``directory`` becomes a link
    to ``target``."""
    for entry in os.listdir(directory):
        if entry.startswith(".saria"):
            path = directory / entry
            try:
                os.unlink(path)
                os.symlink(target, path)
            except OSError:
                pass


@pytest.mark.parametrize("tmpfile", [True, False], ids=["o_tmpfile", "named"])
def test_probe_never_writes_through_a_name(tmp_path, tmpfile):
    """The probe once closed its temporary file and opened it again by name: a link swapped in
    between got 4 KiB of its pattern. Every open and every write of the probe here swaps each probe
    file in the directory for a link to the victim; the victim stays byte-identical."""
    target, before = victim(tmp_path)
    d = store_dir(tmp_path)
    ops = FaultyOps()
    swap = lambda call: swap_probe_files(d, target)  # noqa: E731
    if not tmpfile:  # a filesystem without O_TMPFILE: the probe makes a named file and unlinks it at once
        ops.add(Fault("open", when=lambda c: c.flags & O_TMPFILE == O_TMPFILE, error=95, times=-1))
    ops.add(Fault("open", before=swap, times=-1))
    ops.add(Fault("pwrite", before=swap, times=-1))
    probe_direct_io(d, ops)
    assert target.read_bytes() == before
    assert all(os.path.islink(d / e) for e in os.listdir(d)), "the probe leaves no file of its own behind"
    assert any(c.op == "pwrite" for c in ops.calls)


# ------------------------------------------------------------------ the key file (item 5)

def test_key_file_of_another_user_is_refused(tmp_path, foreign):
    path = tmp_path / "keys"
    new_key_file(path)
    uid = foreign(path)
    with pytest.raises(KeyFileError, match=f"owned by uid {uid}") as exc:
        KeyFile.load(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)
    with pytest.raises(KeyFileError, match=f"owned by uid {uid}"):
        rotate_key_file(path)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775], ids=oct)
def test_key_file_in_a_directory_others_can_write_is_refused(tmp_path, mode):
    d = tmp_path / "etc"
    d.mkdir()
    path = d / "keys"
    new_key_file(path)
    before = path.read_bytes()
    os.chmod(d, mode)
    with pytest.raises(KeyFileError, match="directory .*etc is writable by group or other") as exc:
        KeyFile.load(path)
    assert "\n" not in str(exc.value)
    with pytest.raises(KeyFileError, match="writable by group or other"):
        rotate_key_file(path)
    with pytest.raises(KeyFileError, match="writable by group or other"):
        new_key_file(d / "keys2")
    assert not (d / "keys2").exists() and path.read_bytes() == before


def test_key_file_with_a_second_hard_link_is_refused(tmp_path):
    path = tmp_path / "keys"
    new_key_file(path)
    os.link(path, tmp_path / "copy")
    with pytest.raises(KeyFileError, match="has 2 hard links"):
        KeyFile.load(path)


def test_rotate_writes_through_a_fresh_private_file(tmp_path):
    """A link planted at the old fixed temporary name (``.keys.new``) is neither followed nor
    needed: rotate writes a new file of its own and renames it over the key file."""
    path = tmp_path / "keys"
    new_key_file(path)
    target, before = victim(tmp_path)
    (tmp_path / ".keys.new").symlink_to(target)
    rotated = rotate_key_file(path)
    assert KeyFile.load(path) == rotated and rotated.current == 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o400 and path.stat().st_nlink == 1
    assert target.read_bytes() == before


# ------------------------------------------------------------------ audit_kv with a key (item 5)

def test_audit_kv_with_a_key_is_refused_unless_the_testing_aid_allows_it(tmp_path):
    """``audit_kv`` keeps vLLM's block hashes of reloaded chunks in the workers: with a key (a
    shared deployment) it is refused in one line, at ``saria serve`` before vLLM starts too."""
    import subprocess
    import sys

    from saria.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(ValueError, match="audit_kv with secret_file.*audit_kv_with_key") as exc:
        ConnectorSettings.from_extra_config({"audit_kv": True, "secret_file": "/k"})
    assert "\n" not in str(exc.value)
    allowed = ConnectorSettings.from_extra_config({"audit_kv": True, "secret_file": "/k", "audit_kv_with_key": True})
    assert allowed.audit_kv and allowed.sealed and allowed.audit_kv_with_key
    assert ConnectorSettings.from_extra_config({"audit_kv": True}).audit_kv  # without a key: a test, as before
    with pytest.raises(ValueError, match="audit_kv_with_key must be true or false"):
        ConnectorSettings.from_extra_config({"audit_kv_with_key": "yes"})
    key = tmp_path / "saria.key"
    new_key_file(key)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "serve", "m", "--secret-file", str(key),
                           "--saria-option", "audit_kv=true", "--print-command"], capture_output=True, text=True,
                          timeout=120, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1 and "audit_kv with secret_file" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ saria cluster start's logs

def test_cluster_logs_never_truncate_what_a_link_or_another_name_reaches(tmp_path):
    """``saria cluster start --logdir DIR``: its processes' logs are emptied at each start, but a
    link planted at a log's name (or a second name of someone's file) is refused, its target intact."""
    from saria.dataplane.cluster.local import open_log

    target, before = victim(tmp_path)
    logdir = tmp_path / "logs"
    logdir.mkdir()
    (logdir / "master-1.log").symlink_to(target)
    with pytest.raises(OSError):
        open_log(logdir / "master-1.log")
    os.link(target, logdir / "node-1.log")
    with pytest.raises(OSError, match="2 hard links"):
        open_log(logdir / "node-1.log")
    assert target.read_bytes() == before
    (logdir / "old.log").write_bytes(b"an earlier run's log\n")
    with open_log(logdir / "old.log") as f:
        f.write(b"new\n")
    assert (logdir / "old.log").read_bytes() == b"new\n"
    with open_log(logdir / "new.log") as f:
        pass
    assert stat.S_IMODE(os.stat(logdir / "new.log").st_mode) == 0o600


def test_the_weights_updated_marker_is_never_written_through_a_link(tmp_path):
    """The marker a reset leaves in a rank's store directory (``resets.MARKER``) is saria's own
    file: a dangling link at its name is refused, and nothing is created where it points."""
    from saria.integrations.vllm.resets import MARKER, mark_updated

    d = store_dir(tmp_path)
    (d / MARKER).symlink_to(tmp_path / "elsewhere-marker")
    with pytest.raises(OSError):
        mark_updated([d])
    assert not (tmp_path / "elsewhere-marker").exists()
    (d / MARKER).unlink()
    mark_updated([d])
    assert stat.S_IMODE(os.lstat(d / MARKER).st_mode) == 0o600
