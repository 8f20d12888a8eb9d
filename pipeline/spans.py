"""Named ranges around the stages of a request, for Nsight Systems (NVTX) and for `trtpipe profile` (a trace file).

trtpipe's served models open a range per stage: preprocessing `tokenize`, the cpu model `schedule`, `forward`,
`sample`, postprocessing `detokenize`. Each range is
- an NVTX range in the `trtpipe` domain through the `nvtx` package, a no-op unless a tool (nsys) is attached, and
  skipped when the package is absent or `TRTPIPE_NVTX=0` (the overhead benchmark's baseline);
- while `TRTPIPE_PROFILE_DIR` names a directory (`trtpipe profile` sets it in the server's environment) and the
  capture file `DIR/capturing` exists, a Chrome trace event appended to `DIR/spans-PID.jsonl` (wall-clock
  microseconds, so the processes' events share one time line with torch's profiler);
- with a `range_hook` set (the cpu model sets torch.profiler.record_function while it profiles), a range of that
  tool too, so torch's trace shows the stages around its operators.
Standard library only: copied beside trtpipe's model.py files (`pipeline.package_data.MODEL_SUPPORT_FILES`).
"""

from __future__ import annotations

import json
import os
import threading
import time

PROFILE_DIR_ENV = "TRTPIPE_PROFILE_DIR"
NVTX_ENV = "TRTPIPE_NVTX"
DOMAIN = "trtpipe"
#: the file whose presence in the profile directory means "record now" (trtpipe profile creates and removes it)
CAPTURE_FILE = "capturing"
SPANS_PREFIX = "spans-"
#: how often a recorder looks for the capture file (a stat per range would cost more than the range)
CAPTURE_POLL_S = 0.05


def _nvtx_domain():
    if os.environ.get(NVTX_ENV, "1") == "0":
        return None
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.get_domain(DOMAIN)


class _Recorder:
    """Appends the ranges of this process to DIR/spans-PID.jsonl while DIR/capturing exists."""

    def __init__(self, directory: str):
        self.directory = directory
        self.capture = os.path.join(directory, CAPTURE_FILE)
        self.lock = threading.Lock()
        self.file = None
        self.checked, self.active = 0.0, False

    def capturing(self) -> bool:
        now = time.monotonic()
        if now - self.checked > CAPTURE_POLL_S:
            self.checked, self.active = now, os.path.exists(self.capture)
        return self.active

    def write(self, name: str, start_ns: int, end_ns: int, args: dict) -> None:
        event = {"name": name, "cat": DOMAIN, "ph": "X", "ts": start_ns / 1000, "dur": (end_ns - start_ns) / 1000,
                 "pid": os.getpid(), "tid": threading.get_native_id(), "args": args}
        line = json.dumps(event) + "\n"
        with self.lock:
            if self.file is None:
                self.file = open(os.path.join(self.directory, f"{SPANS_PREFIX}{os.getpid()}.jsonl"), "a",
                                 buffering=1)
            self.file.write(line)


_domain = _nvtx_domain()
_recorder = _Recorder(os.environ[PROFILE_DIR_ENV]) if os.environ.get(PROFILE_DIR_ENV) else None
#: a callable NAME -> context manager entered with every range (torch.profiler.record_function while profiling)
range_hook = None


class _Span:
    __slots__ = ("name", "args", "start", "nvtx", "hooked")

    def __init__(self, name: str, args: dict):
        self.name, self.args = name, args

    def __enter__(self):
        self.nvtx = _domain.start_range(_domain.get_event_attributes(message=self.name)) if _domain else None
        self.hooked = range_hook(self.name) if range_hook is not None else None
        if self.hooked is not None:
            self.hooked.__enter__()
        self.start = time.time_ns()
        return self

    def __exit__(self, *exc):
        end = time.time_ns()
        if self.hooked is not None:
            self.hooked.__exit__(*exc)
        if self.nvtx is not None:
            _domain.end_range(self.nvtx)
        if _recorder is not None and _recorder.capturing():
            _recorder.write(self.name, self.start, end, self.args)
        return False


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SPAN = _NoSpan()


def span(name: str, **args):
    """A range named NAME around a `with` block (ARGS go into the trace event: request ids, batch rows)."""
    if _domain is None and _recorder is None and range_hook is None:
        return _NO_SPAN
    return _Span(name, args)


def profile_directory() -> str | None:
    """The directory `trtpipe profile` records into (None when the server is not being profiled)."""
    return _recorder.directory if _recorder else None


def capturing() -> bool:
    return _recorder is not None and _recorder.capturing()
