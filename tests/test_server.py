"""The embedded Triton server (pipeline.server) and `trtpipe serve`, run for real on tests/fixtures_repo."""

from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from pipeline import server as server_mod
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.server import connect, embedded_server, port_is_free

FIXTURE_REPO = Path(__file__).parent / "fixtures_repo"


@pytest.fixture(scope="session")
def fixture_server(triton_pool):
    return triton_pool.get(FIXTURE_REPO)


def generate(url: str, text: str, max_tokens: int) -> requests.Response:
    return requests.post(f"{url}/v2/models/ensemble/generate", timeout=30,
                         json={"text_input": text, "max_tokens": max_tokens, "bad_words": "", "stop_words": ""})


def broken_copy(tmp_path: Path) -> Path:
    """The fixture repository with a tiny_llm that raises while loading."""
    repo = tmp_path / "broken_repo"
    shutil.copytree(FIXTURE_REPO, repo)
    model = repo / "tiny_llm" / "1" / "model.py"
    model.write_text(model.read_text().replace(
        "    def initialize(self, args):\n",
        "    def initialize(self, args):\n        raise RuntimeError('tiny_llm refuses to load (test)')\n"))
    return repo


# ------------------------------------------------------------------------------------------ real server


def test_server_serves_every_model_and_logs(fixture_server):
    assert fixture_server.models == ["ensemble", "tiny_llm"]
    response = generate(fixture_server.http_url, "one two three", 4)
    assert response.status_code == 200, response.text
    # the NVIDIA-client JSON reaches the decoupled Python model through the ensemble (prompt echoed first)
    assert response.json()["text_output"] == "one two three three two one three"
    log = fixture_server.log_path.read_text()
    assert "Started HTTPService" in log and "successfully loaded 'tiny_llm'" in log


def test_served_models_get_numpy_1_and_this_environment(fixture_server):
    """BYTES tensors come through intact: the stub's NumPy-1 ABI matches what the models import."""
    words = " ".join(f"w{i}" for i in range(20))
    response = generate(fixture_server.http_url, words, 3)
    assert response.json()["text_output"] == words + " w19 w18 w17"


def test_connect_uses_a_running_server(fixture_server):
    with connect(fixture_server.http_url, ready_timeout=10) as other:
        assert other.process is None and other.is_healthy()
        assert generate(other.http_url, "a b", 2).status_code == 200
        assert other.endpoints.metrics_url is None
    metrics = fixture_server.endpoints.metrics_url
    with connect(fixture_server.http_url, metrics_url=metrics.removeprefix("http://") + "/metrics/",
                 ready_timeout=10) as other:
        assert other.endpoints.metrics_url == metrics  # host:port/metrics/ as typed -> the URL the server has


def test_the_embedded_server_serves_prometheus_metrics_per_model(fixture_server):
    assert generate(fixture_server.http_url, "a b", 2).status_code == 200
    text = requests.get(f"{fixture_server.endpoints.metrics_url}/metrics", timeout=10).text
    assert 'nv_inference_request_success{model="ensemble",version="1"}' in text
    assert 'nv_inference_request_failure{model="ensemble",reason="' in text  # by reason since Triton 2.51


def test_connect_to_nothing_is_a_user_error():
    port = server_mod.free_port()
    with pytest.raises(UserError, match="no Triton server answers"):
        with connect(f"http://127.0.0.1:{port}", ready_timeout=2):
            pass


def test_server_is_stopped_when_the_block_fails():
    with pytest.raises(ZeroDivisionError):
        with embedded_server(FIXTURE_REPO, ready_timeout=120) as server:
            process, port = server.process, int(server.http_url.rsplit(":", 1)[1])
            1 / 0
    assert process.poll() is not None
    assert port_is_free(port)


def test_model_that_fails_to_load_reports_the_log_tail(tmp_path):
    with pytest.raises(UserError) as excinfo:
        with embedded_server(broken_copy(tmp_path), ready_timeout=60, log_path=tmp_path / "server.log"):
            pass
    message = str(excinfo.value)
    assert "tiny_llm refuses to load (test)" in message
    assert str(tmp_path / "server.log") in message


def test_workspace_is_removed_after_a_clean_stop_and_keeps_the_named_log_after_a_failure(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"   # where tempfile puts the server's workspace
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with embedded_server(FIXTURE_REPO, ready_timeout=120) as server:
        assert server.log_path.is_relative_to(scratch)
    assert list(scratch.iterdir()) == []
    with pytest.raises(UserError) as excinfo:
        with embedded_server(broken_copy(tmp_path), ready_timeout=60):
            pass
    [kept] = list(scratch.iterdir())
    assert [p.name for p in kept.iterdir()] == ["tritonserver.log"]
    assert str(kept / "tritonserver.log") in str(excinfo.value)


def test_not_a_repository_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="holds no model"):
        with embedded_server(tmp_path):
            pass


def test_missing_pytriton_names_the_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytriton" else
                        real_find_spec(name, *a))
    with pytest.raises(UserError, match=re.escape("pip install --no-deps nvidia-pytriton==0.7.0")):
        server_mod.find_distribution()


def test_numpy_2_without_the_stub_site_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(server_mod, "STUB_SITE", tmp_path / "empty")
    if int(__import__("numpy").__version__.split(".")[0]) < 2:
        pytest.skip("this environment has NumPy 1.x: no stub site needed")
    with pytest.raises(UserError, match="--target"):
        server_mod.stub_site_packages()


# ------------------------------------------------------------------------------------------ trtpipe serve


@pytest.mark.slow
@pytest.mark.parametrize("sigint, model_control", [("default", "none"), ("ignored", "explicit")])
def test_serve_runs_in_the_foreground_until_ctrl_c(sigint, model_control):
    """Also when started with SIGINT ignored, as a shell script's background job (`trtpipe serve ... &`) is;
    with --model-control-mode explicit its models can be reloaded through Triton's model-control API."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(FIXTURE_REPO), "--port", "0",
                                "--model-control-mode", model_control],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            lines.append(line)
            if "Ctrl-C to stop" in line or not line:
                break
        output = "".join(lines)
        assert "models ready: ensemble, tiny_llm" in output, output
        url = re.search(r"HTTP\s+(\S+)", output).group(1)
        assert generate(url, "x y", 2).json()["text_output"] == "x y y x"
        reload = requests.post(f"{url}/v2/repository/models/tiny_llm/load", timeout=60)
        assert reload.status_code == (200 if model_control == "explicit" else 503), reload.text
        process.send_signal(signal.SIGINT)
        try:
            # stopping may take the server's whole grace period before SIGKILL
            rest, _ = process.communicate(timeout=server_mod.STOP_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"trtpipe serve did not exit after Ctrl-C; its output: {process.communicate()[0]!r}")
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, rest
    assert "stopped" in rest
    assert port_is_free(int(url.rsplit(":", 1)[1]))


def test_serve_on_a_busy_port_is_a_user_error():
    port = server_mod.free_port()
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        result = CliRunner().invoke(main, ["serve", str(FIXTURE_REPO), "--port", str(port)])
    assert result.exit_code == 2
    assert f"port(s) {port}" in result.output and "--port" in result.output
