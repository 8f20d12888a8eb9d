"""The cores a server and its load generator keep busy during a load, read from /proc (Linux).

A served step on a small machine shares its cores with everything that carries the tokens to the client: the
server's own processes (for Triton: tritonserver and every Python model's stub) and the load generator's. A
`CoreSampler` reads every process's CPU time (utime + stime of /proc/PID/stat) every `interval` seconds in a
thread while its block runs, and `cores` splits the CPU used between two instants into the server's busiest process
(the one computing the model: Triton's tensorrt_llm stub, vLLM's engine core), the rest of the server (its process
group: both servers here are started in a session of their own) and the client (every other descendant of this
process: aiperf and the processes it starts). A process counts from its first sample in the window to its last.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    ppid: int
    group: int
    cpu_s: float


def read_processes() -> dict[int, Proc]:
    """pid -> its parent, process group and CPU seconds so far, for every process /proc shows now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:     # gone since the listing
            continue
        # pid (comm) state ppid pgrp ... utime stime: comm may hold spaces and parentheses, so split after its ')'
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(entry.name)] = Proc(int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / TICKS)
    return found


def descends_from(pid: int, ancestor: int, processes: dict[int, Proc]) -> bool:
    seen = set()
    while pid in processes and pid not in seen:
        if pid == ancestor:
            return True
        seen.add(pid)
        pid = processes[pid].ppid
    return False


@dataclass(frozen=True)
class CoreShare:
    """Cores busy on average in a window."""

    model: float    # the server's busiest process
    server: float   # the server's other processes
    client: float


class CoreSampler:
    """Samples every process's CPU time while the `with` block runs (see the module's docstring)."""

    def __init__(self, server_group: int, interval: float = 0.5):
        self.server_group, self.interval = server_group, interval
        self.samples: list[tuple[float, dict[int, Proc]]] = []   # (time.time(), processes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-sampler", daemon=True)

    def __enter__(self) -> CoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), read_processes()))
            if self._stop.wait(self.interval):
                self.samples.append((time.time(), read_processes()))
                return

    def cores(self, start: float, end: float) -> CoreShare | None:
        """The cores the server and the client kept busy between two time.time() instants (None: fewer than two
        samples between them)."""
        inside = [(t, procs) for t, procs in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        me = os.getpid()
        first: dict[int, tuple[float, float]] = {}
        last: dict[int, tuple[float, float, str]] = {}
        for t, procs in inside:
            for pid, proc in procs.items():
                if proc.group == self.server_group:
                    side = "server"
                elif pid != me and descends_from(pid, me, procs):
                    side = "client"
                else:
                    continue
                first.setdefault(pid, (t, proc.cpu_s))
                last[pid] = (t, proc.cpu_s, side)
        used = {pid: (side, cpu_s - first[pid][1]) for pid, (_, cpu_s, side) in last.items()}
        server = sorted((cpu for side, cpu in used.values() if side == "server"), reverse=True) or [0.0]
        client = sum(cpu for side, cpu in used.values() if side == "client")
        span = inside[-1][0] - inside[0][0]
        return CoreShare(server[0] / span, sum(server[1:]) / span, client / span)
