"""`trtpipe tune` (issue 18): SLOs, the search space and its memory constraint, the candidate repositories, the
Optuna study (resume, another model, pruning, an SLO nobody meets) and, slow, real studies on the cpu target."""

from __future__ import annotations

import csv
import json
import math
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.models import save_word_tokenizer

from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.errors import UserError
from pipeline.server import Endpoints
from pipeline.outputs import describe_outputs, read_manifest
from pipeline.plan import Workload, load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.sources import resolve_model
from pipeline.targets import GIB, get_target
from pipeline.tritonconfig import parse_pbtxt
from pipeline.tune import parse_slo
from pipeline.tune import trial as trial_module
from pipeline.tune.slo import best_level
from pipeline.tune.source import TuneSource
from pipeline.tune.space import Infeasible, Instances, build_space, candidate_plan
from pipeline.tune.study import open_study, records, run_study, study_key
from pipeline.tune.trial import render_candidate

GOOD_SLO = "ttft_p99<=60s,itl_p99<=30s"


# ----------------------------------------------------------------------------------------------
# Fixtures: tiny build directories, and a load whose figures follow the candidate's batch size


def make_build(root: Path, hf: Path) -> Path:
    """A `trtpipe build`-shaped directory: checkpoint/, plan.json (cpu target) and model_repo/."""
    model = root / "hf"
    shutil.copytree(hf, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    save_word_tokenizer(model)
    ckpt = convert_model(resolve_model(str(model)), root / "checkpoint", dtype="float32", progress=False).path
    plan = make_plan(resolve_model_info(str(ckpt)), get_target("cpu"), "fp32")
    save_plan(plan, root / "plan.json")
    deploy_repository(plan, root / "model_repo", checkpoint=ckpt)
    return root


@pytest.fixture(scope="module")
def build(tiny_llama, tmp_path_factory) -> Path:
    return make_build(tmp_path_factory.mktemp("tune-build"), tiny_llama("gqa"))


def level(concurrency: int, ttft_ms: float, itl_ms: float, tokens_per_s: float, failed: int = 0) -> dict:
    """A load level with run_level's keys."""
    requests = 2 * concurrency
    return {"concurrency": concurrency, "requests": requests, "completed": requests - failed, "shed": 0,
            "failed": failed, "errors": [], "wall_s": 1.0, "output_tokens": int(tokens_per_s),
            "output_tokens_per_s": tokens_per_s,
            "ttft_ms": {"p50": ttft_ms / 2, "p90": ttft_ms * 0.9, "p99": ttft_ms},
            "itl_ms": {"p50": itl_ms / 2, "p90": itl_ms * 0.9, "p99": itl_ms},
            "latency_ms": {"p50": ttft_ms + 10 * itl_ms, "p90": ttft_ms + 12 * itl_ms, "p99": ttft_ms + 15 * itl_ms}}


class FakeLoad:
    """Stands in for serving and the load generator: every trial's repository is really rendered; the figures
    of a level follow the batch size the repository's ensemble declares (bigger batches: more tokens/s, and a
    TTFT that grows with the clients each batch leaves waiting). `break_first` trials break the SLO at once."""

    def __init__(self, break_first: tuple[int, ...] = (), fail: tuple[int, ...] = ()):
        self.repos: list[Path] = []
        self.levels: list[list[int]] = []
        self.break_first, self.fail = break_first, fail
        self.meters = []

    @contextmanager
    def serving(self, repo: Path, url, log_path: Path, ready_timeout: float):
        self.repos.append(repo)
        self.levels.append([])
        if len(self.repos) - 1 in self.fail:
            raise UserError("the Triton server exited (status 1) before it was ready")
        batch = parse_pbtxt((repo / "ensemble" / "config.pbtxt").read_text()).max_batch_size
        url = f"http://fake/{len(self.repos)}"
        server = type("Server", (), {"http_url": url, "endpoints": Endpoints(url), "process": None})()
        yield type("Client", (), {"batch": batch, "server": server, "generate": lambda self, prompt, tokens: ""})()

    def run_load_level(self, client, load, concurrency: int, tokenizer: Path, workdir: Path, meter) -> dict:
        self.meters.append(meter)
        self.levels[-1].append(concurrency)
        if len(self.repos) - 1 in self.break_first:
            return level(concurrency, 10_000.0, 10.0, 1.0)
        waves = math.ceil(concurrency / client.batch)
        return level(concurrency, 20.0 * waves, 5.0 + client.batch, 10.0 * min(concurrency, client.batch))


@pytest.fixture
def fake_load(monkeypatch):
    def install(load: bool = True, **options) -> FakeLoad:
        fake = FakeLoad(**options)
        monkeypatch.setattr(trial_module, "serving", fake.serving)
        if load:
            monkeypatch.setattr(trial_module, "run_load_level", fake.run_load_level)
        return fake
    return install


def tune_cli(build: Path, out: Path, *args: str):
    return CliRunner().invoke(main, ["tune", str(build), "-o", str(out), "--concurrency", "1,2,4",
                                     "--prompts", "validate", "--requests-per-client", "1", "--max-tokens", "4",
                                     *args])


# ----------------------------------------------------------------------------------------------
# SLOs


def test_slo_clauses_are_read_in_milliseconds_and_judge_levels():
    slo = parse_slo("ttft_p99<=0.5s, itl_p90<50ms,latency_p50<=2000us,output_tokens_per_s>=20")
    assert [(c.metric, c.op, c.limit) for c in slo.clauses] == [
        ("ttft_p99", "<=", 500.0), ("itl_p90", "<", 50.0), ("latency_p50", "<=", 2.0),
        ("output_tokens_per_s", ">=", 20.0)]
    slo = parse_slo("ttft_p99<=500ms,itl_p99<=50ms")
    meets, slow_ttft, lost = level(4, 400, 40, 30), level(8, 600, 40, 50), level(4, 100, 10, 30, failed=1)
    assert slo.meets(meets) and slo.violation(meets) < 0
    assert not slo.meets(slow_ttft) and slo.violation(slow_ttft) == pytest.approx(0.2)
    assert not slo.meets(lost) and slo.latency_broken(lost)   # a request that failed has no latency to judge
    assert best_level([meets, slow_ttft, level(2, 100, 10, 20)], slo) is meets
    floor = parse_slo("output_tokens_per_s>=40")
    assert not floor.latency_broken(level(1, 9e9, 9e9, 1)) and floor.meets(slow_ttft)


def test_an_energy_clause_judges_a_level_by_its_joules_per_output_token():
    slo = parse_slo("ttft_p99<=1s,joules_per_token<=250mj")
    assert slo.clause("joules_per_token").limit == pytest.approx(0.25) and slo.text().endswith("<=0.25j")
    frugal, hungry = level(4, 400, 40, 30), level(4, 400, 40, 30)
    frugal["energy"], hungry["energy"] = {"joules_per_output_token": 0.2}, {"joules_per_output_token": 0.5}
    assert slo.meets(frugal) and not slo.meets(hungry) and slo.violation(hungry) == pytest.approx(1.0)
    unmeasured = {**frugal, "energy": {"joules_per_output_token": None, "reason": "no counter"}}
    assert not slo.meets(unmeasured) and not slo.meets(level(4, 400, 40, 30))   # never judged as met unmeasured


def test_an_energy_slo_without_a_readable_counter_is_refused(build, fake_load, tmp_path):
    fake_load()
    result = tune_cli(build, tmp_path / "study", "--slo", "ttft_p99<=1s,joules_per_token<=1j", "--trials", "1")
    assert result.exit_code == 2, result.output
    assert "bounds joules_per_token but no energy counter is readable" in result.output


def test_the_price_reaches_every_level_and_a_bad_one_exits_2(build, fake_load, tmp_path):
    fake = fake_load()
    result = tune_cli(build, tmp_path / "study", "--slo", "ttft_p99<=1s", "--trials", "1", "--price-per-hour", "0.7")
    assert result.exit_code == 0, result.output
    assert fake.meters and all(m.price == 0.7 and m.counter is None for m in fake.meters)
    for bad in ("0", "-1", "abc", "inf"):
        result = tune_cli(build, tmp_path / f"bad{bad}", "--slo", "ttft_p99<=1s", "--price-per-hour", bad)
        assert result.exit_code == 2 and "--price-per-hour must be a positive number" in result.output
        assert not (tmp_path / f"bad{bad}").exists()


@pytest.mark.parametrize("slo, message", [
    ("ttft_p99 500ms", "is not METRIC<=VALUE"),
    ("joules_per_token>=1j", "bound it from above"),
    ("joules_per_token<=1", "give the energy a unit"),
    ("ttft_p99<=500", "give the latency a unit"),
    ("ttft_p99>=500ms", "bound it from above"),
    ("output_tokens_per_s<=5", "bound it from below"),
    ("gpu_util<=50ms", "unknown metric 'gpu_util'"),
    ("ttft_p99<=1s,ttft_p99<=2s", "twice"),
    ("ttft_p99<=0ms", "must be positive"),
    ("", "--slo is empty"),
])
def test_a_bad_slo_is_exit_2_with_one_message(slo, message, tmp_path):
    result = CliRunner().invoke(main, ["tune", str(tmp_path), "--slo", slo])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "tune").exists()


# ----------------------------------------------------------------------------------------------
# The space, the overlay and the memory constraint


@pytest.mark.parametrize("model, target, precision", [("smollm2-135m", "cpu", "fp32"),
                                                      ("llama-3-8b", "rtx4090", "fp8")])
def test_the_default_candidate_is_the_plan_itself(model, target, precision):
    plan = make_plan(resolve_model_info(model), get_target(target), precision)
    space = build_space(plan, parse_slo("itl_p99<=50ms"), (1, 4, 8))
    again = candidate_plan(plan, space.default)
    assert (again.triton, again.memory, again.build_config) == (plan.triton, plan.memory, plan.build_config)
    assert space.default.max_batch_size == plan.triton.triton_max_batch_size


def test_an_engine_candidate_repository_carries_the_trials_values(tmp_path):
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    save_word_tokenizer(tokenizer)
    source = TuneSource(tmp_path, plan, tmp_path / "repo", None, tmp_path / "engine", tokenizer, tmp_path / "tune")
    space = build_space(plan, parse_slo("ttft_p99<=500ms"), (1, 8))
    assert {p.name for p in space.params} >= {"kv_cache_free_gpu_mem_fraction", "batch_scheduler_policy",
                                               "enable_chunked_context", "max_batch_size"}
    candidate = replace(space.default, max_batch_size=16, max_queue_delay_microseconds=500,
                        kv_cache_free_gpu_mem_fraction=0.6, batch_scheduler_policy="max_utilization",
                        enable_chunked_context=False, instances=Instances(preprocessing=3, postprocessing=2))
    trial_plan = candidate_plan(plan, candidate)
    repo = render_candidate(source, trial_plan, candidate, tmp_path / "candidate", source.engine)

    configs = {m: parse_pbtxt((repo / m / "config.pbtxt").read_text())
               for m in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")}
    assert {c.max_batch_size for c in configs.values()} == {16}
    trtllm = configs["tensorrt_llm"]
    params = {k: v.string_value for k, v in trtllm.parameters.items()}
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.6"
    assert params["batch_scheduler_policy"] == "max_utilization" and params["enable_chunked_context"] == "false"
    # the KV cache the planner gives 0.6 of the free memory, smaller than the plan's at 0.9
    kv_tokens = int(params["max_tokens_in_paged_kv_cache"])
    assert kv_tokens == trial_plan.memory.kv_cache_tokens < plan.memory.kv_cache_tokens
    assert params["gpt_model_path"] == str(tmp_path / "engine")
    assert trtllm.dynamic_batching.max_queue_delay_microseconds == 500
    assert configs["preprocessing"].instance_group[0].count == 3
    assert configs["postprocessing"].instance_group[0].count == 2
    manifest = read_manifest(repo)
    assert manifest["outputs"] == describe_outputs(repo)        # the manifest describes the files as they are
    assert manifest["params"]["instances"]["preprocessing"] == 3
    assert check_repository(repo).ok


def test_memory_infeasible_candidates_are_never_served(tmp_path, no_aic):
    """llama-3-8b fp16 on a GPU with room for the KV cache of a long sequence at 0.9 of the free memory but not at
    0.5: the study never serves a fraction the planner refuses, and records why (trtpipe's memory model: AIC's
    3.5 GiB of other memory refuses this GPU outright)."""
    target = replace(get_target("rtx4090"), memory_bytes=int(17.6 * GIB))
    plan = make_plan(resolve_model_info("llama-3-8b"), target, "fp16", workload=Workload(max_context=8192))
    slo = parse_slo("ttft_p99<=500ms")
    space = build_space(plan, slo, (1, 2))
    served = []

    def run_trial(number, candidate, trial_plan, should_stop):
        candidate_plan(plan, candidate)     # raises Infeasible if the study served what the planner refuses
        served.append(candidate.kv_cache_free_gpu_mem_fraction)
        return [level(1, 100, 10, 50), level(2, 150, 12, 90)]

    study = open_study(tmp_path / "study.db", study_key(plan, slo, {}, space), seed=3)
    run_study(study, plan, space, slo, 6, run_trial)
    done = records(study)
    refused = [r for r in done if r.kind == "infeasible"]
    assert len(served) == 6 and refused, [r.params for r in done]
    assert all("no room for the KV cache" in r.reason and not r.levels for r in refused)
    assert max(r.params["kv_cache_free_gpu_mem_fraction"] for r in refused) < min(served)


def test_an_interrupted_study_resumes_and_measures_the_plans_configuration(tmp_path):
    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    slo = parse_slo("ttft_p99<=1s")
    space = build_space(plan, slo, (1, 2))
    key = study_key(plan, slo, {}, space)

    def interrupted(number, candidate, trial_plan, should_stop):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_study(open_study(tmp_path / "study.db", key, seed=0), plan, space, slo, 2, interrupted)
    measured = []

    def run_trial(number, candidate, trial_plan, should_stop):
        measured.append(candidate)
        return [level(1, 100, 10, 20)]

    study = open_study(tmp_path / "study.db", key, seed=0)
    run_study(study, plan, space, slo, 2, run_trial)
    assert [r.kind for r in records(study)] == ["interrupted", "measured", "measured"]
    assert measured[0] == space.default and len(measured) == 2


def test_instances_that_do_not_fit_in_host_memory_are_infeasible():
    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    tokens = max(plan.triton.triton_max_batch_size * (plan.workload.input_len + plan.workload.output_len),
                 plan.max_seq_len)
    one = plan.weights_bytes_per_rank + tokens * plan.kv_bytes_per_token
    small = make_plan(plan.model, replace(plan.target, memory_bytes=plan.memory.runtime_reserve_bytes + int(1.5 * one)),
                      "fp32")
    default = build_space(small, parse_slo("ttft_p99<=1s"), (1,)).default
    candidate_plan(small, default)
    with pytest.raises(Infeasible, match="2 tensorrt_llm instances"):
        candidate_plan(small, replace(default, instances=Instances(tensorrt_llm=2)))


# ----------------------------------------------------------------------------------------------
# The study through the command line (rendering real, serving and load faked)


def test_study_starts_from_the_plan_resumes_and_refuses_another_model(build, fake_load, tiny_llama, tmp_path):
    fake = fake_load()
    out = tmp_path / "study"
    first = tune_cli(build, out, "--slo", "ttft_p99<=1s,itl_p99<=1s", "--trials", "2")
    assert first.exit_code == 0, first.output
    table = json.loads((out / "result" / "trials.json").read_text())["trials"]
    plan = load_plan(build / "plan.json")
    assert table[0]["origin"] == "plan default"
    assert table[0]["params"]["max_batch_size"] == plan.triton.triton_max_batch_size
    assert len(fake.repos) == 2 and fake.levels[0] == [1, 2, 4]
    # every level carries what its trial's plan predicted, for `trtpipe plan --measured trials.json`
    recorded = json.loads((out / "result" / "trials.json").read_text())
    assert recorded["measured_on"]["target"] == "cpu" and recorded["measured_on"]["backend"] == plan.backend
    for trial in table:
        for measured in trial["levels"]:
            assert measured["max_batch"] == trial["params"]["max_batch_size"]
            assert measured["input_tokens"] > 0 and measured["predicted"]["source"] == "timed"
    rows = list(csv.DictReader((out / "result" / "trials.csv").open()))
    assert all(float(r["predicted_tpot_ms"]) > 0 for r in rows)
    from pipeline.plan.feedback import read_measured

    assert len(read_measured(out / "result" / "trials.json").levels) == sum(len(t["levels"]) for t in table)

    again = tune_cli(build, out, "--slo", "ttft_p99<=1s,itl_p99<=1s", "--trials", "3")
    assert again.exit_code == 0, again.output
    resumed = json.loads((out / "result" / "trials.json").read_text())["trials"]
    assert len(fake.repos) == 3 and len(resumed) == 3
    assert [t["params"] for t in resumed[:2]] == [t["params"] for t in table]

    changed = tune_cli(build, out, "--slo", "ttft_p99<=2s", "--trials", "3")
    assert changed.exit_code == 2 and "another --slo" in changed.output

    other = make_build(tmp_path / "other", tiny_llama("mha"))
    refused = tune_cli(other, out, "--slo", "ttft_p99<=1s,itl_p99<=1s", "--trials", "3")
    assert refused.exit_code == 2, refused.output
    assert "a study from another model" in refused.output and "Traceback" not in refused.output
    assert len(fake.repos) == 3


def test_an_slo_no_trial_meets_is_exit_1_with_the_closest_trial(build, fake_load, tmp_path):
    fake_load()
    out = tmp_path / "study"
    result = tune_cli(build, out, "--slo", "ttft_p99<=1ms", "--trials", "2")
    assert result.exit_code == 1, result.output
    assert "no trial meets the SLO ttft_p99<=1ms; closest: trial" in result.output
    summary = json.loads((out / "result" / "summary.json").read_text())
    assert summary["met"] is False and summary["closest"]["trial"] in (0, 1)
    closest = summary["closest"]["level"]["ttft_ms"]["p99"]
    table = json.loads((out / "result" / "trials.json").read_text())["trials"]
    assert closest == min(lv["ttft_ms"]["p99"] for t in table for lv in t["levels"])
    for written in ("overlay.json", "plan.json", "model_repo"):   # nothing that looks like a deployment
        assert not (out / "result" / written).exists()
    assert (out / "result" / "trials.csv").is_file() and (out / "result" / "tradeoff.png").stat().st_size > 0


def test_a_trial_whose_first_level_breaks_the_slo_is_pruned(build, fake_load, tmp_path):
    fake = fake_load(break_first=(0,))
    out = tmp_path / "study"
    result = tune_cli(build, out, "--slo", "ttft_p99<=1s", "--trials", "2")
    assert result.exit_code == 0, result.output
    assert fake.levels[0] == [1] and fake.levels[1] == [1, 2, 4]   # the pruned trial stopped after one level
    table = json.loads((out / "result" / "trials.json").read_text())["trials"]
    assert table[0]["kind"] == "pruned" and "already breaks the SLO" in table[0]["reason"]
    assert table[1]["kind"] == "measured"
    import optuna

    study = optuna.load_study(study_name="trtpipe-tune", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["PRUNED", "COMPLETE"]


def test_the_aiperf_load_generator_measures_each_level(build, fake_load, monkeypatch, tmp_path):
    aiperf = pytest.importorskip("pipeline.validate.aiperf")
    fake_load(load=False)
    calls = []

    def run_aiperf(url, tokenizer, prompts, max_tokens, concurrency, request_count, workdir, **options):
        calls.append((url, Path(tokenizer), prompts, max_tokens, concurrency, request_count))
        return level(concurrency, 100.0, 10.0, 5.0 * concurrency)

    monkeypatch.setattr(aiperf, "aiperf_executable", lambda: "aiperf")
    monkeypatch.setattr(aiperf, "run_aiperf", run_aiperf)
    result = tune_cli(build, tmp_path / "study", "--slo", "ttft_p99<=1s", "--trials", "1", "--load-generator", "aiperf",
                      "--requests-per-client", "3")
    assert result.exit_code == 0, result.output
    assert [(c[0], c[4], c[5]) for c in calls] == [("http://fake/1", c, 3 * c) for c in (1, 2, 4)]
    assert calls[0][1] == build / "model_repo" / "preprocessing" / "1" / "tokenizer" and calls[0][3] == 4
    table = json.loads((tmp_path / "study" / "result" / "trials.json").read_text())["trials"]
    assert [lv["output_tokens_per_s"] for lv in table[0]["levels"]] == [5.0, 10.0, 20.0]


def test_a_candidate_the_server_cannot_load_fails_its_trial_only(build, fake_load, tmp_path):
    fake = fake_load(fail=(1,))
    out = tmp_path / "study"
    result = tune_cli(build, out, "--slo", "ttft_p99<=1s", "--trials", "3")
    assert result.exit_code == 0, result.output
    table = json.loads((out / "result" / "trials.json").read_text())["trials"]
    assert [t["kind"] for t in table] == ["measured", "failed", "measured"] and len(fake.repos) == 3
    assert "exited (status 1) before it was ready" in table[1]["reason"]


def test_the_plans_configuration_must_serve(build, fake_load, tmp_path):
    fake_load(fail=(0,))
    result = tune_cli(build, tmp_path / "study", "--slo", "ttft_p99<=1s", "--trials", "3")
    assert result.exit_code == 2 and "exited (status 1) before it was ready" in result.output


def gpu_build(out: Path) -> None:
    """A Llama-3-8B FP8 rtx4090 build directory as far as this machine gets: plan.json and model_repo/."""
    plan = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8")
    save_plan(plan, out / "plan.json")
    save_word_tokenizer(out)
    deploy_repository(plan, out / "model_repo", engine=out / "engine", tokenizer=out)


def test_gpu_trials_need_the_gpu_server(tmp_path):
    gpu_build(tmp_path)
    result = CliRunner().invoke(main, ["tune", str(tmp_path), "--slo", "ttft_p99<=500ms"])
    assert result.exit_code == 2
    assert "needs the GPU server" in result.output and "--url" in result.output
    assert not (tmp_path / "tune").exists()


def test_rebuild_is_refused_on_the_cpu_target(build, tmp_path):
    result = tune_cli(build, tmp_path / "study", "--slo", GOOD_SLO, "--rebuild")
    assert result.exit_code == 2 and "--rebuild recompiles TensorRT-LLM engines" in result.output


def test_rebuild_without_trtllm_build_is_refused_before_any_trial(tmp_path):
    gpu_build(tmp_path)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "rank0.safetensors").write_bytes(b"")
    result = CliRunner().invoke(main, ["tune", str(tmp_path), "--slo", "ttft_p99<=500ms", "--rebuild",
                                       "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "--rebuild compiles each candidate with trtllm-build" in result.output
    assert not (tmp_path / "tune").exists()


# ----------------------------------------------------------------------------------------------
# Real studies: served by Triton, measured


@pytest.mark.slow
def test_a_real_short_study_on_the_cpu_target(build, tmp_path):
    out = tmp_path / "study"
    result = tune_cli(build, out, "--slo", GOOD_SLO, "--trials", "2", "--concurrency", "1,2")
    assert result.exit_code == 0, result.output
    done = out / "result"
    trials = json.loads((done / "trials.json").read_text())["trials"]
    assert [t["kind"] for t in trials] == ["measured", "measured"]
    for trial in trials:
        for measured in trial["levels"]:
            assert measured["completed"] == measured["requests"] and measured["output_tokens_per_s"] > 0
            assert all(measured[m]["p99"] >= measured[m]["p50"] > 0 for m in ("ttft_ms", "latency_ms"))
    rows = list(csv.DictReader((done / "trials.csv").open()))
    assert [int(r["trial"]) for r in rows] == [0, 1] and all(float(r["ttft_p99_ms"]) > 0 for r in rows)
    for plot in ("tradeoff.png", "importances.png"):
        assert (done / plot).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((done / "summary.json").read_text())
    best = trials[summary["best"]["trial"]]
    overlay = json.loads((done / "overlay.json").read_text())
    assert overlay["candidate"]["max_batch_size"] == best["params"]["max_batch_size"]
    tuned = load_plan(done / "plan.json")
    assert tuned.triton.triton_max_batch_size == best["params"]["max_batch_size"]
    assert tuned.triton.max_queue_delay_microseconds == best["params"]["max_queue_delay_microseconds"]
    assert check_repository(done / "model_repo").ok
    served = parse_pbtxt((done / "model_repo" / "tensorrt_llm" / "config.pbtxt").read_text())
    assert served.max_batch_size == best["params"]["max_batch_size"]
    assert served.instance_group[0].count == best["params"]["tensorrt_llm_instances"]
    assert (out / "trials" / "trial-0" / "tritonserver.log").is_file()


@pytest.mark.slow
def test_trials_are_loaded_into_a_running_server_with_model_control(build, tmp_path):
    """--url: a tritonserver in explicit model-control mode gets each trial's configs (checked against what it then
    serves) and the load; the last trial's configuration is what it serves afterwards."""
    import requests

    from pipeline import server as triton

    dist = triton.find_distribution()
    backends = triton.prepare_backends(dist, tmp_path / "ws")
    ports = (triton.free_port(), triton.free_port(), triton.free_port())
    command = triton.server_command(dist, build / "model_repo", backends, ports, "127.0.0.1", "explicit")
    process = triton._launch(command,
                             triton.server_environment(dist, tmp_path / "ws"), ports, "127.0.0.1",
                             tmp_path / "server.log", build / "model_repo")
    try:
        triton.wait_until_ready(process, 600)
        out = tmp_path / "study"
        result = tune_cli(build, out, "--slo", GOOD_SLO, "--trials", "2", "--concurrency", "1,2",
                          "--url", process.http_url)
        assert result.exit_code == 0, result.output
        trials = json.loads((out / "result" / "trials.json").read_text())["trials"]
        assert [t["kind"] for t in trials] == ["measured", "measured"]
        config = requests.get(f"{process.http_url}/v2/models/tensorrt_llm/config", timeout=30).json()
        assert config["max_batch_size"] == trials[-1]["params"]["max_batch_size"]
        assert config["instance_group"][0]["count"] == trials[-1]["params"]["tensorrt_llm_instances"]
        # an empty parameter reaches the models as {"string_value": ""} (Triton 2.51's JSON of the config), which
        # NVIDIA's preprocessing reads with [] (nvidia_contract: multimodal_model_path, fatal when missing)
        pre = requests.get(f"{process.http_url}/v2/models/preprocessing/config", timeout=30).json()
        assert pre["parameters"]["multimodal_model_path"] == {"string_value": ""}
    finally:
        triton.stop_server(process.process)
