"""`trtpipe doctor` and scripts/gpu-acceptance.sh, on any machine: the GPU box is made of fakes on PATH (an
`nvidia-smi` whose output is parsed for real, a `tritonserver` with a backends/ directory beside it, a
`tensorrt_llm` package on PYTHONPATH) or of monkeypatched probes; the script runs against a fake `trtpipe`
and a fake `tritonserver` that listens on its port."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipeline import doctor
from pipeline.cli import main
from pipeline.targets import get_target

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-acceptance.sh"
QUERY = "--query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits"


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_nvidia_smi(monkeypatch, bindir: Path, output: str, status: int = 0) -> None:
    """nvidia-smi on PATH that prints `output` for exactly doctor's query, and refuses any other arguments."""
    executable(bindir / "nvidia-smi", f"""#!/bin/sh
[ "$*" = "{QUERY}" ] || {{ echo "unexpected arguments: $*" >&2; exit 2; }}
cat <<'EOF'
{output}
EOF
exit {status}
""")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


def checks_by_name(report) -> dict:
    return {c.name: c for c in report}


def test_a_matching_rtx4090_passes_the_gpu_checks(monkeypatch, tmp_path):
    fake_nvidia_smi(monkeypatch, tmp_path, "NVIDIA GeForce RTX 4090, 8.9, 24564")
    assert doctor.query_gpus() == [doctor.Gpu("NVIDIA GeForce RTX 4090", 89, 24564)]
    checks = checks_by_name(doctor.gpu_checks(get_target("rtx4090")))
    assert [c.status for c in checks.values()] == ["PASS"] * 4
    assert checks["gpu"].detail == "GPU 0: NVIDIA GeForce RTX 4090 (the rtx4090 target's SKU)"
    assert checks["compute capability"].detail == "sm_89, as rtx4090"
    assert checks["memory"].detail.startswith("24564 MiB per GPU")


def test_a_mismatching_gpu_fails_with_what_to_do(monkeypatch, tmp_path):
    fake_nvidia_smi(monkeypatch, tmp_path, "NVIDIA GeForce RTX 4090, 8.9, 24564\nNVIDIA A100-SXM4-40GB, 8.0, 40960")
    checks = checks_by_name(doctor.gpu_checks(get_target("rtx4090")))
    assert checks["nvidia-smi"].detail == "the driver answers: 2 GPU(s)"
    assert "not named like the rtx4090 target's" in checks["gpu"].detail
    sm = checks["compute capability"]
    assert sm.status == "FAIL" and sm.detail == "GPU 1 NVIDIA A100-SXM4-40GB is sm_80, rtx4090 is sm_89"
    assert "a100-40g, a100-80g, l40s, rtx4090" in sm.fix
    assert checks["memory"].status == "PASS"   # each has at least the 4090's 24 GiB
    # nvidia-smi and the datasheet name the same A100 differently: the name is no reason to fail
    fake_nvidia_smi(monkeypatch, tmp_path, "NVIDIA A100-SXM4-40GB, 8.0, 40536")
    checks = checks_by_name(doctor.gpu_checks(get_target("a100-40g")))
    assert [c.status for c in checks.values()] == ["PASS"] * 4 and "a100-40g target's SKU" in checks["gpu"].detail


def test_too_little_memory_fails(monkeypatch, tmp_path):
    fake_nvidia_smi(monkeypatch, tmp_path, "NVIDIA GeForce RTX 4090 Laptop GPU, 8.9, 16376")
    memory = checks_by_name(doctor.gpu_checks(get_target("rtx4090")))["memory"]
    assert memory.status == "FAIL"
    assert memory.detail == "GPU 0 NVIDIA GeForce RTX 4090 Laptop GPU has 16376 MiB, the rtx4090 plan assumes 24564 MiB"


@pytest.mark.parametrize("output,status,message", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9,
     "nvidia-smi exited with status 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."),
    ("NVIDIA GeForce RTX 4090, [N/A], 24564", 0, "cannot read 'NVIDIA GeForce RTX 4090,[N/A],24564' as name"),
    ("", 0, "nvidia-smi lists no GPU"),
])
def test_a_driver_that_does_not_answer_fails_and_skips_the_gpu_checks(output, status, message, monkeypatch, tmp_path):
    fake_nvidia_smi(monkeypatch, tmp_path, output, status)
    checks = doctor.gpu_checks(get_target("rtx4090"))
    assert checks[0].status == "FAIL" and message in checks[0].detail and checks[0].fix
    assert [c.status for c in checks[1:]] == ["SKIP"] * 3


def test_no_nvidia_smi_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    check = doctor.gpu_checks(get_target("rtx4090"))[0]
    assert check.status == "FAIL" and check.detail.startswith("nvidia-smi is not on PATH")


def fake_tensorrt_llm(monkeypatch, tmp_path: Path, body: str) -> None:
    """A `tensorrt_llm` package ahead of site-packages for the child Python the probe starts."""
    package = tmp_path / "site" / "tensorrt_llm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(body)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))


def test_tensorrt_llm_is_imported_for_real_and_its_version_checked(monkeypatch, tmp_path):
    fake_tensorrt_llm(monkeypatch, tmp_path, 'print("[TensorRT-LLM] TensorRT-LLM version: 1.2.1")\n'
                                             '__version__ = "1.2.1"\n')
    assert doctor.probe_tensorrt_llm() == "1.2.1"
    assert doctor.tensorrt_llm_check() == doctor.Check("tensorrt-llm", "PASS", "version 1.2.1")
    monkeypatch.setattr(doctor, "probe_tensorrt_llm", lambda: "1.3.0")
    check = doctor.tensorrt_llm_check()
    assert check.status == "FAIL" and check.detail == "version 1.3.0, trtpipe targets 1.2.1"
    assert "has no engine path" in check.fix and "rule engine-removed-1.3" not in check.fix and "#15763" in check.fix
    monkeypatch.setattr(doctor, "probe_tensorrt_llm", lambda: "1.2.0")
    check = doctor.tensorrt_llm_check()
    assert check.status == "FAIL" and "has no engine path" not in check.fix


def test_a_broken_tensorrt_llm_install_fails_with_the_import_error(monkeypatch, tmp_path):
    fake_tensorrt_llm(monkeypatch, tmp_path, 'raise ImportError("libmpi.so.40: cannot open shared object file")\n')
    check = doctor.tensorrt_llm_check()
    assert check.status == "FAIL"
    assert check.detail == "import tensorrt_llm failed: ImportError: libmpi.so.40: cannot open shared object file"


def test_tritonserver_needs_the_tensorrtllm_backend_beside_it(monkeypatch, tmp_path):
    binary = executable(tmp_path / "opt" / "tritonserver" / "bin" / "tritonserver", "#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(binary.parent))
    check = doctor.tritonserver_check()
    assert check.status == "FAIL" and "has no tensorrtllm backend" in check.detail
    (tmp_path / "opt" / "tritonserver" / "backends" / "tensorrtllm").mkdir(parents=True)
    assert doctor.tritonserver_check().status == "PASS"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert doctor.tritonserver_check().detail == "not on PATH"
    assert doctor.trtllm_build_check().detail == "not on PATH"


def test_torch_without_cuda_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check = doctor.torch_cuda_check()
    assert check.status == "FAIL" and "sees no CUDA device" in check.detail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert doctor.torch_cuda_check().detail.endswith(", 2 device(s)")


def healthy_box(monkeypatch, tmp_path: Path) -> None:
    fake_nvidia_smi(monkeypatch, tmp_path / "bin", "NVIDIA GeForce RTX 4090, 8.9, 24564")
    monkeypatch.setattr(doctor, "probe_tensorrt_llm", lambda: "1.2.1")
    monkeypatch.setattr(doctor, "find_tool", lambda name: f"/opt/{name}")
    monkeypatch.setattr(doctor, "tritonserver_check", lambda: doctor.Check("tritonserver", "PASS", "/opt/tritonserver"))
    monkeypatch.setattr(doctor, "probe_torch_cuda", lambda: "torch 2.9.1, CUDA 13.0, 1 device(s)")


def test_cli_exit_status_and_one_line_per_check(monkeypatch, tmp_path):
    healthy_box(monkeypatch, tmp_path)
    result = CliRunner().invoke(main, ["doctor", "--target", "rtx4090"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 9 and all(line.startswith("PASS  ") for line in lines[:-1])
    assert lines[-1] == "doctor: ready for rtx4090 (8 passed, 0 failed, 0 skipped)"

    monkeypatch.setattr(doctor, "find_tool", lambda name: None)
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    failed = [c for c in report["checks"] if c["status"] == "FAIL"]
    assert report["ok"] is False and [c["name"] for c in failed] == ["trtllm-build"]
    assert "TensorRT-LLM 1.2.1" in failed[0]["fix"]


@pytest.mark.parametrize("target,message", [("rtx9090", "unknown target 'rtx9090'"),
                                            ("cpu", "checks a GPU box for a GPU target")])
def test_bad_target_is_a_usage_error(target, message):
    result = CliRunner().invoke(main, ["doctor", "--target", target])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------------ scripts/gpu-acceptance.sh


def test_acceptance_script_parses_and_is_shellcheck_clean():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    result = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # and shellcheck does reject a bad script (so a clean result means something)
    bad = subprocess.run([shellcheck, "-"], input="#!/bin/bash\nrm -rf $1/*\n", capture_output=True, text=True,
                         check=False)
    assert bad.returncode != 0


FAKE_TRTPIPE = """#!/usr/bin/env bash
echo "trtpipe $*" >>"$FAKE_LOG"
case $1 in
  doctor) exit "${FAKE_DOCTOR_STATUS:-0}" ;;
  build)
    if [[ $2 == "${FAKE_BUILD_FAILS:-}" ]]; then echo "error: no weights for $2" >&2; exit 2; fi
    mkdir -p "${@: -1}/model_repo" ;;
  validate) exit "${FAKE_VALIDATE_STATUS:-0}" ;;
esac
"""
FAKE_TRITONSERVER = f"""#!{sys.executable}
import os, signal, socket, sys
port = int(next(a for a in sys.argv if a.startswith("--http-port=")).split("=")[1])
with open(os.environ["FAKE_LOG"], "a") as log:
    print("tritonserver", os.getpid(), *sys.argv[1:], file=log)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen()
while True:
    server.accept()[0].close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_acceptance(tmp_path: Path, *args: str, **fake_env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bindir = tmp_path / "bin"
    executable(bindir / "trtpipe", FAKE_TRTPIPE)
    executable(bindir / "tritonserver", FAKE_TRITONSERVER)
    log = tmp_path / "calls.log"
    log.touch()
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
           "TRTPIPE_ACCEPTANCE_PORT": str(free_port()), **fake_env}
    result = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    return result, log.read_text().splitlines()


def recap(result) -> list[str]:
    """The verdict lines repeated at the end, as STATUS STEP pairs."""
    lines = result.stdout.split("GPU acceptance (rtx4090, fp8):\n")[1].splitlines()
    return [" ".join(line.split()[:3]) for line in lines]


def test_acceptance_builds_serves_and_validates_each_model(tmp_path):
    result, calls = run_acceptance(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert recap(result) == ["PASS doctor this", "PASS build smollm2-135m", "PASS validate smollm2-135m",
                             "PASS build llama-3-8b", "PASS validate llama-3-8b"]
    port = int(next(c for c in calls if c.startswith("tritonserver")).split("--http-port=")[1].split()[0])
    smollm2 = "out/gpu-acceptance/smollm2-135m-rtx4090-fp8"
    assert calls[0] == "trtpipe doctor --target rtx4090"
    assert calls[1] == f"trtpipe build smollm2-135m --target rtx4090 --precision fp8 -o {smollm2}"
    assert f"--model-repository={smollm2}/model_repo" in calls[2]
    assert calls[3].startswith(f"trtpipe validate {smollm2}/model_repo --url http://127.0.0.1:{port} ")
    assert calls[4].startswith("trtpipe build llama-3-8b --target rtx4090 --precision fp8")
    for pid in (int(c.split()[1]) for c in calls if c.startswith("tritonserver")):
        with pytest.raises(ProcessLookupError):   # every server it started is stopped
            os.kill(pid, 0)


def test_acceptance_stops_when_doctor_fails(tmp_path):
    result, calls = run_acceptance(tmp_path, "mistral-7b", FAKE_DOCTOR_STATUS="1")
    assert result.returncode == 1
    assert recap(result) == ["FAIL doctor see", "SKIP build smollm2-135m", "SKIP build mistral-7b"]
    assert calls == ["trtpipe doctor --target rtx4090"]


def test_acceptance_reports_each_failed_step_and_goes_on(tmp_path):
    result, calls = run_acceptance(tmp_path, "mistral-7b", FAKE_BUILD_FAILS="mistral-7b", FAKE_VALIDATE_STATUS="1")
    assert result.returncode == 1
    assert recap(result) == ["PASS doctor this", "PASS build smollm2-135m", "FAIL validate smollm2-135m",
                             "FAIL build mistral-7b", "SKIP validate mistral-7b"]
    assert "error: no weights for mistral-7b" in result.stdout
    assert sum(c.startswith("tritonserver") for c in calls) == 1
