"""More than one GPU: Llama-3.1-70B planned over 4 x RTX 4090 and 2 x H100, what the missing peer-to-peer
access costs, refusals that say what would fit, and how a multi-GPU repository is served (NVIDIA's
leader-mode launch: one tritonserver per rank under mpirun). Nothing here runs on a GPU."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.backends.base import shell_command
from pipeline.cli import main
from pipeline.deploy import deploy_repository
from pipeline.model_repository import read_deployment
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.presets import PRESETS
from pipeline.targets import get_target
from pipeline.model.arch_config import parameter_count

ARCH = PRESETS["llama-3.1-70b"].arch


def plan70(target: str, precision: str, tp: int):
    return make_plan(resolve_model_info("llama-3.1-70b"), get_target(target), precision, tp=tp)


def test_the_70b_preset_has_the_published_parameter_count():
    assert abs(parameter_count(ARCH) / 70.6e9 - 1) < 1e-3


def test_fp8_on_four_rtx4090s_fits_and_states_the_cost_of_no_peer_to_peer():
    plan = plan70("rtx4090", "fp8", 4)
    assert plan.tp_size == 4 and plan.max_concurrent_sequences >= 1
    assert plan.weights_bytes_per_rank < get_target("rtx4090").memory_bytes
    warning = next(w for w in plan.warnings if "peer-to-peer" in w)
    batch = plan.max_concurrent_sequences
    # 2 all-reduces per layer of batch x hidden bf16 values; a ring moves 2(tp-1)/tp of them per GPU,
    # twice over PCIe 4.0 x16 (31.5 GB/s) when staged through host memory
    seconds = 2 * 80 * 2 * (2 * 3 / 4) * batch * 8192 * 2 / 31.5e9
    assert f"A decode step makes 160 of them; at batch {batch}" in warning
    assert f"takes at least {seconds * 1e3:.1f} ms" in warning


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_two_h100s_hold_the_70b_with_nvlink_and_no_warning(precision):
    plan = plan70("h100", precision, 2)
    assert plan.max_concurrent_sequences >= 1
    assert not any("peer-to-peer" in w for w in plan.warnings)


@pytest.mark.parametrize("args, message", [
    (["--target", "rtx4090", "--precision", "fp8", "--tp", "2"],
     "use a lower precision (int4-awq) or more GPUs (--tp 4)"),
    (["--target", "rtx4090", "--precision", "bf16", "--tp", "4"], "use a lower precision (fp8, int8-sq, int4-awq)"),
    (["--target", "rtx4090", "--precision", "fp8", "--tp", "8"], "the rtx4090 target has at most 4"),
    (["--target", "h100", "--precision", "bf16"],
     "use a lower precision (fp8, int8-sq, int4-awq) or more GPUs (--tp 2)"),
])
def test_layouts_that_cannot_hold_the_70b_fail_fast_saying_what_would(tmp_path, args, message):
    result = CliRunner().invoke(main, ["plan", "llama-3.1-70b", *args, "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "plan.json").exists() and "Traceback" not in result.output


def test_a_four_gpu_repository_records_the_leader_mode_launch(tmp_path, smollm2_hf_dir):
    """deploy records (and prints) how to serve the repository: mpirun with one tritonserver per rank, the
    ranks after the first loading only tensorrt_llm, each rank its own shared-memory prefix."""
    result = deploy_repository(plan70("rtx4090", "fp8", 4), tmp_path / "repo", engine=tmp_path / "engine",
                               tokenizer=smollm2_hf_dir)
    record = read_deployment(result.path)
    command = list(record.serve_command)
    assert record.world_size == 4 and command[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = " ".join(command[2:]).split(" : ")
    assert len(ranks) == 4
    assert all(f"shm-region-prefix-name=prefix{r}_" in rank for r, rank in enumerate(ranks))
    assert "--load-model=tensorrt_llm" not in ranks[0]
    assert all("--model-control-mode=explicit --load-model=tensorrt_llm" in rank for rank in ranks[1:])
    assert "serve it on 4 GPUs in the trtpipe image with:\n  cd " in result.summary()
    assert shell_command(command) in result.summary()
    recorded = json.loads((result.path / "manifest.json").read_text())["deployment"]["serve_command"]
    assert "--model-repository=$MODEL_REPOSITORY" in recorded and not any(str(tmp_path) in a for a in recorded)


def test_one_gpu_and_the_cpu_target_serve_with_one_process():
    from pipeline.backends import backend_for

    one = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")
    assert backend_for(one.backend).serve_command(one)[0] == "tritonserver"
    cpu = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    assert backend_for(cpu.backend).serve_command(cpu)[:2] == ["tritonserver", "--model-repository=$MODEL_REPOSITORY"]
