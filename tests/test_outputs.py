"""Output files (saria.outputs): checked before any work, written whole or not at all, on real
files, folders and devices."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from saria.outputs import OutputError, atomic_output, check_output, same_file_check, write_output


def test_a_good_path_is_checked_without_leaving_anything(tmp_path):
    assert check_output(tmp_path / "x.json", "--json") == tmp_path / "x.json"
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "missing" / "x.json", "the folder .*missing does not exist"),
    (lambda tmp: tmp, "is a folder, not a file"),
    (lambda tmp: (tmp / "file").write_text("") or tmp / "file" / "x.json", "is not a folder"),
    (lambda tmp: "", "must not be empty"),
    (lambda tmp: f"{tmp}/a\0b", "NUL"),
])
def test_unwritable_paths_name_the_option_and_why(tmp_path, make, message):
    with pytest.raises(OutputError, match=message) as info:
        check_output(make(tmp_path), "--json")
    assert "--json" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="cannot write there"):
            check_output(folder / "x.json", "--csv")
    finally:
        folder.chmod(0o700)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    path.write_text('{"old": true}\n')
    path.chmod(0o640)
    with pytest.raises(RuntimeError, match="midway"):
        with atomic_output(path, "--json") as f:
            f.write('{"new": ')
            raise RuntimeError("midway")
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    write_output(path, '{"new": true}\n', "--json")
    assert json.loads(path.read_text()) == {"new": True}
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the file it replaced kept its mode
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_new_file_gets_the_mode_open_would_give(tmp_path):
    umask = os.umask(0o027)
    try:
        write_output(tmp_path / "a.csv", "x\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a.csv").stat().st_mode) == 0o640
    write_output(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_devices_other_than_null_and_own_streams_are_refused_before_any_write():
    """Whether /dev/full takes the bytes can only be learnt by writing them, after the work."""
    with pytest.raises(OutputError, match="is a device, not a file"):
        check_output("/dev/full", "OUT")
    with pytest.raises(OutputError, match="is a device"):
        write_output("/dev/full", "x" * 10_000, "OUT")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # not replaced by a rename
    write_output("/dev/null", "discarded\n", "OUT")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_the_process_own_streams_are_written_in_place(tmp_path):
    path = tmp_path / "captured"
    with open(path, "w") as f:
        write_output(f"/dev/fd/{f.fileno()}", "to my own stream\n", "--json")
    assert path.read_text() == "to my own stream\n"


def test_two_outputs_or_an_output_and_the_input_naming_one_file_are_refused(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("{}\n")
    with pytest.raises(OutputError, match="--csv .* the same file as --json"):
        same_file_check({"--json": tmp_path / "r.out", "--csv": tmp_path / "." / "r.out"}, {})
    with pytest.raises(OutputError, match="--json .* the same file as TRACE"):
        same_file_check({"--json": trace}, {"TRACE": str(trace)})
    same_file_check({"--json": "/dev/stdout", "--csv": "/dev/stdout", "--plot": None}, {"TRACE": "synth"})


def test_a_named_pipe_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_output(fifo, "through the pipe\n", "--json")
        assert os.read(reader, 100) == b"through the pipe\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_synth_to_stdout_keeps_stdout_for_the_trace(capfd):
    """``saria synth /dev/stdout | ...``: the requests on stdout, what was done on stderr."""
    import saria.commands.cli

    code = saria.commands.cli.main(["synth", "/dev/stdout", "--sessions", "2", "--requests-per-session", "2",
                           "--prompt-tokens", "3000", "--first-prompt-tokens", "1000"])
    out, err = capfd.readouterr()
    assert code == 0 and err.startswith("wrote /dev/stdout: ")
    records = [json.loads(line) for line in out.splitlines()]
    assert records and all({"timestamp", "input_length", "hash_ids"} <= set(r) for r in records)
