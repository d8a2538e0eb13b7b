"""Key files and ``saria keys``: every file saria must not use is refused in one line that names the
path and nothing secret; any bytes at all are a key file or a KeyFileError, never another
exception; ``saria keys new / show / rotate / retire`` run as a user runs them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.seal import KeyFile, KeyFileError, Keyring, new_key_file, retire_epoch, rotate_key_file
from saria.seal.keyfile import KEY_BYTES, MAX_FILE_BYTES

ROOT = Path(__file__).resolve().parent.parent
HEX_A, HEX_B, HEX_C = "a1" * KEY_BYTES, "b2" * KEY_BYTES, "c3" * KEY_BYTES


def write(path: Path, data, mode=0o400) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    os.chmod(path, mode)
    return path


def doc(**changes):
    base = {"saria_keys": 1, "names": HEX_A, "current": 1, "epochs": {"1": HEX_B}}
    return {k: v for k, v in {**base, **changes}.items() if v is not None}


def refusal(path, match: str) -> str:
    """Loading ``path`` raises a one-line KeyFileError naming it and saying ``match``, no key in it."""
    with pytest.raises(KeyFileError) as info:
        KeyFile.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and match in message, message
    for secret in (HEX_A, HEX_B, HEX_C, HEX_A[:16], HEX_B[:16]):
        assert secret not in message.lower()
    return message


def test_a_new_key_file_is_0400_random_and_never_overwritten(tmp_path):
    old = os.umask(0)  # whatever the umask
    try:
        keys = new_key_file(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o400
    assert KeyFile.load(tmp_path / "k") == keys and keys.current == 1 and list(keys.epochs) == [1]
    assert keys.names != keys.epochs[1] and len(keys.names) == KEY_BYTES
    other = new_key_file(tmp_path / "k2")
    assert {other.names, *other.epochs.values()}.isdisjoint({keys.names, *keys.epochs.values()})
    before = (tmp_path / "k").read_bytes()
    with pytest.raises(KeyFileError, match="never overwrites"):
        new_key_file(tmp_path / "k")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(KeyFileError):  # not through a dangling symlink either
        new_key_file(tmp_path / "link")
    assert not (tmp_path / "nowhere").exists() and (tmp_path / "k").read_bytes() == before


@pytest.mark.parametrize("mode", [0o440, 0o404, 0o420, 0o402, 0o410, 0o401, 0o444, 0o666, 0o640, 0o604])
def test_group_or_other_access_is_refused(tmp_path, mode):
    path = write(tmp_path / "k", doc(), mode)
    refusal(path, f"mode {mode:04o}")


@pytest.mark.parametrize("mode", [0o400, 0o600, 0o700])
def test_owner_only_modes_load(tmp_path, mode):
    assert KeyFile.load(write(tmp_path / "k", doc(), mode)).current == 1


def test_paths_that_are_not_key_files_are_refused(tmp_path):
    refusal(tmp_path / "missing", "does not exist")
    good = write(tmp_path / "good", doc())
    (tmp_path / "link").symlink_to(good)
    refusal(tmp_path / "link", "cannot be opened")
    (tmp_path / "dir").mkdir(mode=0o700)
    refusal(tmp_path / "dir", "not a regular file")
    os.mkfifo(tmp_path / "fifo", 0o600)  # opening a FIFO for reading would wait for a writer forever
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(KeyFileError, KeyFile.load, tmp_path / "fifo")),
                         daemon=True)
    t.start()
    t.join(10)
    assert done, "KeyFile.load blocked on a FIFO"
    assert "not a regular file" in str(done[0].value)
    refusal(write(tmp_path / "big", b" " * (MAX_FILE_BYTES + 1)), "not a saria key file")


@pytest.mark.parametrize("content, match", [
    pytest.param(b"", "not JSON", id="empty"),
    pytest.param(b"{", "not JSON", id="cut"),
    pytest.param(b"\xff\xfe\x00", "not JSON", id="binary"),
    pytest.param(b"[" * 100_000, "not JSON", id="deep-nesting"),
    pytest.param([1], "not a saria key file", id="list"),
    pytest.param(doc(saria_keys=2), "not a saria key file", id="format-2"),
    pytest.param(doc(saria_keys=True), "not a saria key file", id="format-true"),
    pytest.param(doc(saria_keys=None), "not a saria key file", id="no-format"),
    pytest.param(doc(names=HEX_A[:-2]), "names is not 32 bytes", id="names-31"),
    pytest.param(doc(names=HEX_A + "a1"), "names is not 32 bytes", id="names-33"),
    pytest.param(doc(names="zz" * KEY_BYTES), "names is not 32 bytes", id="names-not-hex"),
    pytest.param(doc(names=None), "names is not 32 bytes", id="no-names"),
    pytest.param(doc(epochs={"1": HEX_B[:-2]}), "epoch 1 is not 32 bytes", id="epoch-short"),
    pytest.param(doc(epochs={"1": 5}), "epoch 1 is not 32 bytes", id="epoch-number"),
    pytest.param(doc(epochs={}), "no epochs", id="no-epochs"),
    pytest.param(doc(epochs=[HEX_B]), "no epochs", id="epochs-list"),
    pytest.param(doc(epochs={"0": HEX_B}, current=0), "not an integer", id="epoch-0"),
    pytest.param(doc(epochs={"4294967296": HEX_B}, current=4294967296), "not an integer", id="epoch-2^32"),
    pytest.param(doc(epochs={"²": HEX_B}), "not an integer", id="epoch-superscript"),
    pytest.param(doc(epochs={"01": HEX_B}), "not an integer", id="epoch-leading-zero"),
    pytest.param(doc(epochs={"-1": HEX_B}), "not an integer", id="epoch-negative"),
    pytest.param(doc(current=2), "current epoch", id="current-missing"),
    pytest.param(doc(current="1"), "current epoch", id="current-str"),
    pytest.param(doc(current=True), "current epoch", id="current-bool"),
    pytest.param(doc(names=HEX_B), "two of its keys are equal", id="names-equal-epoch"),
    pytest.param(doc(epochs={"1": HEX_B, "2": HEX_B}), "two of its keys are equal", id="epochs-equal"),
])
def test_malformed_key_files_are_refused(tmp_path, content, match):
    refusal(write(tmp_path / "k", content), match)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=70)
                     | st.sampled_from([HEX_A, HEX_B, HEX_C]), lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=12) | st.sampled_from(["1", "2", "names", "epochs"]), c,
                                       max_size=4), max_leaves=12)
_docs = st.fixed_dictionaries({}, optional={"saria_keys": st.sampled_from([1, 1.0, True, 2, "1"]),
                                            "names": _json, "current": _json,
                                            "epochs": st.dictionaries(st.text(max_size=4), _json, max_size=3)})


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.one_of(st.binary(max_size=300), _json.map(lambda d: json.dumps(d).encode()),
                      _docs.map(lambda d: json.dumps(d).encode())))
def test_any_bytes_are_a_key_file_or_one_key_file_error(data):
    try:
        keys = KeyFile.decode(data, "/k")
    except KeyFileError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("key file /k is malformed")
        return
    assert KeyFile.decode(keys.encode(), "/k") == keys  # what loads, saves and loads the same


def test_rotate_and_retire_keep_the_file_0400_and_refuse_what_they_must(tmp_path):
    path = tmp_path / "k"
    first = new_key_file(path)
    second = rotate_key_file(path)
    assert second.current == 2 and second.epochs[1] == first.epochs[1] and second.names == first.names
    assert stat.S_IMODE(path.stat().st_mode) == 0o400 and KeyFile.load(path) == second
    assert not list(tmp_path.glob(".*"))  # no temporary left beside it
    with pytest.raises(KeyFileError, match="current epoch"):
        retire_epoch(path, 2)
    with pytest.raises(KeyFileError, match="has no epoch 7"):
        retire_epoch(path, 7)
    assert Keyring(retire_epoch(path, 1)).epochs == (2,)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="mode 0644"):
        rotate_key_file(path)  # a file others could read is not rotated either: it is refused
    (tmp_path / ".k.new").write_text("a stale temporary")
    os.chmod(path, 0o400)
    assert rotate_key_file(path).current == 3  # a stale temporary from a crash is replaced


# ------------------------------------------------------------------ saria keys, as a user runs it


def saria(*args):
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", "keys", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_keys_command_new_show_rotate_retire(tmp_path):
    path = str(tmp_path / "saria.key")
    proc = saria("new", path)
    assert proc.returncode == 0 and "mode 0400" in proc.stdout, proc.stderr
    secrets = [KeyFile.load(path).names.hex(), KeyFile.load(path).epochs[1].hex()]
    assert saria("rotate", path).returncode == 0
    secrets.append(KeyFile.load(path).epochs[2].hex())
    shown = saria("show", "--json", path)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report == {"path": path, "format": 1, "mode": "0400", "owner": report["owner"], "current_epoch": 2,
                      "epochs": [1, 2]}
    text = saria("show", path)
    assert text.returncode == 0 and "current epoch  2" in text.stdout and "0400" in text.stdout
    retired = saria("retire", path, "--epoch", "1")
    assert retired.returncode == 0 and "epoch 1 retired" in retired.stdout
    assert KeyFile.load(path).epochs.keys() == {2}
    everything = "".join(p.stdout + p.stderr for p in (proc, shown, text, retired))
    assert Keyring.load(path).key_id.hex() not in everything  # nor the key id
    assert not any(s in everything or s[:16] in everything for s in secrets)


@pytest.mark.parametrize("args, message", [
    (["new", "{d}/k"], "exists: saria keys new never overwrites"),
    (["new", "{d}/no/such/dir/k"], "cannot write key file"),
    (["show", "{d}/missing"], "does not exist (make one with: saria keys new"),
    (["show", "{d}/open"], "has mode 0644"),
    (["rotate", "{d}/open"], "has mode 0644"),
    (["retire", "{d}/k", "--epoch", "1"], "epoch 1 is the current epoch"),
    (["retire", "{d}/k", "--epoch", "9"], "has no epoch 9"),
    (["retire", "{d}/k", "--epoch", "0"], "argument --epoch"),
    (["retire", "{d}/k"], "the following arguments are required: --epoch"),
    (["show"], "the following arguments are required: PATH"),
    ([], "the following arguments are required: ACTION"),
    (["burn", "{d}/k"], "invalid choice"),
])
def test_keys_command_errors_are_one_line_and_exit_2(tmp_path, args, message):
    new_key_file(tmp_path / "k")
    write(tmp_path / "open", doc(), 0o644)
    proc = saria(*[a.format(d=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("saria keys"), proc.stderr
    assert HEX_A not in proc.stderr and HEX_B not in proc.stderr


def test_keys_help_explains_key_management():
    proc = saria("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for words in ("mode 0400", "rotate", "retire", "same key file", "lost key file", "--secret-file", "2^32"):
        assert words in text, words
    for action in ("new", "show", "rotate", "retire"):
        sub = saria(action, "--help")
        assert sub.returncode == 0 and "Key management" in sub.stdout
