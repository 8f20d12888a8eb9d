"""What a load window cost: energy per output token, mean and idle power, peak memory and the price of the tokens.

A `LoadMeter` is made once per served deployment (`meter_for`) and measures each load window `run_level` runs:
- energy: a counter read at the window's start and end. On a GPU, Triton's `nv_energy_consumption` (joules since
  the server started, summed over its GPUs); on a CPU, RAPL package energy (`/sys/class/powercap/intel-rapl:N`,
  microjoules, wrapping at `max_energy_range_uj`). Where none is readable the figures are null and `reason` says
  why: never an estimate shown as a measurement. Idle power is the same counter over a quiet window (no request)
  measured once, before the first load window;
- peak memory: sampled through the window. On a GPU, Triton's `nv_gpu_memory_used_bytes` (summed over GPUs); on the
  cpu target, the resident memory of the embedded server's process group (tritonserver and its Python stubs);
- cost: `--price-per-hour` spread over the window's output tokens (per million).
Facts and units: docs/upstream-facts.md (I); what is measured where: docs/energy.md.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import requests

from ..host import process_stats
from ..triton_metrics import GPU_ENERGY, GPU_MEMORY_USED
from .metrics import parse_samples

#: where Linux exposes RAPL (the intel_rapl driver; AMD processors' package energy uses the same zone names)
POWERCAP_ROOT = Path("/sys/class/powercap")
#: the quiet window idle power is measured over
IDLE_WINDOW_S = 2.0
#: how often peak memory is sampled during a window
SAMPLE_INTERVAL_S = 0.2


class EnergyUnavailable(Exception):
    """No energy counter can be read; the message says why (it becomes the report's `reason`)."""


class EnergyCounter(Protocol):
    source: str

    def read(self) -> object:
        """The counter now (opaque: only `joules_between` two readings means anything)."""
        ...

    def joules_between(self, start, end) -> float:
        """The energy between two readings, in joules (a counter that wraps is unwrapped here)."""
        ...


# ------------------------------------------------------------------------------------------------------ RAPL


@dataclass(frozen=True)
class RaplZone:
    name: str              # package-0
    energy: Path           # energy_uj
    max_range_uj: int      # max_energy_range_uj: the counter wraps to 0 there


class RaplCounter:
    """The sum of every RAPL package zone's counter (subzones, core and dram, are inside their package's)."""

    def __init__(self, zones: list[RaplZone]):
        self.zones = zones
        self.source = "RAPL " + "+".join(z.name for z in zones) + " (powercap energy_uj)"

    def read(self) -> tuple[int, ...]:
        """Each zone's microjoules (each wraps on its own)."""
        try:
            return tuple(int(z.energy.read_text()) for z in self.zones)
        except PermissionError:
            raise EnergyUnavailable(f"{self.zones[0].energy} is not readable by this user: since Linux 5.10 RAPL "
                                    "energy_uj is readable by root only (CVE-2020-8694); run as root or grant read "
                                    "access (chmod o+r)") from None
        except (OSError, ValueError) as exc:
            raise EnergyUnavailable(f"RAPL counter unreadable: {exc}") from None

    def joules_between(self, start: tuple[int, ...], end: tuple[int, ...]) -> float:
        total = 0
        for zone, a, b in zip(self.zones, start, end):
            total += b - a if b >= a else b + zone.max_range_uj - a
        return total / 1e6


def rapl_counter(root: Path | None = None) -> RaplCounter:
    """The RAPL package zones under ROOT (default `POWERCAP_ROOT`); EnergyUnavailable saying what is missing."""
    root = Path(root or POWERCAP_ROOT)
    if not root.is_dir():
        raise EnergyUnavailable(f"no {root}: this machine exposes no RAPL energy counter (no intel_rapl/powercap "
                                "driver: typical of a virtual machine)")
    zones = []
    for zone in sorted(root.glob("intel-rapl:*")):
        if zone.name.count(":") != 1:        # intel-rapl:0:0 is a subzone of package 0
            continue
        try:
            name = (zone / "name").read_text().strip()
            max_range = int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        if (zone / "energy_uj").exists():
            zones.append(RaplZone(name, zone / "energy_uj", max_range))
    if not zones:
        raise EnergyUnavailable(f"{root} has no RAPL package zone (intel-rapl:N with energy_uj)")
    counter = RaplCounter(zones)
    counter.read()   # permission is checked now, not at the first window
    return counter


# ------------------------------------------------------------------------------------------------------ Triton


def metric_total(metrics_url: str, family: str) -> float | None:
    """The sum of FAMILY's samples on Triton's /metrics page (None when the page has none)."""
    try:
        response = requests.get(f"{metrics_url}/metrics", timeout=5)
        response.raise_for_status()
    except requests.RequestException as exc:
        raise EnergyUnavailable(f"{metrics_url}/metrics does not answer ({type(exc).__name__})") from None
    values = [value for name, _, value in parse_samples(response.text) if name == family]
    return sum(values) if values else None


class TritonEnergyCounter:
    """Triton's GPU energy counter; Triton refreshes GPU metrics every --metrics-interval-ms (2000 by default), so
    a window much shorter than that reads a stale counter."""

    def __init__(self, metrics_url: str):
        self.metrics_url = metrics_url
        self.source = f"Triton {GPU_ENERGY} ({metrics_url}/metrics)"

    def read(self) -> float:
        value = metric_total(self.metrics_url, GPU_ENERGY)
        if value is None:
            raise EnergyUnavailable(f"{self.metrics_url}/metrics has no {GPU_ENERGY}")
        return value

    def joules_between(self, start: float, end: float) -> float:
        return end - start


def energy_counter(metrics_url: str | None, local: bool, powercap_root: Path | None = None) -> EnergyCounter:
    """Triton's GPU counter where its metrics have one, else RAPL when the server runs on this machine."""
    reasons = []
    if metrics_url:
        try:
            if metric_total(metrics_url, GPU_ENERGY) is not None:
                return TritonEnergyCounter(metrics_url)
            reasons.append(f"the server's metrics have no {GPU_ENERGY} (no GPU, or GPU metrics off)")
        except EnergyUnavailable as exc:
            reasons.append(str(exc))
    else:
        reasons.append("no metrics URL known")
    if not local:
        raise EnergyUnavailable("; ".join(reasons + ["the server runs elsewhere, so this machine's RAPL does not "
                                                     "measure it"]))
    try:
        return rapl_counter(powercap_root)
    except EnergyUnavailable as exc:
        raise EnergyUnavailable("; ".join(reasons + [str(exc)])) from None


# ------------------------------------------------------------------------------------------------------ memory


def process_group_rss(pgid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of every process in process group PGID (the embedded server starts its own session)."""
    total = 0
    for process in process_stats(proc):
        if process.group != pgid:
            continue
        try:
            for line in (proc / str(process.pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return total


class MemoryProbe(Protocol):
    source: str

    def read_bytes(self) -> int: ...


@dataclass
class TritonGpuMemory:
    metrics_url: str
    source: str = f"Triton {GPU_MEMORY_USED}"

    def read_bytes(self) -> int:
        return int(metric_total(self.metrics_url, GPU_MEMORY_USED) or 0)


@dataclass
class ServerRss:
    pgid: int
    source: str = "resident memory of the server's processes (tritonserver and its Python stubs)"

    def read_bytes(self) -> int:
        return process_group_rss(self.pgid)


def memory_probe(metrics_url: str | None, server_pid: int | None) -> MemoryProbe:
    if metrics_url:
        try:
            if metric_total(metrics_url, GPU_MEMORY_USED) is not None:
                return TritonGpuMemory(metrics_url)
        except EnergyUnavailable:
            pass
    if server_pid is not None:
        return ServerRss(server_pid)
    raise EnergyUnavailable(f"the server's metrics have no {GPU_MEMORY_USED} and it is not a process of this "
                            "machine")


class PeakSampler:
    """The highest reading of a probe, sampled in a thread while a window lasts."""

    def __init__(self, probe: MemoryProbe, interval: float = SAMPLE_INTERVAL_S):
        self.probe, self.interval, self.peak = probe, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        try:
            self.peak = max(self.peak, self.probe.read_bytes())
        except EnergyUnavailable:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ------------------------------------------------------------------------------------------------------ the meter


@dataclass
class WindowReading:
    """What one load window cost; the figures are None with `reason` where they could not be measured."""
    source: str | None = None
    joules: float | None = None
    seconds: float | None = None
    mean_power_w: float | None = None
    idle_power_w: float | None = None
    reason: str | None = None
    peak_memory_bytes: int | None = None
    memory_source: str | None = None
    memory_reason: str | None = None


class LoadMeter:
    """Measures load windows of one deployment: `with meter.window() as w: ...` then `meter.kpis(w, tokens)`."""

    def __init__(self, counter: EnergyCounter | None, energy_reason: str | None, memory: MemoryProbe | None,
                 memory_reason: str | None, price: float | None = None, idle_window_s: float = IDLE_WINDOW_S):
        self.counter, self.energy_reason = counter, energy_reason
        self.memory, self.memory_reason = memory, memory_reason
        self.price, self.idle_window_s = price, idle_window_s
        self.idle_power_w: float | None = None
        self._idle_measured = False

    def measure_idle(self) -> None:
        """Idle power over a quiet window, once (the caller sends nothing meanwhile)."""
        if self._idle_measured or self.counter is None:
            return
        self._idle_measured = True
        try:
            start, t0 = self.counter.read(), time.monotonic()
            time.sleep(self.idle_window_s)
            joules = self.counter.joules_between(start, self.counter.read())
            self.idle_power_w = joules / (time.monotonic() - t0)
        except EnergyUnavailable as exc:
            self.counter, self.energy_reason = None, str(exc)

    @contextmanager
    def window(self) -> Iterator[WindowReading]:
        self.measure_idle()
        reading = WindowReading(reason=self.energy_reason, memory_reason=self.memory_reason)
        sampler = PeakSampler(self.memory) if self.memory is not None else None
        start = None
        if self.counter is not None:
            try:
                start = self.counter.read()
            except EnergyUnavailable as exc:
                reading.reason = str(exc)
        t0 = time.monotonic()
        try:
            with sampler or nullcontext():
                yield reading
        finally:
            if sampler:
                reading.peak_memory_bytes, reading.memory_source = sampler.peak, self.memory.source
            reading.seconds = time.monotonic() - t0
            if start is not None:
                try:
                    reading.joules = self.counter.joules_between(start, self.counter.read())
                    reading.source = self.counter.source
                    reading.mean_power_w = reading.joules / reading.seconds if reading.seconds > 0 else None
                    reading.idle_power_w = self.idle_power_w
                except EnergyUnavailable as exc:
                    reading.reason = str(exc)

    def kpis(self, reading: WindowReading, output_tokens: int) -> dict:
        """The record a load level carries: energy per output token, tokens per joule, peak memory, cost."""
        joules = reading.joules
        per_token = joules / output_tokens if joules is not None and output_tokens else None
        record = {
            "source": reading.source, "window_s": reading.seconds, "joules": joules,
            "mean_power_w": reading.mean_power_w, "idle_power_w": reading.idle_power_w,
            "joules_per_output_token": per_token,
            "output_tokens_per_joule": output_tokens / joules if joules else None,
            "reason": None if joules is not None else (reading.reason or "no output tokens"),
            "peak_memory_bytes": reading.peak_memory_bytes, "memory_source": reading.memory_source,
            "memory_reason": None if reading.peak_memory_bytes is not None else reading.memory_reason,
        }
        if self.price is not None:
            record["price_per_hour"] = self.price
            record["cost_per_million_output_tokens"] = (self.price * reading.seconds / 3600 / output_tokens * 1e6
                                                        if output_tokens and reading.seconds else None)
        return record


def meter_for(server, price: float | None = None, powercap_root: Path | None = None) -> LoadMeter:
    """The meter of a served deployment (a `pipeline.server.TritonServer`): its energy counter and memory probe,
    or the reasons there are none."""
    metrics_url = server.endpoints.metrics_url
    process = getattr(server, "process", None)
    local = process is not None or _is_local(server.http_url)
    counter, energy_reason = None, None
    try:
        counter = energy_counter(metrics_url, local, powercap_root)
    except EnergyUnavailable as exc:
        energy_reason = str(exc)
    memory, memory_reason = None, None
    try:
        memory = memory_probe(metrics_url, process.pid if process is not None else None)
    except EnergyUnavailable as exc:
        memory_reason = str(exc)
    return LoadMeter(counter, energy_reason, memory, memory_reason, price)


def _is_local(url: str) -> bool:
    host = url.split("://", 1)[-1].split("/", 1)[0].rpartition(":")[0] or url
    return host in ("127.0.0.1", "localhost", "::1", "[::1]", os.uname().nodename)
