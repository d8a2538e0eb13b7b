"""CLI fuzz test: every subcommand of ``saria``, run in-process on hypothesis-generated trace files
and argument values, against the CLI's error contract.

The contract (README, ``saria.commands.cli``):

* exit status 0 (done) or 2 (bad argument or bad input file); argparse's usage errors exit 2 too.
  Status 1 means an internal error (a bug), so it fails here, and so does any exception that
  escapes ``saria.commands.cli.main`` (the harness catches only ``SystemExit``);
* no traceback on stderr; on status 2 stderr ends with one error line ``saria CMD: error: ...``
  (argparse's format), possibly followed by indented continuation lines (the list of malformed
  trace lines), and that error names the argument, or the trace file (and line);
* output files (``--json``, ``--csv``, ``--plot``, ``synth OUT``, ``roundtrip --json``) are either
  complete and valid after the run (JSON parses, without NaN; CSV has a header and rows of its
  width; synth JSONL has one request per line, as many as reported; PNG ends with IEND) or absent:
  a run that fails leaves no new file and leaves a pre-existing output file untouched, and says
  "wrote" about nothing;
* an output path that cannot be written is reported before the work starts (no results on
  stdout);
* no unbounded work or memory: each run gets a time limit (:data:`RUN_TIMEOUT_S`) and a limit on
  its data segment (:data:`RUN_MEMORY`, ``RLIMIT_DATA`` raised back after the run), so an absurd
  value (10**30 sessions, a 10**11-token round) must be refused, not attempted.

Traces: valid Mooncake lines (prefix-chained ``hash_ids`` of 64-token blocks, session ids) and
TraceLab rounds, mutated line by line (truncated, a field replaced by any JSON value, huge and
non-finite numbers, fields dropped, unicode keys and values, non-objects, empty lines, random and
invalid UTF-8 bytes, very long lines), replayed with and without ``--skip-bad-lines``, each
``--format``, ``--time-unit`` and ``--no-time-check``. On top of the contract: a trace of valid
lines only replays (status 0, every line a request), and with ``--skip-bad-lines`` every non-blank
line is either a request or reported as skipped.

Arguments: the options of every subparser are read from ``saria.commands.cli.build_parser()``, so a new
option is fuzzed without touching this file. Each test starts from a fast, valid command line per
subcommand and replaces one option (or two to four) with a value drawn from numbers at the edges
(0, -1, 1e-300, 1e308, 1e400, inf, nan, 10**30, 2**63, 400 nines), unit strings, comma lists,
unicode, empty strings, policy specs and ``synth:key=value`` specs, and paths (missing folder,
a directory, /dev/full, /dev/null, a file used as a folder, a name over NAME_MAX, a path /sys
refuses even to root, a pre-existing file). ``demo`` never starts vLLM here: its model building
and engine runs are replaced by a sentinel, so only what it checks before starting is fuzzed
(and the explicit tests ask that every bad demo argument is refused before that point). Nor does
``cluster start`` start Mooncake's master and node (processes that run until stopped): the
cluster it would build is replaced by the same sentinel, so its checks of ports, host, pool size
and log directory are fuzzed (tests/test_cluster_command.py runs it for real). A subcommand with
actions of its own is fuzzed per action (``cluster start``, ``keys new``).

``saria keys new/show/rotate/retire/rekey PATH`` are fuzzed on their key file: PATH is a valid key file
(for ``keys new``: a fresh path), or replaced by any of the paths above, a key file that must be
refused (mode 0644, a symlink to one, a FIFO, malformed JSON) or a junk string, which is always
placed inside the example's temporary directory (a key file is never written anywhere else). On
top of the contract: no run prints a key of any key file it saw (hex, or its first 8 bytes);
``show`` leaves the file byte for byte; a run that succeeds leaves a key file that loads, mode 0400
(``rotate``: one epoch more, the new one current, the others and the naming root kept;
``retire``: one old epoch fewer, the rest kept; ``rekey``: a new naming root and one new epoch, no old
key kept; ``new``: epoch 1) and no ``.NAME.new`` beside it;
a run that fails leaves the file as it was (and ``new`` creates nothing).

Size: ``SARIA_FUZZ_EXAMPLES`` (default 100) scales every fuzz test's ``max_examples``
(``SARIA_FUZZ_EXAMPLES=1000`` for a longer hunt).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import io
import json
import math
import os
import re
import resource
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import saria.commands.cli
import saria.commands.demo
from cluster_cases import mooncake_available
from saria.commands.cli import build_parser

# ============================================================================================ sizes
EXAMPLES = int(os.environ.get("SARIA_FUZZ_EXAMPLES", "100"))
# one run. Bounded work is what it guards: a good run takes < 1.5 s, the largest synth trace drawn
# (3000 requests per session, 152K chunk references) about 3 s alone and past 10 s beside an engine
# test in make test's other process
RUN_TIMEOUT_S = float(os.environ.get("SARIA_FUZZ_TIMEOUT_S", "30"))
RUN_MEMORY = 2 << 30  # bytes of data segment a run may add to the test process's


def _examples(weight: float) -> int:
    return max(1, round(weight * EXAMPLES / 100))


def _settings(weight: float):
    # No explain phase: it traces every line the failing examples run, which makes a run under
    # the Triton interpreter (roundtrip) 20x slower, past RUN_TIMEOUT_S.
    return settings(max_examples=_examples(weight), deadline=None, database=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


# ========================================================================================== harness
class RunTimeout(BaseException):
    """The run went past RUN_TIMEOUT_S (a BaseException, so the code's ``except Exception`` lets it by)."""


class WorkStarted(BaseException):
    """``saria demo`` got past its checks and was about to build a model and start vLLM, or
    ``saria cluster start`` about to start Mooncake's master and node."""


class ContractViolation(AssertionError):
    """A run broke the CLI contract; ``kind`` says which rule."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


@dataclass
class Run:
    argv: list[str]
    code: int | str | None  # exit status; "started" for a demo that passed its checks
    stdout: str
    stderr: str
    seconds: float
    escaped: BaseException | None = None  # an exception that escaped saria.commands.cli.main: a failure
    escaped_tb: str = ""

    def describe(self) -> str:
        return (f"argv: {self.argv!r}\nexit: {self.code!r} after {self.seconds:.2f} s\n"
                f"--- stdout (tail) ---\n{self.stdout[-1500:]}\n--- stderr (tail) ---\n{self.stderr[-3000:]}"
                + (f"\n--- escaped ---\n{self.escaped_tb[-4000:]}" if self.escaped is not None else ""))


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


_TIMED_OUT = [False]
_LIMIT = [RUN_TIMEOUT_S]


def _on_alarm(signum, frame):
    # Raised wherever the run is; if something swallows it (a gc callback, an ``except
    # BaseException``), the alarm fires again shortly, and run_cli reports a timeout anyway.
    _TIMED_OUT[0] = True
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    raise RunTimeout(f"no answer within {_LIMIT[0]:g} s")


def _started(*args, **kwargs):
    raise WorkStarted()


def _demo_guard():
    """Make ``saria demo`` stop where it would start real work (model building, vLLM)."""
    stack = contextlib.ExitStack()
    from saria.harness import model, run
    stack.enter_context(mock.patch.object(model, "build_model", _started))
    stack.enter_context(mock.patch.object(run, "run_in_subprocess", _started))
    return stack


def _cluster_guard():
    """Make ``saria cluster start`` stop where it would start Mooncake's processes (before its
    temporary log directory, too)."""
    from saria.dataplane.cluster import local
    return mock.patch.object(local, "LocalCluster", _started)


def _guard(argv: list[str]):
    if argv[:1] == ["demo"]:
        return _demo_guard()
    if argv[:2] == ["cluster", "start"]:
        return _cluster_guard()
    return contextlib.nullcontext()


def run_cli(argv, *, timeout: float | None = None, memory: int = RUN_MEMORY) -> Run:
    """``saria.commands.cli.main(argv)`` in this process, stdout and stderr captured, under a time limit and
    a memory limit. ``SystemExit`` (argparse) gives the exit status; any other exception escaping
    ``main`` is kept in ``Run.escaped`` (a failure for the checks)."""
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = None
    escaped, escaped_tb = None, ""
    limit = timeout if timeout is not None else RUN_TIMEOUT_S
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _vm_data() + memory
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    _TIMED_OUT[0] = False
    _LIMIT[0] = limit
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    guard = _guard(argv)
    # a junk value of an option that names a folder (``cluster start --logdir 0``) is a relative path that a run
    # may create: each run works in a scratch folder of its own, never in the checkout it was started from
    scratch = tempfile.mkdtemp(prefix="saria-fuzz-cwd-")
    t0 = time.monotonic()
    try:
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
            signal.setitimer(signal.ITIMER_REAL, limit)
            with guard, contextlib.chdir(scratch), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = saria.commands.cli.main(argv)
        finally:  # disarmed before anything below runs
            signal.setitimer(signal.ITIMER_REAL, 0)
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    except SystemExit as exc:  # argparse: 2 for usage errors, 0 for --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            err.write(exc.code + "\n")
    except WorkStarted:
        code = "started"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - everything that escapes main is a finding
        escaped, escaped_tb = exc, "".join(traceback.format_exception(exc))
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        shutil.rmtree(scratch, ignore_errors=True)
    if _TIMED_OUT[0] and not isinstance(escaped, RunTimeout):
        escaped = RunTimeout(f"no answer within {limit:g} s (the first alarm was swallowed)")
        escaped_tb = f"{escaped}\n"
    return Run(argv, code, out.getvalue(), err.getvalue(), time.monotonic() - t0, escaped, escaped_tb)


# ------------------------------------------------------------------------------------------ outputs
SENTINEL = b"pre-existing output file: a failed run must leave it alone\n"
PNG_HEAD, PNG_TAIL = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


@dataclass
class Output:
    """An output path of a run: what it should hold (json, csv, jsonl, png) and what was there before."""

    path: str
    kind: str
    before: bytes | None = None  # a regular file's content before the run
    special: str = ""  # how the path was made: "" for a fresh or pre-existing file, else the path kind
    existed: bool = False  # anything at the path before the run (a file, a directory, a device)


def _parse_strict_json(text: str):
    def constant(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=constant)


def _validate(output: Output, stdout: str) -> str:
    """'' if the file at ``output.path`` is complete and valid, else why not."""
    path = Path(output.path)
    if not path.is_file():
        return f"{output.path} is not a file after a successful run"
    if output.kind == "key":
        from saria.seal import KeyFile, KeyFileError
        try:
            KeyFile.load(path)
        except KeyFileError as exc:
            return f"not a usable key file: {exc}"
        return ""
    data = path.read_bytes()
    if output.kind == "png":
        return "" if data.startswith(PNG_HEAD) and data.endswith(PNG_TAIL) else "not a complete PNG"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8: {exc}"
    if output.kind == "json":
        try:
            doc = _parse_strict_json(text)
        except ValueError as exc:
            return f"not valid JSON: {exc}"
        return "" if isinstance(doc, dict) and doc else "JSON is not a non-empty object"
    if output.kind == "csv":
        rows = list(csv.reader(io.StringIO(text)))
        if len(rows) < 2 or not rows[0] or not all(rows[0]):
            return f"CSV without a header and rows: {text[:200]!r}"
        if any(len(row) != len(rows[0]) for row in rows):
            return "CSV rows of another width than the header"
        return "" if text.endswith("\n") else "CSV does not end with a newline"
    if output.kind == "jsonl":
        if not text.endswith("\n"):
            return "JSONL does not end with a newline (cut off?)"
        lines = text[:-1].split("\n")
        for i, line in enumerate(lines, 1):
            try:
                record = _parse_strict_json(line)
            except ValueError as exc:
                return f"line {i} is not JSON: {exc}"
            if not isinstance(record, dict) or not {"timestamp", "input_length", "output_length",
                                                     "hash_ids"} <= set(record):
                return f"line {i} is not a Mooncake request: {line[:200]}"
        said = re.search(r"wrote .*?: ([\d,]+) requests", stdout)
        if said and int(said.group(1).replace(",", "")) != len(lines):
            return f"stdout says {said.group(1)} requests, the file has {len(lines)}"
        return "" if lines else "empty JSONL"
    raise AssertionError(f"unknown output kind {output.kind}")


# -------------------------------------------------------------------------------------------- check
# What each command prints only once its work is done (or under way).
WORK_DONE = {"replay": "SSD writes (GiB)", "sweep": "SSD writes (GiB)", "tune": "best within budget",
             "roundtrip": "packing", "synth": "wrote"}
ERROR_LINE = re.compile(r"^saria(?: [\w-]+){0,2}: (?:error: )?\S")  # "saria: ", "saria cluster start: "


def error_lines(run: Run) -> list[str]:
    """The last error line on stderr and the lines after it."""
    lines = [line for line in run.stderr.split("\n") if line.strip()]  # not splitlines: a path may hold \x0c
    for i in range(len(lines) - 1, -1, -1):
        if ERROR_LINE.match(lines[i]):
            return lines[i:]
    return []


def _note(text: str) -> None:
    if currently_in_test_context():  # hypothesis prints it with the failing example
        note(text)


def check(run: Run, outputs: list[Output] = (), *, names: tuple[str, ...] = ()) -> None:
    """Assert the CLI contract for one run. ``names``: strings of which the error (status 2) must
    contain at least one (the option or file at fault)."""
    _note(run.describe())
    if run.escaped is not None:
        if isinstance(run.escaped, RunTimeout):
            raise ContractViolation("timeout", f"unbounded work: {run.escaped}\n"
                                               + run.describe())
        run.escaped.add_note(f"saria.commands.cli.main raised instead of exiting 0 or 2\n{run.describe()}")
        raise run.escaped
    if run.code not in (0, 2, "started"):
        raise ContractViolation("exit-status", f"exit status {run.code!r} (0 or 2 expected; 1 is an internal "
                                               f"error)\n{run.describe()}")
    if "Traceback" in run.stderr or "Traceback" in run.stdout:
        raise ContractViolation("traceback", f"a traceback was printed\n{run.describe()}")
    if run.code == 2:
        if not run.stderr.strip():
            raise ContractViolation("silent-error", f"exit 2 with nothing on stderr\n{run.describe()}")
        tail = error_lines(run)
        if not tail:
            raise ContractViolation("error-format", f"exit 2 but no 'saria CMD: error: ...' line on stderr\n"
                                                    f"{run.describe()}")
        if any(not line[:1].isspace() for line in tail[1:]):
            raise ContractViolation("error-format", f"unindented lines after the error line\n{run.describe()}")
        message = "\n".join(tail)
        if names and not any(name and name.lower() in message.lower() for name in names):
            raise ContractViolation("unnamed-error", f"the error names none of {names!r}\n{run.describe()}")
        if re.search(r"^wrote ", run.stdout, re.MULTILINE):
            raise ContractViolation("wrote-then-failed", f"exit 2 after saying 'wrote'\n{run.describe()}")
        done = WORK_DONE.get(run.argv[0]) if run.argv else None
        if done and done in run.stdout:
            raise ContractViolation("late-error", f"exit 2 after the work was done (the results are on stdout): "
                                                  f"what was wrong could have been found before\n{run.describe()}")
    for output in outputs:
        path = Path(output.path)
        if run.code == 0:
            if output.special == "dev-null":
                continue
            if output.special == "dev-full":
                raise ContractViolation("output-lost", f"exit 0 although {output.path} cannot take a byte\n"
                                                       f"{run.describe()}")
            why = _validate(output, run.stdout)
            if why:
                raise ContractViolation("output-incomplete", f"{output.kind} output {output.path}: {why}\n"
                                                             f"{run.describe()}")
        elif run.code == 2:
            if output.before is not None:
                now = path.read_bytes() if path.is_file() else None
                if now != output.before:
                    raise ContractViolation("output-clobbered", f"a failed run changed the pre-existing "
                                                                f"{output.path} (now {now!r:.200})\n"
                                                                f"{run.describe()}")
            elif not output.existed and os.path.lexists(output.path):
                raise ContractViolation("output-half-written", f"a failed run left {output.path} behind "
                                                               f"({_peek(path)})\n{run.describe()}")


def _peek(path: Path) -> str:
    try:
        return f"{path.stat().st_size} bytes: {path.read_bytes()[:120]!r}" if path.is_file() else "not a file"
    except OSError as exc:
        return str(exc)


# ======================================================================================= workspaces
@contextlib.contextmanager
def workdir():
    """A fresh directory per example (hypothesis runs many examples in one test call)."""
    path = Path(tempfile.mkdtemp(prefix="saria-fuzz-"))
    try:
        yield path
    finally:
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, d), 0o755)
        shutil.rmtree(path, ignore_errors=True)


def mooncake_record(i: int, session: int, tokens: int, t_ms: int, output: int = 4) -> dict:
    return {"timestamp": t_ms, "input_length": tokens, "output_length": output,
            "hash_ids": [session * 10_000 + j for j in range(-(-tokens // 64))], "session_id": f"s{session}"}


def good_mooncake(n: int = 12) -> list[dict]:
    """Two sessions of growing prompts, 1.5 s apart: fine in ms, in s, with and without time checks."""
    return [mooncake_record(i, i % 2, 64 * (2 + i // 2) + 10, 1500 * i) for i in range(n)]


T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def tracelab_record(session: int, index: int, tokens: int, seconds: float, output: int = 8) -> dict:
    return {"session_id": f"sess-{session}", "round_index": index, "input_tokens_total": tokens,
            "output_tokens": output, "timing_events": [{"timestamp": (T0 + timedelta(seconds=seconds)).isoformat()}]}


def good_tracelab(n: int = 10) -> list[dict]:
    return [tracelab_record(i % 2, i // 2, 200 * (1 + i // 2), 20.0 * i) for i in range(n)]


def write_lines(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


FAST = ["--no-progress", "--jobs", "1", "--dram-tokens", "2048", "--ssd-tokens", "8192"]
TRACE_OPTS = ["--block-tokens", "64", "--chunk-tokens", "64"]
SMALL_SYNTH = {"sessions": "2", "requests_per_session": "3", "prompt_tokens": "2000", "first_prompt_tokens": "1000",
               "block_tokens": "64", "seed": "1"}


def synth_spec(items) -> str:
    return "synth:" + ",".join(f"{k}={v}" for k, v in items)


SMALL_SPEC = synth_spec(SMALL_SYNTH.items())
LONG_SPEC = "synth:sessions=10,prompt_tokens=3000,first_prompt_tokens=1000,block_tokens=64,requests_per_session=10"


# ==================================================================================== trace strategies
HUGE_NUMBERS = [10**309, -10**309, 10**400, 2**63, 2**64, -1, 1e308, -1e308, 1e-308, 5e-324, 10**11, 100000000000,
                10**30, 0, 0.5, 10**4000, 10**9, 10**8 + 1, 1e15 + 1, 1e300]
json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from(HUGE_NUMBERS)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=6)

VALID_KINDS = ("keep", "keep", "keep", "keep", "crlf")
MUTATIONS = ("retype", "huge", "nonfinite", "drop", "unicode", "truncate", "binary", "empty", "long", "nonobject",
             "bad-utf8", "bom", "numeric-string", "event")


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def mutated_line(draw, record: dict) -> tuple[bytes, bool]:
    """(line without its newline, still valid?)"""
    kind = draw(st.sampled_from(VALID_KINDS + MUTATIONS))
    rec = json.loads(json.dumps(record))
    keys = sorted(rec)
    if kind == "keep":
        return _dumps(rec), True
    if kind == "crlf":
        return _dumps(rec) + b"\r", True
    if kind == "retype":
        rec[draw(st.sampled_from(keys))] = draw(json_values)
    elif kind == "huge":
        rec[draw(st.sampled_from(keys))] = draw(st.sampled_from(HUGE_NUMBERS))
    elif kind == "nonfinite":
        rec[draw(st.sampled_from(keys))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    elif kind == "drop":
        del rec[draw(st.sampled_from(keys))]
    elif kind == "unicode":
        target = draw(st.sampled_from(keys + ["<new>"]))
        value = draw(st.text(min_size=1, max_size=12))
        rec[draw(st.text(min_size=1, max_size=8)) if target == "<new>" else target] = value
    elif kind == "truncate":
        line = _dumps(rec)
        return line[:draw(st.integers(0, len(line) - 1))], False
    elif kind == "binary":
        return draw(st.binary(min_size=1, max_size=80)), False
    elif kind == "empty":
        return draw(st.sampled_from([b"", b"   ", b"\t", b"\x0b"])), False
    elif kind == "long":
        if "hash_ids" in rec and draw(st.booleans()):
            rec["hash_ids"] = rec["hash_ids"] + list(range(10**6, 10**6 + 20_000))
        else:
            rec[draw(st.sampled_from(keys))] = "x" * draw(st.sampled_from([10_000, 200_000]))
    elif kind == "nonobject":
        return _dumps(draw(json_values)), False
    elif kind == "bad-utf8":
        line = _dumps(rec)
        at = draw(st.integers(0, len(line)))
        return line[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])) + line[at:], False
    elif kind == "bom":
        return b"\xef\xbb\xbf" + _dumps(rec), False
    elif kind == "numeric-string":
        key = draw(st.sampled_from(keys))
        rec[key] = str(rec[key]) if not isinstance(rec[key], str) else draw(st.sampled_from(["12", "1e3", "nan"]))
    elif kind == "event":
        if "timing_events" in rec:
            rec["timing_events"] = draw(st.sampled_from([
                [], [{}], ["2025-03-01T12:00:00+00:00"], [{"timestamp": "2025-03-01T12:00:00"}],
                [{"timestamp": "9999-12-31T23:59:59+00:00"}], [{"timestamp": "0001-01-01T00:00:00+00:00"}],
                [{"timestamp": "2025-13-45T99:00:00+00:00"}], [{"timestamp": 1740830400}],
                [{"timestamp": "2025-03-01T12:00:00+14:00"}, {"timestamp": "2025-03-01T12:00:00-12:00"}],
                [{"timestamp": "2025-03-01T12:00:00+00:00"}] * 1000]))
        else:
            rec["timestamp"] = draw(st.sampled_from(["2025-03-01T12:00:00+00:00", [1], {"ms": 1}, True]))
    return _dumps(rec), False


@st.composite
def trace_file(draw, fmt: str) -> tuple[bytes, bool, int]:
    """(file bytes, every line valid?, number of lines)."""
    n = draw(st.integers(1, 16))
    if fmt == "mooncake":
        t, records = 0, []
        for i in range(n):
            t += draw(st.integers(1000, 60_000))
            records.append(mooncake_record(i, draw(st.integers(0, 2)), draw(st.integers(1, 640)), t,
                                           draw(st.integers(0, 64))))
    else:
        records, clock = [], 0.0
        rounds: dict[int, int] = {}
        for _ in range(n):
            s = draw(st.integers(0, 2))
            rounds[s] = rounds.get(s, -1) + 1
            clock += draw(st.integers(1, 120))
            records.append(tracelab_record(s, rounds[s], draw(st.integers(1, 4000)), clock, draw(st.integers(0, 64))))
    lines, valid = [], True
    for record in records:
        line, ok = draw(mutated_line(record))
        lines.append(line)
        valid = valid and ok
    ending = draw(st.sampled_from([b"\n", b"\n", b"\r\n", b""]))  # a last line without its newline
    data = b"\n".join(lines) + ending
    if draw(st.integers(0, 9)) == 0:  # blank lines around
        data = b"\n\n" + data + b"\n \n"
    return data, valid, n


def nonblank_lines(data: bytes) -> int:
    return sum(1 for raw in io.BytesIO(data) if raw.strip())


def skipped_count(stderr: str) -> int:
    listed = sum(1 for line in stderr.splitlines() if line.startswith("skipped ") and not line.endswith(
        "more malformed lines"))
    more = re.search(r"^skipped (\d+) more malformed lines", stderr, re.MULTILINE)
    return listed + (int(more.group(1)) if more else 0)


def requests_in(stdout: str) -> int | None:
    match = re.search(r": ([\d,]+) requests \(", stdout)
    return int(match.group(1).replace(",", "")) if match else None


def _fuzz_trace(fmt: str, case, options) -> None:
    data, valid, _ = case
    skip, given_fmt, time_unit, no_check, block, with_json = options
    with workdir() as tmp:
        path = tmp / "trace.jsonl"
        path.write_bytes(data)
        argv = ["replay", str(path), "--policy", "saria", *FAST, "--chunk-tokens", "64", "--format", given_fmt,
                "--time-unit", time_unit]
        if block:
            argv += ["--block-tokens", "64"]
        if skip:
            argv.append("--skip-bad-lines")
        if no_check:
            argv.append("--no-time-check")
        outputs = []
        if with_json:
            outputs.append(Output(str(tmp / "out.json"), "json"))
            argv += ["--json", outputs[0].path]
        run = run_cli(argv)
        check(run, outputs, names=(str(path), path.name, "--chunk-tokens", "--block-tokens"))
        fits = given_fmt in ("auto", fmt) and (block or fmt == "tracelab")
        if valid and fits:
            if run.code != 0:
                raise ContractViolation("valid-trace-refused", f"a trace of valid lines only was refused\n"
                                                               f"{run.describe()}")
            if requests_in(run.stdout) != nonblank_lines(data):
                raise ContractViolation("lines-lost", f"{nonblank_lines(data)} valid lines, "
                                                      f"{requests_in(run.stdout)} requests\n{run.describe()}")
        if run.code == 0:
            if "SSD writes (GiB)" not in run.stdout:
                raise ContractViolation("no-table", f"exit 0 without the results table\n{run.describe()}")
            if skip and fits:
                loaded, skipped = requests_in(run.stdout), skipped_count(run.stderr)
                if loaded is None or loaded + skipped != nonblank_lines(data):
                    raise ContractViolation("lines-lost", f"{nonblank_lines(data)} non-blank lines, {loaded} "
                                                          f"requests + {skipped} skipped\n{run.describe()}")


trace_options = st.tuples(st.booleans(), st.sampled_from(["auto", "auto", "mooncake", "tracelab"]),
                          st.sampled_from(["ms", "ms", "s"]), st.booleans(), st.integers(0, 4).map(bool),
                          st.integers(0, 4).map(lambda x: x == 0))


@_settings(600)
@given(case=trace_file("mooncake"), options=trace_options)
def test_fuzz_mooncake_trace(case, options):
    _fuzz_trace("mooncake", case, options)


@_settings(400)
@given(case=trace_file("tracelab"), options=trace_options)
def test_fuzz_tracelab_trace(case, options):
    _fuzz_trace("tracelab", case, options)


# =================================================================================== argument fuzzing
def _actions_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command that runs, by its words: a subcommand with actions of its own is one command
    per action (``cluster start``)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for name, sub in (_actions_of(parser) or {}).items():
        words = f"{prefix} {name}".strip()
        found.update(_subparsers(sub, words) if _actions_of(sub) else {words: sub})
    return found


SUBPARSERS = _subparsers(build_parser())
COMMANDS = sorted(SUBPARSERS)
GROUPS = sorted({c.split()[0] for c in COMMANDS if " " in c})  # subcommands with actions: their own --help
assert COMMANDS, "saria has no subcommands?"


def options_of(command: str) -> list[argparse.Action]:
    return [a for a in SUBPARSERS[command]._actions if not isinstance(a, argparse._HelpAction)]


OUTPUT_KINDS = {"json": "json", "csv": "csv", "plot": "png", "out": "jsonl"}
PATH_DESTS = {"json", "csv", "plot", "out", "trace", "ssd_path"}


def is_output(command: str, action: argparse.Action) -> bool:
    return action.dest in OUTPUT_KINDS and action.nargs != 0


def output_kind(command: str, action: argparse.Action) -> str | None:
    """What a run may leave at the path this option names (a key file for ``saria keys``), or None."""
    if is_key_path(command, action):
        return "key"
    return OUTPUT_KINDS.get(action.dest) if is_output(command, action) else None


def is_key_path(command: str, action: argparse.Action) -> bool:
    """The key file of ``saria keys ACTION PATH``."""
    return command.startswith("keys ") and action.dest == "path"


# ---------------------------------------------------------------------------------------- values
EDGE_NUMBERS = ["0", "1", "2", "-1", "0.5", "1e-300", "1e308", "1e400", "-1e400", "inf", "-inf", "nan", "NaN",
                str(10**30), str(2**63), "99999999999999999999", "1e30", "-0", "1_000", "1,000", "0x10", " 3 ", "+2",
                "9" * 400, "9" * 5000, "1e-5", "5e-324"]
EDGE_WORDS = ["", " ", "none", "off", "auto", "x", "3TB", "1e12GiB", "800GiB", "0.5TB", "1,,2", ",", "0,", "none,none",
              "1,2,3", "3,2,1", "1,-1", "nan,1", "inf,2", "0,0", "é", "\u202e", "💥", "\udcff", "a\tb", "\n", "=",
              "saria", "synth", "1e12GiB", "-1TB", "0B", "1e400TB"]
unicode_text = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=16)

POLICY_KEYS = ["theta_E", "theta_R", "r", "p_tau_s", "prewrite", "prewrite_depth", "metadata_window_s", "lookup",
               "admit_all", "write_through", "use_ssd", "use_dram", "serial_loading", "unified_metadata",
               "write_budget", "name", "theta_X", ""]
POLICY_VALUES = ["0", "1", "3", "-1", "none", "nan", "inf", "1e308", "1e-300", "99999999999999999999", str(2**63),
                 "0.5", "true", "false", "auto", "off", "tier-prefix", "x", ""]


@st.composite
def policy_specs(draw) -> str:
    from saria.config import POLICY_PRESETS

    name = draw(st.sampled_from(list(POLICY_PRESETS) + ["sarai", "", "SARIA", "none"]))
    items = draw(st.lists(st.tuples(st.sampled_from(POLICY_KEYS), st.sampled_from(POLICY_VALUES)), max_size=3))
    if not items:
        return name
    return name + ":" + ",".join(f"{k}={v}" for k, v in items) + draw(st.sampled_from(["", ",", ",,"]))


SYNTH_KEYS = [f for f in SMALL_SYNTH] + ["interval_s", "interval_median_s", "output_tokens", "context_limit_tokens",
                                         "span_hours", "shared_prefix_tokens", "prefix_variants", "sesions", "",
                                         "block-tokens"]
SYNTH_VALUES = ["0", "1", "2", "-1", "1e30", "1e308", "inf", "nan", "x", "", str(10**30), "0.5", "64", "3000",
                "99999999999999999999", "1e-300", "2e9", str(2**64)]


@st.composite
def synth_specs(draw) -> str:
    """synth:key=value,... from SMALL_SYNTH with 1-3 keys changed, added, duplicated or broken."""
    items = list(SMALL_SYNTH.items())
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["set", "set", "add", "duplicate", "drop", "garbage"]))
        if how == "set":
            key = draw(st.sampled_from(SYNTH_KEYS))
            items = [(k, v) for k, v in items if k != key] + [(key, draw(st.sampled_from(SYNTH_VALUES)))]
        elif how == "add":
            items.append((draw(st.sampled_from(SYNTH_KEYS)), draw(st.sampled_from(SYNTH_VALUES))))
        elif how == "duplicate" and items:
            key, _ = draw(st.sampled_from(items))
            items.append((key, draw(st.sampled_from(SYNTH_VALUES))))
        elif how == "drop" and items:
            items.pop(draw(st.integers(0, len(items) - 1)))
        else:
            items.append((draw(st.sampled_from(["", "=", "x", "sessions"])), draw(unicode_text)))
    spec = ",".join(k if v is None else f"{k}={v}" for k, v in items)
    # ("synth:" alone is the full-size default trace: valid, and seconds to replay)
    return "synth:" + spec if draw(st.integers(0, 9)) else draw(st.sampled_from(["synth::", "synth:=", "synth:,,=1",
                                                                                "synth:sessions", "synth;sessions=2"]))


PATH_KINDS = ["fresh", "fresh", "existing", "missing-dir", "directory", "dev-full", "dev-null", "file-as-dir",
              "too-long", "empty", "unicode", "sys"] + ([] if os.geteuid() == 0 else ["read-only-dir"])
TRACE_PATH_KINDS = ["missing", "directory", "empty-file", "binary-file", "dev-null", "dev-zero", "file-as-dir",
                    "too-long", "empty", "tracelab", "good", "good", "unicode-good", "whitespace-file"]


@dataclass(frozen=True)
class PathValue:
    kind: str


@dataclass
class Materialized:
    text: str
    output: Output | None = None


def materialize_path(kind: str, tmp: Path, out_kind: str | None, name: str) -> Materialized:
    """Make the path ``kind`` in ``tmp``; ``out_kind``: the output it is for (None: an input)."""
    ext = {"json": ".json", "csv": ".csv", "png": ".png", "jsonl": ".jsonl"}.get(out_kind or "", "")
    special, before = kind, None
    if kind in ("fresh", "existing"):
        path, special = tmp / f"{name}{ext}", ""
        if kind == "existing":
            path.write_bytes(SENTINEL)
            before = SENTINEL
    elif kind == "unicode":
        path, special = tmp / f"résumé-💥-{name}{ext}", ""
    elif kind == "missing-dir":
        path = tmp / "no" / "such" / f"dir{ext}"
    elif kind == "directory":
        path = tmp / f"{name}-dir"
        path.mkdir()
    elif kind == "dev-full":
        path = Path("/dev/full")
    elif kind == "dev-null":
        path = Path("/dev/null")
    elif kind == "file-as-dir":
        (tmp / "plain").write_text("a file\n")
        path = tmp / "plain" / f"x{ext}"
    elif kind == "too-long":
        path = tmp / ("n" * 300 + ext)
    elif kind == "empty":
        return Materialized("", Output("", out_kind, special="empty") if out_kind else None)
    elif kind == "sys":
        path = Path("/sys") / f"saria-fuzz{ext}"
    elif kind == "read-only-dir":
        ro = tmp / "read-only"
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        path = ro / f"x{ext}"
    else:
        raise AssertionError(kind)
    existed = os.path.lexists(path)
    return Materialized(str(path), Output(str(path), out_kind, before, special, existed) if out_kind else None)


KEY_PATH_KINDS = ["key", "rotated-key", "key-0644", "key-symlink", "key-fifo", "key-malformed", "key-blocked-temp"]


def make_key_file(path: Path, rotations: int = 0) -> Path:
    from saria.seal import new_key_file, rotate_key_file

    new_key_file(path)
    for _ in range(rotations):
        rotate_key_file(path)
    return path


def materialize_key_path(kind: str, tmp: Path, name: str) -> Materialized:
    """A key file of ``kind`` (KEY_PATH_KINDS) in ``tmp``: valid (epoch 1; epochs 1 and 2), one that
    must be refused, or a valid one with a directory where rotate and retire wrote its new version
    before their temporary names were random (it must be left as it is)."""
    path = tmp / f"{name}.key"
    if kind == "key":
        make_key_file(path)
    elif kind == "rotated-key":
        make_key_file(path, rotations=1)
    elif kind == "key-0644":
        make_key_file(path).chmod(0o644)
    elif kind == "key-symlink":
        make_key_file(tmp / f"{name}-target.key")
        path.symlink_to(tmp / f"{name}-target.key")
    elif kind == "key-fifo":
        os.mkfifo(path, 0o400)
    elif kind == "key-blocked-temp":  # a valid key file with a directory at the fixed temporary name of old
        make_key_file(path, rotations=1)  # (.NAME.new): rotate and retire now write a random name past it
        (tmp / f".{path.name}.new").mkdir()
        (tmp / f".{path.name}.new" / "x").write_text("in the way\n")
    elif kind == "key-malformed":
        path.write_text('{"saria_keys": 1, "names": "00", "current": 1, "epochs": {}}\n')
        path.chmod(0o400)
    else:
        raise AssertionError(kind)
    before = path.read_bytes() if path.is_file() else None
    return Materialized(str(path), Output(str(path), "key", before, existed=True))


def materialize_trace(kind: str, tmp: Path) -> str:
    if kind in ("good", "unicode-good"):
        return str(write_lines(tmp / ("trace.jsonl" if kind == "good" else "трасса 💥.jsonl"), good_mooncake()))
    if kind == "tracelab":
        return str(write_lines(tmp / "rounds.jsonl", good_tracelab()))
    if kind == "missing":
        return str(tmp / "missing.jsonl")
    if kind == "directory":
        (tmp / "tracedir").mkdir(exist_ok=True)
        return str(tmp / "tracedir")
    if kind == "empty-file":
        (tmp / "empty.jsonl").write_bytes(b"")
        return str(tmp / "empty.jsonl")
    if kind == "whitespace-file":
        (tmp / "blank.jsonl").write_bytes(b"\n  \n\t\n")
        return str(tmp / "blank.jsonl")
    if kind == "binary-file":
        (tmp / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
        return str(tmp / "binary.jsonl")
    if kind == "dev-null":
        return "/dev/null"
    if kind == "dev-zero":
        return "/dev/zero"
    if kind == "file-as-dir":
        (tmp / "plain").write_text("a file\n")
        return str(tmp / "plain" / "x.jsonl")
    if kind == "too-long":
        return str(tmp / ("t" * 300))
    if kind == "empty":
        return ""
    raise AssertionError(kind)


# ------------------------------------------------------------------------ valid values and baselines
VALID = {
    ("*", "dram_tokens"): ["0", "2048", "4K", "1,000"], ("*", "ssd_tokens"): ["0", "8192", "16K"],
    ("*", "chunk_tokens"): ["64", "128"], ("*", "block_tokens"): ["64"], ("*", "checkpoint_tokens"): ["64", "16384"],
    ("*", "window_hours"): ["0.5", "12"], ("*", "seed"): ["0", "7"], ("*", "inflight"): ["1", "4"],
    ("*", "prefill_tps"): ["6500", "100"], ("*", "jobs"): ["1", "2"], ("*", "truncate_hours"): ["1", "0.01"],
    ("*", "dwpd"): ["1", "0.3"], ("*", "ssd_capacity"): ["1GB", "3.84TB", "800GiB"], ("*", "b_gpu"): ["48", "1"],
    ("*", "b_disk"): ["20", "0.5"], ("*", "b_dram"): ["48"], ("*", "b_disk_write"): ["5"], ("*", "drives"): ["1", "4"],
    ("sweep", "theta_e"): ["1,2", "none,2"], ("sweep", "theta_r"): ["4,none"], ("sweep", "r"): ["0,0.5,1", "none"],
    ("sweep", "windows"): ["0.5,1"], ("tune", "theta_e"): ["1,2,4", "1,2,none"], ("tune", "theta_r"): ["none,4"],
    ("synth", "sessions"): ["1", "3"], ("synth", "requests_per_session"): ["1", "2.5"],
    ("synth", "prompt_tokens"): ["2000", "5000"], ("synth", "first_prompt_tokens"): ["500", "1000"],
    ("synth", "interval_s"): ["112.1", "10"], ("synth", "interval_median_s"): ["8", "1"],
    ("synth", "output_tokens"): ["0", "500"], ("synth", "context_limit_tokens"): ["450000", "3000"],
    ("synth", "span_hours"): ["12", "0.5"], ("synth", "shared_prefix_tokens"): ["0", "256"],
    ("synth", "prefix_variants"): ["1", "2"], ("synth", "block_tokens"): ["64", "16"], ("synth", "seed"): ["0", "3"],
    ("roundtrip", "chunks"): ["1"], ("roundtrip", "chunk_tokens"): ["16", "32"],
    ("demo", "turns"): ["2", "3"], ("demo", "max_tokens"): ["1", "8"], ("demo", "max_prompt_tokens"): ["100", "3000"],
    ("demo", "dram_chunks"): ["1", "8"],
    ("replay", "replicas"): ["1", "3"], ("replay", "cluster_gb"): ["0", "1", "0.05"], ("replay", "cluster_gbps"): ["25"],
    ("doctor", "cluster"): ["127.0.0.1:1", "localhost:9"],  # nothing listens: refused at once, no client tried
    ("serve", "cluster"): ["10.0.0.1:50051", "master:50051"], ("serve", "cluster_host"): ["10.0.0.2", "node-1"],
    ("serve", "cluster_staging_gb"): ["0", "0.25"],
    ("cluster start", "node_gb"): ["0.05", "4", "0.015625"], ("cluster start", "host"): ["127.0.0.1", "localhost"],
    ("cluster start", "rpc_port"): ["50051", "40001"], ("cluster start", "metrics_port"): ["9003", "40002"],
    ("cluster start", "node_port"): ["50052", "40003"],
    ("keys retire", "epoch"): ["1", "2"],  # the baseline's key file: 1 retires, 2 is current (refused)
}
# Edge values that are valid but slow here (the roundtrip's Triton interpreter moves ~10 MB/s).
SLOW = {("roundtrip", "chunks"): lambda v: 2 < (_int_or_none(v) or 0) < 10**4,
        ("roundtrip", "chunk_tokens"): lambda v: 32 < (_int_or_none(v) or 0) < 10**6}


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def baseline(command: str, tmp: Path) -> tuple[list[str], dict[str, list[str]]]:
    """A fast, valid command line: (positionals, {option string: values after it})."""
    trace = str(write_lines(tmp / "trace.jsonl", good_mooncake()))
    common = {"--no-progress": [], "--jobs": ["1"], "--dram-tokens": ["2048"], "--ssd-tokens": ["8192"],
              "--block-tokens": ["64"], "--chunk-tokens": ["64"]}
    if command == "replay":
        return [trace], {"--policy": ["saria"], **common}
    if command == "sweep":
        return [trace], {"--theta-e": ["1,2"], **common}
    if command == "tune":
        return [trace], {"--dwpd": ["1"], "--ssd-capacity": ["1GB"], "--theta-e": ["1,2,none"],
                         "--theta-r": ["none,4"], **common}
    if command == "synth":
        return [str(tmp / "synth-out.jsonl")], {"--sessions": ["2"], "--requests-per-session": ["3"],
                                               "--prompt-tokens": ["2000"], "--first-prompt-tokens": ["1000"],
                                               "--block-tokens": ["64"]}
    if command == "roundtrip":
        return [], {"--chunks": ["1"], "--chunk-tokens": ["16"]}
    if command == "demo":
        return [], {"--turns": ["2"], "--max-tokens": ["1"]}
    if command == "doctor":
        return [], {}
    if command == "serve":  # a dry run: vLLM is never started here (--print-command wins over --vllm-help)
        return ["/models/m"], {"--print-command": []}
    if command == "cluster start":  # stops where Mooncake would start (the sentinel in run_cli)
        return [], {"--node-gb": ["0.05"]}
    if command == "keys new":
        return [str(tmp / "new.key")], {}
    if command in ("keys show", "keys rotate", "keys rekey"):
        return [str(make_key_file(tmp / "saria.key"))], {}
    if command == "keys retire":  # epochs 1 and 2, 2 current
        return [str(make_key_file(tmp / "saria.key", rotations=1))], {"--epoch": ["1"]}
    return [], {}  # a new command: its defaults


def value_strategy(command: str, action: argparse.Action):
    """Values to try for one option: edges and junk for all, plus its own valid and domain values."""
    if action.nargs == 0:
        return st.just(None)
    dest = action.dest
    pools = [st.sampled_from(EDGE_NUMBERS), st.sampled_from(EDGE_WORDS), unicode_text]
    valid = VALID.get((command, dest)) or VALID.get(("*", dest))
    if action.choices:
        valid = list(action.choices)
    if valid:
        pools += [st.sampled_from(valid)] * 3
    if dest in PATH_DESTS or (action.metavar in ("PATH", "DIR", "OUT")):
        kinds = TRACE_PATH_KINDS if dest == "trace" else PATH_KINDS
        pools += [st.sampled_from(kinds).map(PathValue)] * 4
    if is_key_path(command, action):
        pools += [st.sampled_from(KEY_PATH_KINDS).map(PathValue)] * 4
    if dest == "trace" and command != "demo":
        pools += [synth_specs()] * 3 + [st.just(SMALL_SPEC)]
    if dest in ("policy", "reference"):
        pools += [policy_specs()] * 3
    strategy = st.one_of(pools)
    slow = SLOW.get((command, dest))
    return strategy.filter(lambda v: not (slow and isinstance(v, str) and slow(v)))


@st.composite
def fuzzed_options(draw, command: str, count) -> list[tuple[argparse.Action, object, bool]]:
    actions = options_of(command)
    chosen = draw(st.lists(st.sampled_from(actions), min_size=min(count[0], len(actions)),
                           max_size=min(count[1], len(actions)), unique_by=lambda a: a.dest))
    return [(a, draw(value_strategy(command, a)), draw(st.booleans())) for a in chosen]


def build_argv(command: str, tmp: Path, fuzzed) -> tuple[list[str], list[Output], tuple[str, ...]]:
    """The baseline with the fuzzed options replaced; the outputs to check; the names an error
    about the fuzzed option may use."""
    positionals, options = baseline(command, tmp)
    pos_actions = [a for a in options_of(command) if not a.option_strings]
    outputs: list[Output] = []
    names: list[str] = []
    extra: list[str] = []
    uses_synth_trace = False
    texts: dict[str, object] = {}
    for i, (action, value, equals) in enumerate(fuzzed):
        out_kind = output_kind(command, action)
        if isinstance(value, PathValue):
            if action.dest == "trace":
                text = materialize_trace(value.kind, tmp)
            elif value.kind in KEY_PATH_KINDS:
                made = materialize_key_path(value.kind, tmp, f"{action.dest}{i}")
                text = made.text
                outputs.append(made.output)
            else:
                made = materialize_path(value.kind, tmp, out_kind, f"{action.dest}{i}")
                text = made.text
                if made.output is not None:
                    outputs.append(made.output)
        else:
            text = value
            if out_kind and isinstance(value, str):
                # a junk string used as an output path: keep it out of the cwd (an empty one stays empty)
                (tmp / f"o{i}").mkdir(exist_ok=True)  # one folder per option: two outputs never share a path
                text = str(tmp / f"o{i}" / value.replace("/", "_")) if value else ""
                outputs.append(Output(text, out_kind, existed=os.path.lexists(text) if text else False,
                                      special="" if text else "empty"))
        texts[action.dest] = text
        names += [*action.option_strings, action.dest, action.dest.replace("_", "-"), str(action.metavar or "")]
        if text is not None and len(str(text).strip()) >= 2:
            names.append(str(text).strip())
            if not str(text).isprintable():  # quoted where it would break the error's one line
                names.append(repr(str(text)))
        if action.dest in ("policy", "reference", "trace") and isinstance(text, str):
            # a spec's error may name the key at fault (Policy.theta_E must be from 1 to 1,000,000)
            keys = re.findall(r"[A-Za-z_][\w-]*(?==)", text)
            names += [f"Policy.{key}" for key in keys] + [key for key in keys if len(key) >= 2]
        if action.dest == "trace" and isinstance(text, str) and text.startswith("synth"):
            uses_synth_trace = True
        if not action.option_strings:
            positionals[pos_actions.index(action)] = text
            continue
        flag = action.option_strings[-1]
        for string in action.option_strings:
            options.pop(string, None)
        if action.nargs == 0:
            extra.append(flag)
        elif equals or text.startswith("-"):
            extra.append(f"{flag}={text}")
        else:
            extra += [flag, text]
    for action in options_of(command):  # an error about the trace file names the file: fine whatever the option
        if action.dest == "trace":
            names.append(str(positionals[pos_actions.index(action)]) if not action.option_strings
                         else str(texts.get(action.dest, action.default)))
    if command == "demo" and "trace" not in texts:  # its default trace
        names.append(str(getattr(saria.commands.demo, "DEFAULT_TRACE", "")))
    if command == "cluster start" and not mooncake_available():  # valid arguments end there, rightly
        names.append("Mooncake Store is not installed")
    if uses_synth_trace:  # a synth trace has its own block size (synth:block_tokens)
        options.pop("--block-tokens", None)
    if command == "synth" and not any(a.dest == "out" for a, _, _ in fuzzed):
        outputs.append(Output(positionals[0], "jsonl"))
    if command.startswith("keys ") and not any(a.dest == "path" for a, _, _ in fuzzed):
        path = Path(positionals[0])
        outputs.append(Output(str(path), "key", path.read_bytes() if path.exists() else None,
                              existed=path.exists()))
    argv = command.split()
    for flag, values in options.items():
        argv += [flag, *values]
    argv += extra
    if any(str(p).startswith("-") for p in positionals):
        argv.append("--")  # as a user passes a positional that looks like an option
    return argv + positionals, outputs, tuple(names)


def _fuzz_arguments(command: str, fuzzed, single: bool) -> None:
    with workdir() as tmp:
        argv, outputs, names = build_argv(command, tmp, fuzzed)
        keys = [o for o in outputs if o.kind == "key"]
        before = [_key_snapshot(o.path) for o in keys]
        run = run_cli(argv)
        check(run, outputs, names=names if single else ())
        for output, old in zip(keys, before):
            check_key_file(command, run, output, old, tmp)


def _key_snapshot(path: str):
    """The key file at ``path`` as saria loads it, or None where it would be refused."""
    from saria.seal import KeyFile, KeyFileError
    try:
        return KeyFile.load(path) if path else None
    except KeyFileError:
        return None


def _secrets(keys) -> list[str]:
    """Every key of a key file as it could be printed: hex (either case) and its first 8 bytes."""
    found = []
    for secret in (keys.names, *keys.epochs.values()):
        found += [secret.hex(), secret.hex().upper(), secret[:8].hex(), secret[:8].hex().upper()]
    return found


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # ENAMETOOLONG: Path.is_file lets it through
        return False


def check_key_file(command: str, run: Run, output: Output, old, tmp: Path) -> None:
    """``saria keys``'s contract on its key file (``old``: the file as loaded before the run, or
    None where it could not be): no key printed; ``show`` changes nothing; a success leaves the
    file as ``new``/``rotate``/``retire`` promise, and no temporary file beside it."""
    action = command.split()[1]
    new = _key_snapshot(output.path) if run.code == 0 else None
    printed = run.stdout + run.stderr
    for keys in (old, new):
        if keys is not None and any(secret in printed for secret in _secrets(keys)):
            raise ContractViolation("key-printed", f"a key of {output.path} was printed\n{run.describe()}")
    path = Path(output.path)
    if action == "show" and output.before is not None and path.read_bytes() != output.before:
        raise ContractViolation("show-changed", f"keys show changed {output.path}\n{run.describe()}")
    left = [p for p in path.parent.glob(f".{glob.escape(path.name)}.*new") if _is_file(p)] if output.path else []
    if left:  # (a directory at .NAME.new: key-blocked-temp, planted, not left by saria)
        raise ContractViolation("key-temp-left", f"keys {action} left {left[0].name} (keys) behind\n"
                                                 f"{run.describe()}")
    if run.code != 0:
        return
    if not path.resolve().is_relative_to(tmp.resolve()):
        raise ContractViolation("key-outside", f"a key file was written outside the temporary folder\n"
                                               f"{run.describe()}")
    mode = path.stat().st_mode & 0o777
    if mode != 0o400:
        raise ContractViolation("key-mode", f"{output.path} has mode {mode:04o} after keys {action}\n"
                                            f"{run.describe()}")
    if new is None:
        raise ContractViolation("key-unusable", f"{output.path} does not load after keys {action}\n"
                                                f"{run.describe()}")
    if action == "new":
        ok = old is None and not output.existed and new.current == 1 and list(new.epochs) == [1]
    elif action == "show":
        ok = new == old
    elif action == "rotate":
        ok = (old is not None and new.names == old.names and new.current == max(old.epochs) + 1
              and new.epochs == {**old.epochs, new.current: new.epochs[new.current]}
              and new.epochs[new.current] not in old.epochs.values())
    elif action == "rekey":
        ok = (old is not None and new.names != old.names and list(new.epochs) == [new.current]
              and new.current == (max(old.epochs) + 1 if max(old.epochs) < (1 << 32) - 1 else 1)
              and not {new.names, *new.epochs.values()} & {old.names, *old.epochs.values()})
    else:  # retire
        gone = set(old.epochs) - set(new.epochs) if old is not None else set()
        ok = (old is not None and new.names == old.names and new.current == old.current and len(gone) == 1
              and old.current not in gone and new.epochs == {e: k for e, k in old.epochs.items() if e not in gone})
    if not ok:
        raise ContractViolation("key-contents", f"keys {action} left {output.path} with epochs "
                                                f"{sorted(new.epochs)}, current {new.current} (before: {old!r})\n"
                                                f"{run.describe()}")


SINGLE_WEIGHT = {"replay": 300, "sweep": 200, "tune": 200, "synth": 250, "doctor": 30, "roundtrip": 8, "demo": 80,
                 "keys new": 40, "keys show": 40, "keys rotate": 40, "keys retire": 40, "keys rekey": 40}
COMBO_WEIGHT = {"replay": 200, "sweep": 120, "tune": 120, "synth": 150, "doctor": 15, "roundtrip": 4, "demo": 50,
                "keys show": 20, "keys retire": 30}
# commands with two or more options to combine (``keys new PATH`` and ``keys rotate PATH`` have one)
COMBINED = [c for c in COMMANDS if len(options_of(c)) >= 2]


def _arg_test(command: str, single: bool):
    weight = (SINGLE_WEIGHT if single else COMBO_WEIGHT).get(command, 30)

    @_settings(weight)
    @given(fuzzed=fuzzed_options(command, (1, 1) if single else (2, 4)))
    def test(fuzzed):
        _fuzz_arguments(command, fuzzed, single)

    return test


@pytest.mark.parametrize("command", COMMANDS)
def test_fuzz_one_argument(command):
    """One option of ``command`` replaced on a valid command line: exit 0 or 2, and an error
    names that option (or its value)."""
    _arg_test(command, single=True)()


@pytest.mark.parametrize("command", COMBINED)
def test_fuzz_several_arguments(command):
    _arg_test(command, single=False)()


@_settings(250)
@given(spec=synth_specs(), command=st.sampled_from(["replay", "sweep"]))
def test_fuzz_synth_trace_specs(spec, command):
    """``synth:key=value,...`` trace specs: duplicate, unknown and broken keys, edge values."""
    argv = [command, spec, "--policy", "saria", *FAST]
    if command == "sweep":
        argv += ["--theta-e", "1,2", "--reference", "none"]
    check(run_cli(argv), names=("synth", "--chunk-tokens"))  # (a block size that the default chunks do not fit)


# ============================================================================= explicit regressions
def _replay(trace, *extra):
    return ["replay", str(trace), "--policy", "saria", *FAST, *TRACE_OPTS, *extra]


@pytest.mark.parametrize("field_name", ["timestamp", "input_length", "output_length"])
@pytest.mark.parametrize("value", [10**309, 10**400, -10**309], ids=["1e309", "1e400", "-1e309"])
def test_mooncake_huge_integer_field(tmp_path, field_name, value):
    records = good_mooncake(6)
    bad = dict(records[2], **{field_name: value})
    path = tmp_path / "t.jsonl"
    path.write_text("".join((json.dumps(bad) if i == 2 else json.dumps(r)) + "\n" for i, r in enumerate(records)))
    run = run_cli(_replay(path))
    check(run, names=(f"{path}:3",))
    assert run.code == 2, run.describe()
    run = run_cli(_replay(path, "--skip-bad-lines"))
    check(run)
    assert run.code == 0, run.describe()
    assert f"skipped {path}:3:" in run.stderr and requests_in(run.stdout) == 5, run.describe()


@pytest.mark.parametrize("tokens", [10**309, 100000000000, 10**30], ids=["1e309", "1e11", "1e30"])
def test_tracelab_huge_round_is_refused_quickly(tmp_path, tokens):
    """A TraceLab round of absurd length: a clear error naming the line, in bounded time and memory
    (run_cli gives the run RUN_MEMORY of data segment)."""
    records = good_tracelab(6)
    records[3] = dict(records[3], input_tokens_total=tokens)
    path = write_lines(tmp_path / "rounds.jsonl", records)
    run = run_cli(["replay", str(path), "--policy", "saria", *FAST, "--chunk-tokens", "64"], timeout=20)
    check(run, names=(f"{path}:4",))
    assert run.code == 2, run.describe()
    run = run_cli(["replay", str(path), "--policy", "saria", *FAST, "--chunk-tokens", "64", "--skip-bad-lines"],
                  timeout=20)
    check(run)
    assert run.code == 0 and requests_in(run.stdout) == 5, run.describe()


def test_synth_spec_huge_requests_per_session():
    run = run_cli(["replay", "synth:sessions=2,requests_per_session=1e30", "--policy", "saria", *FAST])
    check(run, names=("requests_per_session",))


@pytest.mark.parametrize("spec", ["synth:sessions=2,sessions=3", "synth:sessions=2,prompt_tokens=2000,sessions=2"])
def test_synth_spec_duplicate_key_is_refused(spec):
    run = run_cli(["replay", spec, "--policy", "saria", *FAST])
    check(run, names=("sessions",))
    assert run.code == 2, run.describe()


@pytest.mark.parametrize("option, value", [("--span-hours", "inf"), ("--span-hours", "nan"),
                                           ("--interval-s", "inf"), ("--prompt-tokens", "nan"),
                                           ("--requests-per-session", "1e30")])
def test_synth_command_refuses_nonfinite(tmp_path, option, value):
    out = tmp_path / "out.jsonl"
    run = run_cli(["synth", str(out), "--sessions", "2", "--prompt-tokens", "2000", "--first-prompt-tokens", "1000",
                   option, value])
    check(run, [Output(str(out), "jsonl")], names=(option, option[2:].replace("-", "_")))
    if option != "--requests-per-session":
        assert run.code == 2 and not out.exists(), run.describe()


@pytest.mark.parametrize("dwpd", ["1e-300", "5e-324", "1e-30"])
def test_write_budget_auto_with_tiny_dwpd(dwpd):
    """The governor's rate error is ~1e300 for such a budget: no OverflowError (sessions spread
    over 48 h, so that it runs long enough to step)."""
    run = run_cli(["replay", LONG_SPEC, "--dram-tokens", "2048", "--ssd-tokens", "20000", "--window-hours", "48",
                   "--no-progress", "--jobs", "1", "--policy", "saria", "--write-budget", "auto", "--dwpd", dwpd])
    check(run, names=("--dwpd",))


@pytest.mark.parametrize("depth", ["99999999999999999999", str(2**31), "1e30", "nan", "-1"])
def test_policy_override_out_of_range_is_refused_up_front(tmp_path, depth):
    path = write_lines(tmp_path / "t.jsonl", good_mooncake())
    run = run_cli(["replay", str(path), "--policy", f"saria:prewrite_depth={depth}", *FAST, *TRACE_OPTS])
    check(run, names=("prewrite_depth",))
    assert run.code == 2 and "SSD writes (GiB)" not in run.stdout and "trace " not in run.stdout, run.describe()


@pytest.mark.parametrize("windows", ["0", "-1", "nan", "inf", "0,1", "1e-300"])
def test_sweep_bad_windows_are_refused(tmp_path, windows):
    path = write_lines(tmp_path / "t.jsonl", good_mooncake())
    run = run_cli(["sweep", str(path), "--windows", windows, *FAST, *TRACE_OPTS])
    check(run, names=("--windows", "window"))
    if windows != "1e-300":
        assert run.code == 2, run.describe()



def _command_line(command: str, tmp: Path, option: str, path: str) -> list[str]:
    trace = str(write_lines(tmp / "trace.jsonl", good_mooncake()))
    if command == "replay":
        return _replay(trace, option, path)
    if command == "sweep":
        return ["sweep", trace, "--theta-e", "1,2", *FAST, *TRACE_OPTS, option, path]
    if command == "tune":
        return ["tune", trace, "--dwpd", "1", "--ssd-capacity", "1GB", "--theta-e", "1,2,none", *FAST, *TRACE_OPTS,
                option, path]
    if command == "roundtrip":
        return ["roundtrip", "--chunk-tokens", "16", option, path]
    raise AssertionError(command)


UNWRITABLE = ["missing-dir", "directory", "dev-full", "file-as-dir", "too-long", "sys", "empty"]
OUTPUT_OPTIONS = [(c, o) for c in ("replay", "sweep", "tune") for o in ("--json", "--csv")] + [
    ("replay", "--plot"), ("sweep", "--plot"), ("roundtrip", "--json")]


@pytest.mark.parametrize("kind", UNWRITABLE)
@pytest.mark.parametrize("command, option", OUTPUT_OPTIONS, ids=[f"{c}{o}" for c, o in OUTPUT_OPTIONS])
def test_unwritable_output_fails_before_the_work(tmp_path, command, option, kind):
    out_kind = OUTPUT_KINDS[option[2:]]
    made = materialize_path(kind, tmp_path, out_kind, "out")
    run = run_cli(_command_line(command, tmp_path, option, made.text))
    check(run, [made.output], names=(option, made.text) if made.text else (option,))
    assert run.code == 2, run.describe()
    assert WORK_DONE[command] not in run.stdout, f"the work ran before the output path was checked\n{run.describe()}"


@contextlib.contextmanager
def spy_on_synthesize():
    """Counts calls of saria.replay.synth.synthesize, wherever a module imported it by name: the
    work ``saria synth`` does before it writes."""
    import sys

    from saria.replay import synth

    real, calls = synth.synthesize, []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("saria") and getattr(module, "synthesize", None) is real:
                stack.enter_context(mock.patch.object(module, "synthesize", spy))
        yield calls


@pytest.mark.parametrize("kind", UNWRITABLE)
def test_synth_unwritable_out_fails_before_the_work(tmp_path, kind):
    made = materialize_path(kind, tmp_path, "jsonl", "out")
    with spy_on_synthesize() as calls:
        run = run_cli(["synth", made.text, "--sessions", "3"])
    check(run, [made.output], names=(made.text,) if made.text else ("OUT", "out"))
    assert run.code == 2, run.describe()
    assert not calls, f"the trace was generated before the output path was refused\n{run.describe()}"


@pytest.mark.parametrize("command, option", OUTPUT_OPTIONS + [("synth", "OUT")],
                         ids=[f"{c}{o}" for c, o in OUTPUT_OPTIONS] + ["synthOUT"])
def test_failed_run_leaves_existing_output_untouched(tmp_path, command, option):
    """A run that fails (here: a bad --chunk-tokens / --sessions given with a good output path)
    leaves a pre-existing output file as it was."""
    out_kind = "jsonl" if option == "OUT" else OUTPUT_KINDS[option[2:]]
    made = materialize_path("existing", tmp_path, out_kind, "out")
    if command == "synth":
        argv = ["synth", made.text, "--sessions", "0"]
    else:
        argv = _command_line(command, tmp_path, option, made.text) + ["--chunk-tokens", "100"]
    run = run_cli(argv)
    check(run, [made.output])
    assert run.code == 2, run.describe()


@pytest.mark.parametrize("command, option", OUTPUT_OPTIONS + [("synth", "OUT")],
                         ids=[f"{c}{o}" for c, o in OUTPUT_OPTIONS] + ["synthOUT"])
def test_successful_run_replaces_existing_output(tmp_path, command, option):
    out_kind = "jsonl" if option == "OUT" else OUTPUT_KINDS[option[2:]]
    made = materialize_path("existing", tmp_path, out_kind, "out")
    if command == "synth":
        argv = ["synth", made.text, "--sessions", "2", "--prompt-tokens", "2000", "--first-prompt-tokens", "1000"]
    else:
        argv = _command_line(command, tmp_path, option, made.text)
    run = run_cli(argv)
    check(run, [made.output])
    assert run.code == 0, run.describe()


@pytest.mark.parametrize("option, value", [("--turns", "1"), ("--turns", "-1"), ("--max-tokens", "0"),
                                           ("--max-tokens", "-1"), ("--max-prompt-tokens", "0"),
                                           ("--dram-chunks", "0"), ("--dram-chunks", "-1"), ("--policy", "sarai"),
                                           ("--policy", "saria:theta_E=0"), ("--json", "/nonexistent/dir/x.json"),
                                           ("--json", "/dev/full"), ("--json", ""), ("--trace", "DIR"),
                                           ("--trace", "BINARY"), ("--trace", ""), ("--trace", "/dev/zero"),
                                           ("--trace", "LONG"), ("--turns", str(10**30)),
                                           ("--turns", "99999999999999999999 --trace MISSING")])
def test_demo_refuses_bad_arguments_before_starting(tmp_path, option, value):
    """Every bad demo argument is refused before the model is built and vLLM started (the
    sentinel in run_cli stands in for both)."""
    extra = []
    if value == "DIR":
        value = str(tmp_path)
    elif value == "BINARY":
        (tmp_path / "b.jsonl").write_bytes(bytes(range(256)))
        value = str(tmp_path / "b.jsonl")
    elif value == "LONG":
        value = str(tmp_path / ("t" * 300))
    elif value.endswith(" --trace MISSING"):  # no trace: the demo generates a session of --turns turns
        value, extra = value.split()[0], ["--trace", str(tmp_path / "missing.jsonl")]
    run = run_cli(["demo", option, value, *extra])
    check(run, names=(option, option[2:].replace("-", "_"), value))
    assert run.code == 2, f"demo {option} {value}: not refused before starting vLLM\n{run.describe()}"


# Found by the fuzz tests above, pinned so that they do not depend on a lucky draw. TRACE: a valid
# Mooncake trace (64-token blocks), OUT: a fresh output path, TMP: the test's folder.
def _found(id_, argv, names=(), refused=True):
    """One reproducer: ``names``, one of which the error must contain; ``refused``: must exit 2."""
    return pytest.param(argv, tuple(names), refused, id=id_)


REPLAY = ["replay", "TRACE", *FAST, *TRACE_OPTS]
SWEEP = ["sweep", "TRACE", *FAST, *TRACE_OPTS, "--theta-e", "1,2"]
TUNE = ["tune", "TRACE", *FAST, *TRACE_OPTS, "--dwpd", "1", "--ssd-capacity", "1GB", "--theta-e", "1,2,none"]
SYNTH = ["synth", "OUT", "--sessions", "2", "--prompt-tokens", "2000", "--first-prompt-tokens", "1000"]
SPEC = "synth:sessions=2,prompt_tokens=2000,first_prompt_tokens=1000"
FOUND = [
    _found("replay-ssd-tokens-1e308", [*REPLAY, "--policy", "saria", "--ssd-tokens", "1e308"], ["--ssd-tokens"], False),
    _found("replay-dram-tokens-1e308", [*REPLAY, "--policy", "saria", "--dram-tokens", "1e308"], ["--dram-tokens"],
           False),
    _found("sweep-ssd-tokens-1e308", [*SWEEP, "--ssd-tokens", "1e308"], ["--ssd-tokens"], False),
    _found("sweep-theta-r-400-digits", [*SWEEP, "--theta-r", "9" * 400], ["--theta-r", "theta_r"], False),
    _found("sweep-theta-e-400-digits", [*SWEEP, "--theta-e", "9" * 400], ["--theta-e", "theta_e"], False),
    _found("replay-drives-400-digits", [*REPLAY, "--policy", "zero-promotion", "--drives", "9" * 400], ["--drives"],
           False),
    _found("synth-interval-median-5e-324", [*SYNTH, "--interval-s", "10", "--interval-median-s", "5e-324"],
           ["--interval-median-s", "interval_median_s"], False),
    _found("synth-interval-median-1e-300", [*SYNTH, "--interval-median-s", "1e-300"],
           ["--interval-median-s", "interval_median_s"], False),
    _found("roundtrip-chunks-400-digits", ["roundtrip", "--chunk-tokens", "16", "--chunks", "9" * 400], ["--chunks"]),
    _found("roundtrip-chunk-tokens-1e30", ["roundtrip", "--chunk-tokens", str(10**30)], ["--chunk-tokens"]),
    _found("roundtrip-chunks-1e30", ["roundtrip", "--chunks", str(10**30), "--chunk-tokens", "16"], ["--chunks"]),
    _found("synth-sessions-1e20", ["synth", "OUT", "--sessions", "99999999999999999999"], ["--sessions", "sessions"]),
    _found("synth-prompt-tokens-5000-digits", ["synth", "OUT", "--sessions", "2", "--prompt-tokens", "9" * 5000],
           ["--prompt-tokens", "prompt_tokens"]),
    _found("synth-shared-prefix-400-digits", ["synth", "OUT", "--sessions", "2", "--shared-prefix-tokens", "9" * 400],
           ["--shared-prefix-tokens", "shared_prefix_tokens"]),
    _found("synth-output-tokens-nan", ["synth", "OUT", "--sessions", "2", "--output-tokens", "nan"],
           ["--output-tokens", "output_tokens"]),
    _found("synth-context-limit-1", [*SYNTH, "--context-limit-tokens", "1"],
           ["--context-limit-tokens", "context_limit_tokens"]),
    _found("tune-b-gpu-5e-324", [*TUNE, "--b-gpu", "5e-324"], ["--b-gpu"]),
    _found("replay-trace-name-too-long", ["replay", "TMP/" + "t" * 300, *FAST, "--policy", "saria"], ["t" * 300]),
    _found("replay-trace-400-digits", ["replay", "9" * 400, *FAST, "--policy", "saria"], ["9" * 400]),
    _found("sweep-trace-name-with-a-newline", ["sweep", "\n0", *FAST, *TRACE_OPTS, "--theta-e", "1,2"], ["'\\n0'"]),
    _found("sweep-reference-empty", [*SWEEP, "--reference", ""], ["--reference"]),
    _found("synthspec-requests-per-session-inf", ["replay", f"{SPEC},requests_per_session=inf", *FAST, "--policy",
                                                   "saria"], ["requests_per_session"]),
    _found("synthspec-sessions-2e64", ["replay", f"{SPEC},sessions=18446744073709551616", *FAST, "--policy", "saria"],
           ["sessions"]),
    _found("synthspec-block-tokens-2e64", ["replay", f"{SPEC},block_tokens=18446744073709551616", *FAST, "--policy",
                                            "saria"], ["block_tokens"]),
    _found("replay-plot-no-extension", [*REPLAY, "--policy", "saria", "--plot", "TMP/no-extension"], ["--plot"], False),
    _found("replay-plot-bad-extension", [*REPLAY, "--policy", "saria", "--plot", "TMP/plot.5"], ["--plot"]),
    _found("replay-json-empty", [*REPLAY, "--policy", "saria", "--json", ""], ["--json"]),
    # Path("") is the current folder: "key file . is not a regular file" named no argument
    _found("keys-new-path-empty", ["keys", "new", ""], ["PATH"]),
    _found("keys-show-path-empty", ["keys", "show", ""], ["PATH"]),
    _found("keys-rotate-path-with-a-newline", ["keys", "rotate", "TMP/\n0"], ["\\n0'"]),
    _found("keys-new-path-with-an-escape", ["keys", "new", "TMP/no/\x1b"], ["\\x1b'"]),
    _found("roundtrip-json-empty", ["roundtrip", "--chunk-tokens", "16", "--json", ""], ["--json"]),
    # no reloads (no DRAM), so no transfer times: null in the JSON, not NaN (which is not JSON)
    _found("sweep-json-nan", [*SWEEP, "--dram-tokens", "0", "--json", "TMP/s.json"], refused=False),
    _found("tune-json-nan", [*TUNE, "--dram-tokens", "0", "--json", "TMP/t.json"], refused=False),
    _found("replay-json-nan", [*REPLAY, "--policy", "saria", "--dram-tokens", "0", "--json", "TMP/r.json"],
           refused=False),
]


@pytest.mark.parametrize("argv, names, refused", FOUND)
def test_found_by_fuzzing(tmp_path, argv, names, refused):
    trace = write_lines(tmp_path / "trace.jsonl", good_mooncake())
    out = tmp_path / "out.jsonl"
    argv = [str(trace) if a == "TRACE" else str(out) if a == "OUT" else a.replace("TMP/", f"{tmp_path}/")
            for a in argv]
    outputs = [Output(str(out), "jsonl")] if "synth" == argv[0] else []
    for flag, kind in (("--json", "json"), ("--csv", "csv"), ("--plot", "png")):
        if flag in argv:
            path = argv[argv.index(flag) + 1]
            outputs.append(Output(path, kind, special="" if path else "empty"))
    run = run_cli(argv)
    check(run, outputs, names=names)
    if refused:
        assert run.code == 2, run.describe()


@pytest.mark.parametrize("action", [["rotate"], ["retire", "--epoch", "1"], ["rekey"]],
                         ids=["rotate", "retire", "rekey"])
def test_keys_replace_a_key_file_past_something_planted_at_the_old_temporary_name(tmp_path, action):
    """A directory at ``.NAME.new``, where ``rotate``/``retire`` once wrote the key file's new version
    (found by the fuzz: an IsADirectoryError escaped; then it blocked every rotation): the new
    version now goes through a random name of its own, so the rotation works and what was planted
    is left as it was (docs/security.md, "Files on the box")."""
    made = materialize_key_path("key-blocked-temp", tmp_path, "k")
    old = _key_snapshot(made.text)
    run = run_cli(["keys", action[0], made.text, *action[1:]])
    check(run, [Output(made.text, "key")])
    assert run.code == 0, run.describe()
    check_key_file(f"keys {action[0]}", run, made.output, old, tmp_path)
    assert (tmp_path / ".k.key.new" / "x").read_text() == "in the way\n"


# ================================================================================== harness sanity
@pytest.mark.parametrize("command", COMMANDS + GROUPS + [None])
def test_help_exits_zero_on_stdout(command):
    run = run_cli((command.split() if command else []) + ["--help"])
    assert run.escaped is None and run.code == 0, run.describe()
    assert run.stdout.startswith("usage:") and not run.stderr, run.describe()


@pytest.mark.parametrize("command", COMMANDS)
def test_baseline_command_lines_succeed(tmp_path, command):
    """The command lines the fuzz starts from are valid and complete: failures there are real."""
    argv, outputs, _ = build_argv(command, tmp_path, [])
    if command == "demo":
        run = run_cli(argv)
        assert run.code == "started", run.describe()  # past its checks; vLLM is not started here
        return
    if command == "cluster start":
        run = run_cli(argv)
        if mooncake_available():
            assert run.code == "started", run.describe()  # past its checks; Mooncake is not started here
        else:
            check(run, names=("Mooncake Store is not installed",))
            assert run.code == 2, run.describe()
        return
    for action in options_of(command):
        if is_output(command, action) and action.option_strings:
            made = materialize_path("fresh", tmp_path, OUTPUT_KINDS[action.dest], action.dest)
            argv += [action.option_strings[-1], made.text]
            outputs.append(made.output)
    run = run_cli(argv)
    check(run, outputs)
    assert run.code == 0, run.describe()
    for output in outputs:
        assert not _validate(output, run.stdout), _validate(output, run.stdout)


def test_harness_reports_escaped_exceptions_and_timeouts(monkeypatch):
    def boom(argv=None):
        raise OverflowError("boom")

    monkeypatch.setattr(saria.commands.cli, "main", boom)
    run = run_cli(["replay", "x"])
    assert isinstance(run.escaped, OverflowError) and "boom" in run.escaped_tb
    with pytest.raises(OverflowError):
        check(run)

    def slow(argv=None):
        while True:
            pass

    monkeypatch.setattr(saria.commands.cli, "main", slow)
    run = run_cli(["replay", "x"], timeout=0.2)
    assert isinstance(run.escaped, RunTimeout)
    with pytest.raises(ContractViolation, match="timeout"):
        check(run)


def test_runs_leave_the_starting_folder_alone(tmp_path, monkeypatch):
    """A fuzzed folder option is a relative path a run may create (``cluster start --logdir 0`` makes ``0``):
    the harness runs every command in a scratch folder, so a fuzz run never litters the checkout it runs in."""
    start = tmp_path / "start"
    start.mkdir()
    monkeypatch.chdir(start)
    argv, _, _ = build_argv("cluster start", tmp_path, [])
    run = run_cli([*argv, "--logdir", "made-by-the-run"])
    assert run.escaped is None, run.describe()
    assert os.listdir(start) == [], run.describe()
