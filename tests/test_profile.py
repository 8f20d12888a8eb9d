"""trtpipe profile: the cpu deployment profiled for real (the stage ranges of every model and torch's operators in one
Chrome trace), the NVTX ranges of pipeline/spans.py, the Nsight Systems path for GPU backends with a fake nsys, and
bad input."""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from support.http import EmptyStreamTriton, serving
from support.models import deploy_tiny_cpu_repo

from pipeline import profile as profile_module
from pipeline import spans
from pipeline.backends import backend_for
from pipeline.cli import main
from pipeline.deploy import deploy_repository
from pipeline.plan import load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.targets import get_target


@pytest.fixture(scope="module")
def cpu_repo(tiny_llama, tmp_path_factory) -> Path:
    return deploy_tiny_cpu_repo(tiny_llama("gqa"), tmp_path_factory.mktemp("profile-cpu"))


@pytest.fixture(scope="module")
def profiled(cpu_repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled") / "profile"
    result = CliRunner().invoke(main, ["profile", str(cpu_repo), "--duration", "3", "--max-tokens", "6", "-o",
                                       str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def no_server_left(repo: Path) -> bool:
    """No tritonserver of REPO runs (the session's pool serves other repositories meanwhile)."""
    found = subprocess.run(["pgrep", "-f", "--", f"--model-repository={Path(repo).resolve()}"], capture_output=True,
                           text=True)
    return not any(pid != str(os.getpid()) for pid in found.stdout.split())


def test_the_trace_holds_every_stage_of_one_request_in_order(profiled):
    out, _ = profiled
    with gzip.open(out / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert processes == {"preprocessing", "tensorrt_llm", "postprocessing"}
    stages = [e for e in trace["traceEvents"] if e.get("cat") == "trtpipe"]
    # concurrency 1: a request's ranges, from its tokenize to the next request's tokenize
    first = next(i for i, e in enumerate(stages) if e["name"] == "tokenize")
    following = next((i for i, e in enumerate(stages) if i > first and e["name"] == "tokenize"), len(stages))
    request = stages[first:following]
    order = []
    for e in request:
        if e["name"] not in order:
            order.append(e["name"])
    assert order == ["tokenize", "schedule", "forward", "sample", "detokenize"]
    forward = [e for e in request if e["name"] == "forward"]
    assert forward[0]["args"]["phase"] == "prefill" and {e["args"]["phase"] for e in forward[1:]} == {"decode"}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in stages)
    # torch's operators run inside the cpu model's forward ranges, on the same time line
    ops = [e for e in trace["traceEvents"] if e.get("cat") == "torch"]
    assert any(e["name"] == "aten::mm" or e["name"] == "aten::linear" for e in ops)
    inside = [op for op in ops if any(f["ts"] - 1 <= op["ts"] <= f["ts"] + f["dur"] + 1 for f in forward)]
    assert len(inside) > 0.5 * len([op for op in ops if op["ts"] <= forward[-1]["ts"] + forward[-1]["dur"]])


def test_the_summary_files_and_the_top_operators(profiled, cpu_repo):
    out, output = profiled
    summary = json.loads((out / "profile.json").read_text())
    assert summary["kind"] == "torch" and summary["load"]["completed"] == summary["load"]["requests"] > 0
    assert summary["load"]["wall_s"] >= 3.0 and summary["load"]["output_tokens_per_s"] > 0
    assert set(summary["stages"]) == set(profile_module.STAGES)
    assert summary["stages"]["forward"]["count"] >= summary["load"]["requests"]
    top = summary["top_operators"]
    assert top and all(op["name"] not in profile_module.STAGES for op in top)
    assert [op["self_cpu_ms"] for op in top] == sorted((op["self_cpu_ms"] for op in top), reverse=True)
    assert "| operator | calls |" in (out / "top_operators.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["profile.json", "server.log", "top_operators.md", "trace.json.gz"]
    assert "output tokens/s" in output and "trace.json.gz" in output
    assert no_server_left(cpu_repo)


def test_a_repository_that_does_not_load_exits_2_with_nothing_written(cpu_repo, tmp_path):
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(cpu_repo), str(broken)], check=True)
    (broken / "tensorrt_llm" / "1" / "model.py").write_text("raise RuntimeError('this model does not load')\n")
    result = CliRunner().invoke(main, ["profile", str(broken), "--duration", "1", "--timeout", "120",
                                       "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    assert no_server_left(broken)


@pytest.mark.parametrize("args, message", [
    (["--duration", "0"], "--duration"),
    (["--duration", "-3"], "--duration"),
    (["--concurrency", "0"], "--concurrency"),
])
def test_bad_options_exit_2(cpu_repo, tmp_path, args, message):
    result = CliRunner().invoke(main, ["profile", str(cpu_repo), *args, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output and not (tmp_path / "out").exists()


def test_a_missing_repository_or_an_unwritable_trace_directory_exits_2(cpu_repo, tmp_path):
    result = CliRunner().invoke(main, ["profile", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(main, ["profile", str(cpu_repo), "-o", str(tmp_path / "file" / "out")])
    assert result.exit_code == 2 and "is not a writable directory" in result.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    result = CliRunner().invoke(main, ["profile", str(cpu_repo), "-o", str(tmp_path / "full")])
    assert result.exit_code == 2 and "not an empty directory" in result.output


@pytest.mark.parametrize("contract", ["ensemble", "llmapi"])
def test_the_load_counts_a_stream_without_any_event_as_failed_and_says_why(contract):
    """Triton's 200 without any event (docs/upstream-facts.md §C) is a failed request of the profiled load, never an
    answer, and the summary gives the reason."""
    from pipeline.validate.client import EMPTY_STREAM, EnsembleClient
    from pipeline.validate.llmapi import LlmapiClient

    options = profile_module.ProfileOptions(duration_s=0.2, max_tokens=4, prompts=("a b c",))
    with serving(EmptyStreamTriton) as url:
        client = (EnsembleClient(SimpleNamespace(http_url=url), timeout=10) if contract == "ensemble"
                  else LlmapiClient(url, timeout=10))
        load = profile_module.drive(client, options)
    assert load["completed"] == 0 and load["failed"] == load["requests"] > 0 and load["errors"] == [EMPTY_STREAM]
    rendered = profile_module.ProfileResult(Path("out"), "torch", load, files=["trace.json.gz"]).render()
    assert f"{load['failed']} failed ({EMPTY_STREAM})" in rendered


# ------------------------------------------------------------------------------------------------ NVTX ranges


def spans_in_a_fresh_process(env: dict, code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[1]).stdout


def test_ranges_are_nvtx_ranges_and_records_only_while_capturing(tmp_path):
    code = ("from pipeline import spans\n"
            "print(spans._domain is not None, spans._recorder is not None)\n"
            "import os, time\n"
            "with spans.span('forward', rows=2): pass\n"
            "open(os.path.join(os.environ['TRTPIPE_PROFILE_DIR'], 'capturing'), 'w').close(); time.sleep(0.1)\n"
            "with spans.span('sample', rows=2): pass\n")
    printed = spans_in_a_fresh_process({spans.PROFILE_DIR_ENV: str(tmp_path)}, code)
    assert printed.split() == ["True", "True"]
    recorded = [json.loads(line) for f in tmp_path.glob("spans-*.jsonl") for line in f.read_text().splitlines()]
    assert [(e["name"], e["ph"], e["args"]) for e in recorded] == [("sample", "X", {"rows": 2})]
    off = spans_in_a_fresh_process({spans.NVTX_ENV: "0"}, "from pipeline import spans\n"
                                   "print(spans._domain, spans._recorder, spans.span('x') is spans._NO_SPAN)")
    assert off.split() == ["None", "None", "True"]


def test_the_served_models_carry_the_spans_module(cpu_repo):
    for model in ("preprocessing", "postprocessing", "tensorrt_llm"):
        assert (cpu_repo / model / "1" / "pipeline" / "spans.py").is_file()
    assert (cpu_repo / "tensorrt_llm" / "1" / "pipeline" / "runtime" / "profiling.py").is_file()


# ------------------------------------------------------------------------------------------------ a GPU backend


@pytest.fixture(scope="module")
def gpu_repo(smollm2_hf_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("profile-gpu")
    plan = save_plan(make_plan(resolve_model_info("smollm2-135m"), get_target("rtx4090"), "fp16"), root / "p.json")
    return deploy_repository(load_plan(plan), root / "repo", engine=root / "engine", tokenizer=smollm2_hf_dir).path


def test_a_gpu_repository_without_nsys_names_the_package(gpu_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(main, ["profile", str(gpu_repo), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "needs `nsys` on PATH" in result.output and "nsight-systems" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backend, variable", [("engine", "TLLM_PROFILE_START_STOP"),   # the C++ executor's first
                                               ("pytorch", "TLLM_PROFILE_START_STOP"),
                                               ("reference", None)])
def test_the_nsys_command_captures_the_backends_iterations(gpu_repo, backend, variable, tmp_path):
    from pipeline.model_repository import read_repository

    plan = read_repository(gpu_repo).plan()
    if variable is None:     # the cpu target has no CUDA runtime: trtpipe profile records torch's profiler
        assert backend_for(backend).profile_start_stop_env is None
        return
    argv, env = profile_module.nsys_profile_command("nsys", backend_for(backend), plan, gpu_repo,
                                                    tmp_path / "profile", "20-80")
    assert argv[:8] == ["nsys", "profile", "-t", "cuda,nvtx,osrt", "--capture-range=cudaProfilerApi",
                        "--capture-range-end=stop", "--force-overwrite=true", "-o"]
    assert env == {variable: "20-80"}
    assert any("tritonserver" in a or "trtllm-serve" in a or "mpirun" in a for a in argv[9:])
    for bad in ("80-20", "x", "10"):
        with pytest.raises(profile_module.UserError, match="--capture-iterations"):
            profile_module.nsys_profile_command("nsys", backend_for(backend), plan, gpu_repo, tmp_path, bad)


def test_nsys_stats_summaries_are_read_back(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nsys"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    "echo \"$@\" > \"$(dirname \"$0\")/argv\"\n"
                    "while [ \"$1\" != \"--output\" ]; do shift; done\n"
                    "printf 'Time (%%),Total Time (ns),Instances,Name\\n61.5,2000000,40,gemm_fp16\\n' "
                    "> \"$2_cuda_gpu_kern_sum.csv\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert profile_module.find_nsys() == str(fake)
    tables = profile_module.nsys_stats(str(fake), tmp_path / "profile.nsys-rep", tmp_path)
    assert tables == {"cuda_gpu_kern_sum": [{"Time (%)": "61.5", "Total Time (ns)": "2000000", "Instances": "40",
                                             "Name": "gemm_fp16"}]}
    argv = (fake.parent / "argv").read_text().split()
    assert argv[:3] == ["stats", "--report", ",".join(profile_module.NSYS_REPORTS)] and "csv" in argv
