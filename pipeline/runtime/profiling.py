"""The cpu model's operator profile while `trtpipe profile` captures (pipeline/spans.py: the capture file).

`TorchCapture.poll()`, called by the served model before every step and while it waits for requests, starts
torch's profiler when the capture file appears and, when it goes, writes what the profiler saw into the profile
directory: `torch-PID.json` (a Chrome trace: torch's operators inside trtpipe's stage ranges, which
`spans.range_hook` opens as `record_function` ranges meanwhile) and `ops-PID.json` (each operator's self time and
calls, for the top-operators table), then `torch-PID.done`, which tells `trtpipe profile` the files are complete.
`torch-PID.started` says the profiler runs: starting it takes seconds (kineto's set-up), which `trtpipe profile`
waits out before its load, so the first request is not delayed by it.
"""

from __future__ import annotations

import json
import os

from .. import spans

TRACE_PREFIX, OPS_PREFIX, STARTED_SUFFIX, DONE_SUFFIX = "torch-", "ops-", ".started", ".done"


class TorchCapture:
    def __init__(self):
        self.directory = spans.profile_directory()
        self.profiler = None

    def poll(self) -> None:
        if self.directory is None:
            return
        wanted = spans.capturing()
        if wanted and self.profiler is None:
            self.start()
        elif not wanted and self.profiler is not None:
            self.finish()

    def start(self) -> None:
        import torch.profiler

        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()
        spans.range_hook = torch.profiler.record_function
        open(os.path.join(self.directory, f"{TRACE_PREFIX}{os.getpid()}{STARTED_SUFFIX}"), "w").close()

    def finish(self) -> None:
        spans.range_hook = None
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        pid = os.getpid()
        profiler.export_chrome_trace(os.path.join(self.directory, f"{TRACE_PREFIX}{pid}.json"))
        ops = [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total, "cpu_us": e.cpu_time_total}
               for e in profiler.key_averages()]
        with open(os.path.join(self.directory, f"{OPS_PREFIX}{pid}.json"), "w") as f:
            json.dump(ops, f)
        open(os.path.join(self.directory, f"{TRACE_PREFIX}{pid}{DONE_SUFFIX}"), "w").close()
