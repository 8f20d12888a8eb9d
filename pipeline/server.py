"""The embedded Triton Inference Server: the tritonserver binary bundled in nvidia-pytriton, run on a repository.

`embedded_server(repo)` starts tritonserver on free localhost ports with the Python backend stub for the
running interpreter and the virtual environment's bin/ first on PATH (so the repository's Python models
import what this interpreter imports), waits until every model is ready, captures the server log to a
file, and always stops the server again (on success, failure and Ctrl-C). `connect(url)` gives the same
`TritonServer` handle for a server that is already running (e.g. NVIDIA's container on a GPU box).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import requests

from .backends.names import LAUNCH_SCRIPT
from .errors import UserError
from .host import DRAIN_FILE_ENV
from .model_repository import model_names
from .triton_admin import TritonAdmin

PYTRITON_INSTALL = "pip install --no-deps nvidia-pytriton==0.7.0"
#: NumPy 1.x for the Python models served by the embedded server (see `stub_site_packages`).
STUB_SITE = Path(sys.prefix) / "triton-stub-site"
STUB_SITE_INSTALL = f"python -m pip install --target {STUB_SITE} 'numpy<2'"
LOG_TAIL_LINES = 40
STOP_TIMEOUT_S = 30.0
#: Triton's --model-control-mode values trtpipe starts the server with (poll is for watching a repository).
MODEL_CONTROL_MODES = ("none", "explicit")


@dataclass(frozen=True)
class TritonDistribution:
    """Where the pieces of the bundled Triton server live."""

    binary: Path
    python_backend: Path  # backends/python: libtriton_python.so + triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub built for the running interpreter's Python version
    libs: Path  # shared libraries the binary links against (nvidia_pytriton.libs)


@dataclass(frozen=True)
class Endpoints:
    http_url: str  # http://host:port
    grpc_url: str | None = None  # host:port, as tritonclient.grpc wants it
    metrics_url: str | None = None

    def describe(self) -> str:
        lines = [f"HTTP     {self.http_url}"]
        if self.grpc_url:
            lines.append(f"gRPC     {self.grpc_url}")
        if self.metrics_url:
            lines.append(f"metrics  {self.metrics_url}/metrics")
        return "\n".join(lines)


@dataclass
class TritonServer:
    """A Triton server to talk to: one we started (process and log set) or one given by URL."""

    endpoints: Endpoints
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    models: list[str] = field(default_factory=list)
    drain_file: Path | None = None   # what serve writes to stop the served cpu model (pipeline/serve.py)

    @property
    def http_url(self) -> str:
        return self.endpoints.http_url

    def is_alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def is_healthy(self, timeout: float = 5.0) -> bool:
        try:
            return requests.get(f"{self.http_url}/v2/health/ready", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def find_distribution() -> TritonDistribution:
    """Locate the tritonserver binary, Python backend and stub shipped in the nvidia-pytriton wheel."""
    # only the wheel's files are used; pytriton itself is installed without its dependencies, never imported
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.origin:
        raise UserError(f"the embedded Triton server needs the tritonserver binary from nvidia-pytriton; "
                        f"install it with `{PYTRITON_INSTALL}`, or pass --url to use a running server")
    root = Path(spec.origin).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = TritonDistribution(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root.parent.parent / "nvidia_pytriton.libs",
    )
    for path, what in ((dist.binary, "tritonserver binary"), (dist.python_backend / "libtriton_python.so",
                       "Python backend"), (dist.stub, f"Python backend stub for Python {version}")):
        if not path.exists():
            raise UserError(f"the {what} is missing from the nvidia-pytriton install ({path}); reinstall it with "
                            f"`{PYTRITON_INSTALL}` (stubs exist for Python 3.8-3.13)")
    return dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `port`. With SO_REUSEADDR, as tritonserver binds: a port whose last
    server stopped with connections in TIME_WAIT (the 60 s after it closed them) is free to it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def prepare_backends(dist: TritonDistribution, workspace: Path) -> Path:
    """A backend directory whose python/ holds the backend and the stub for this interpreter (as pytriton does)."""
    python_dir = workspace / "backends" / "python"
    shutil.copytree(dist.python_backend, python_dir, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(dist.stub, python_dir / "triton_python_backend_stub")
    return python_dir.parent


def stub_site_packages() -> Path | None:
    """A directory with NumPy 1.x to put first on the Python models' path, or None when none is needed.

    The Python backend stub bundled in nvidia-pytriton 0.7.0 was compiled against NumPy 1.x (pybind11
    before 2.12): under NumPy 2 it reads dtype sizes from the wrong field and corrupts every tensor it
    hands to a model. This environment keeps NumPy 2 (pandas/datasets need it); the served models get
    NumPy 1.x from STUB_SITE instead.
    """
    if int(importlib.metadata.version("numpy").split(".")[0]) < 2:
        return None
    if not any(int(d.name.split("-")[1].split(".")[0]) < 2 for d in STUB_SITE.glob("numpy-*.dist-info")):
        raise UserError(f"the Python backend of the embedded Triton server (nvidia-pytriton 0.7.0) needs NumPy 1.x "
                        f"and this environment has NumPy {importlib.metadata.version('numpy')}; install NumPy 1.x "
                        f"for the served models (this environment is left as is) with:\n  {STUB_SITE_INSTALL}")
    return STUB_SITE


def prepare_stub_python(workspace: Path, stub_site: Path) -> Path:
    """A virtual environment for the served models: NumPy 1.x from `stub_site`, then this environment's packages.

    The stub ignores PYTHONPATH; it takes its prefix from the `python3` first on PATH (and that
    interpreter's pyvenv.cfg), so the models see this venv's site-packages behind `stub_site`. Returns
    the bin/ directory to put first on PATH.
    """
    root = workspace / "python"
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    (root / "pyvenv.cfg").write_text(f"home = {Path(sys._base_executable).parent}\n"
                                     "include-system-site-packages = false\n")
    site_dir = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_dir.mkdir(parents=True)
    lines = [str(stub_site)] + [f"import site; site.addsitedir({str(p)!r})" for p in site.getsitepackages()]
    (site_dir / "trtpipe-served-models.pth").write_text("\n".join(lines) + "\n")
    return bin_dir


def server_environment(dist: TritonDistribution, workspace: Path) -> dict[str, str]:
    """This process's environment with the models' Python first on PATH, the server's libraries found and the
    drain file named (`drain_file`).

    The Python backend stub embeds Python and finds its prefix (and so site-packages) through the
    `python3` first on PATH; PYTHONPATH alone does not make torch importable in the stub.
    """
    env = dict(os.environ)
    env[DRAIN_FILE_ENV] = str(drain_file(workspace))
    stub_site = stub_site_packages()
    python_bin = prepare_stub_python(workspace, stub_site) if stub_site else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(python_bin), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (env.get("LD_LIBRARY_PATH"), str(dist.libs)) if p)
    return env


def drain_file(workspace: Path) -> Path:
    return workspace / "drain"


def server_command(dist: TritonDistribution, repo: Path, backends: Path, ports: tuple[int, int, int],
                   host: str, model_control: str = "none", shm_prefix: str = "trtpipe_") -> list[str]:
    """tritonserver's command line; `model_control` "explicit" loads every model at start and lets clients
    reload them (Triton's model-control API: `trtpipe versions serve --url`, `trtpipe tune --url`)."""
    if model_control not in MODEL_CONTROL_MODES:
        raise UserError(f"model control mode must be one of {', '.join(MODEL_CONTROL_MODES)}, not {model_control!r}")
    http_port, grpc_port, metrics_port = ports
    explicit = ["--model-control-mode=explicit", "--load-model=*"] if model_control == "explicit" else []
    return [
        str(dist.binary),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        # the flag NVIDIA's launch_triton_server.py passes: the repository's configs are served as written
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        # metrics on (Triton's default, stated: validate's metrics check reads them), without DCGM on the cpu
        "--allow-metrics=true", f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        "--exit-timeout-secs=10",
        *explicit,
    ]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started the server dies (even by SIGKILL)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_until_ready(server: TritonServer, timeout: float) -> None:
    """Block until the server is live, ready and every model of its repository is READY."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        if not server.is_alive():
            raise UserError(f"the Triton server exited (status {server.process.returncode}) before it was "
                            f"ready; last lines of {server.log_path}:\n{server.log_tail()}")
        try:
            if server.is_healthy(timeout=2.0):
                states = TritonAdmin(server.http_url, timeout=5.0).states()
                if states and all(state == "READY" for state in states.values()):
                    server.models = sorted(states)
                    return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.25)
    not_ready = ", ".join(f"{name}: {state}" for name, state in states.items() if state != "READY")
    where = f"; last lines of {server.log_path}:\n{server.log_tail()}" if server.log_path else ""
    raise UserError(f"the Triton server at {server.http_url} was not ready within {timeout:.0f} s"
                    f"{' (' + not_ready + ')' if not_ready else ''}{where}")


def stop_server(process: subprocess.Popen, shm_prefix: str | None = None) -> None:
    """SIGINT (Triton's graceful shutdown), then SIGKILL to the whole process group if it does not exit; then
    SIGKILL to whatever is left of the group (a Python backend stub outlives its server when it ignores
    SIGTERM) and the shared-memory regions its stubs left (Triton's Python backend names them `shm_prefix`...)."""
    try:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=STOP_TIMEOUT_S)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)   # the server's own group (start_new_session): its stubs too
    except ProcessLookupError:
        pass
    process.wait()
    if shm_prefix:
        for region in Path("/dev/shm").glob(f"{shm_prefix}*"):
            region.unlink(missing_ok=True)


def _address_in_use(log_tail: str) -> bool:
    return "already in use" in log_tail or "Address in use" in log_tail


def _launch(command: list[str], environment: dict[str, str], ports: tuple[int, int, int], host: str,
            log_path: Path, repo: Path) -> TritonServer:
    """tritonserver started in the repository's root: NVIDIA's Python models resolve a relative tokenizer_dir
    against the working directory (deploy.tokenizer_parameter)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, cwd=repo,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environment,
                                   start_new_session=True, preexec_fn=_die_with_parent)
    connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    endpoints = Endpoints(http_url=f"http://{connect_host}:{ports[0]}", grpc_url=f"{connect_host}:{ports[1]}",
                          metrics_url=f"http://{connect_host}:{ports[2]}")
    return TritonServer(endpoints=endpoints, log_path=log_path, process=process)


@contextmanager
def embedded_server(repo: Path, *, http_port: int | None = None, host: str = "127.0.0.1",
                    log_path: Path | None = None, ready_timeout: float = 600.0,
                    model_control: str = "none", environment: dict[str, str] | None = None) -> Iterator[TritonServer]:
    """Run tritonserver on `repo` until the block ends; yields once every model is ready.

    `http_port` None picks free ports; otherwise HTTP, gRPC and metrics use http_port, +1 and +2 (Triton's
    8000/8001/8002 convention). The log goes to `log_path` (default: a file in a temporary workspace that
    is removed when the server stops, unless it stops on an error, whose message may name the log);
    `environment` is added to the server's (trtpipe profile's capture directory). The
    server gets SIGTERM if the thread that started it dies, so start it from a thread that outlives its use
    (the main thread).
    """
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise UserError(f"model repository {repo} does not exist or is not a directory")
    if not model_names(repo):
        if (repo / LAUNCH_SCRIPT).is_file():
            raise UserError(f"{repo} is a trtllm-serve deployment (its runtime image has no Triton): run its "
                            f"{LAUNCH_SCRIPT} in that image, and validate it with `trtpipe validate --api openai "
                            "--url http://HOST:8000`")
        raise UserError(f"{repo} holds no model (no */config.pbtxt); pass a Triton model repository, "
                        "e.g. the output of `trtpipe deploy`")
    if http_port is not None:
        busy = [p for p in (http_port, http_port + 1, http_port + 2) if not port_is_free(p, host)]
        if busy:
            raise UserError(f"port(s) {', '.join(map(str, busy))} on {host} are in use; pass another --port "
                            "(the server uses PORT, PORT+1 and PORT+2), or --port 0 for free ports")
    dist = find_distribution()
    workspace = Path(tempfile.mkdtemp(prefix="trtpipe-triton-"))
    log_path = Path(log_path).resolve() if log_path else workspace / "tritonserver.log"
    server, failed = None, True
    try:
        backends = prepare_backends(dist, workspace)
        environment = {**server_environment(dist, workspace), **(environment or {})}
        shm_prefix = f"trtpipe_{uuid.uuid4().hex[:12]}_"
        for attempt in range(3):
            ports = (http_port, http_port + 1, http_port + 2) if http_port else (free_port(), free_port(), free_port())
            command = server_command(dist, repo, backends, ports, host, model_control, shm_prefix)
            server = _launch(command, environment, ports, host, log_path, repo)
            server.drain_file = drain_file(workspace)
            try:
                wait_until_ready(server, ready_timeout)
                break
            except UserError:
                # another process may have taken a free port between our probe and the server's bind
                if http_port is None and attempt < 2 and not server.is_alive() and _address_in_use(server.log_tail()):
                    continue
                raise
        yield server
        failed = False
    finally:
        if server is not None and server.process is not None:
            stop_server(server.process, shm_prefix)
        for part in ("backends", "python"):
            shutil.rmtree(workspace / part, ignore_errors=True)
        if not (failed and log_path.parent == workspace):  # an error message may name the log: keep it then
            shutil.rmtree(workspace, ignore_errors=True)


@contextmanager
def connect(url: str, *, grpc_url: str | None = None, metrics_url: str | None = None,
            ready_timeout: float = 60.0) -> Iterator[TritonServer]:
    """A running Triton server given by its HTTP URL; yields once it and every model are ready."""
    http_url = url.rstrip("/")
    if not http_url.startswith(("http://", "https://")):
        http_url = f"http://{http_url}"
    metrics_url = metrics_url.rstrip("/").removesuffix("/metrics") if metrics_url else None
    if metrics_url and not metrics_url.startswith(("http://", "https://")):
        metrics_url = f"http://{metrics_url}"
    server = TritonServer(endpoints=Endpoints(http_url=http_url, grpc_url=grpc_url, metrics_url=metrics_url))
    try:
        requests.get(f"{http_url}/v2/health/live", timeout=10)
    except requests.RequestException as exc:
        raise UserError(f"no Triton server answers at {http_url} ({type(exc).__name__}); check --url") from None
    wait_until_ready(server, ready_timeout)
    yield server


class ServerPool:
    """One embedded server per repository, started on first use and stopped by close() (session fixtures)."""

    def __init__(self, **server_options):
        self._options = server_options
        self._stack = ExitStack()
        self._servers: dict[Path, TritonServer] = {}

    def get(self, repo: Path) -> TritonServer:
        key = Path(repo).resolve()
        if key not in self._servers:
            self._servers[key] = self._stack.enter_context(embedded_server(key, **self._options))
        return self._servers[key]

    def close(self) -> None:
        self._servers.clear()
        self._stack.close()
