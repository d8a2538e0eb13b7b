#!/usr/bin/env python3
"""Run a script, or pytest, with a non-default current CUDA stream set first, as vLLM does
(its GPU model runner makes its own stream current on the worker's thread before the first
forward): saria's hooks and copies must then order themselves against that stream, never against
the legacy default one.

    python bench/gpu_stream.py SCRIPT [ARG ...]        # SCRIPT runs as __main__ with the stream set
    python -m pytest -p gpu_stream ...                 # (bench/ on PYTHONPATH) the same for a test run

Where CUDA is not available the runner refuses in one line (exit 2) and the pytest plugin does
nothing (tests that need CUDA skip themselves).
"""

from __future__ import annotations

import runpy
import sys


def set_stream() -> bool:
    """Make a fresh stream current on this thread for the current device; False without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return False
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    assert torch.cuda.current_stream() == stream and stream != torch.cuda.default_stream()
    return True


def pytest_configure(config) -> None:  # the pytest plugin (-p gpu_stream)
    if set_stream():
        print("gpu_stream: tests run with a non-default current CUDA stream", file=sys.stderr)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python bench/gpu_stream.py SCRIPT [ARG ...]", file=sys.stderr)
        return 2
    if not set_stream():
        print("gpu_stream: needs CUDA (no CUDA device here); nothing run", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    sys.path.insert(0, str(__import__("pathlib").Path(argv[0]).resolve().parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
