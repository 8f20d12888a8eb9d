"""`trtpipe k8s`: manifests sized from the plan, validated offline, metric names checked on a live Triton."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import requests
import yaml
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.k8s import K8sOptions, monitoring as mon, scale_ratio, write_k8s
from pipeline.k8s.dashboard import dashboard_expressions
from pipeline import triton_metrics as gpu
from pipeline.k8s.manifests import GPU_PRODUCTS, LOAD_BYTES_PER_S, SHM_PER_RANK, VOLUME_ROOT
from pipeline.k8s.source import read_source
from pipeline.plan import Workload, load_plan, resolve_model_info, save_plan
from pipeline.planner import make_plan
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.tritonconfig import parse_pbtxt

FIXTURE_REPO = Path(__file__).parent / "fixtures_repo"
CRD_DIR = Path(__file__).parent / "data" / "prometheus-operator"
GATEWAY_CRD = Path(__file__).parent / "data" / "gateway-api" / "gateway.networking.k8s.io_httproutes.yaml"
K8S_VERSIONS = ("1.30.0", "1.37.0")
GIB = 1 << 30


def make_build(root: Path, plan, model: str, **deploy_args) -> Path:
    """A build directory as `trtpipe build` leaves it: plan.json, model_repo/, build.json."""
    root.mkdir(parents=True)
    save_plan(plan, root / "plan.json")
    deploy_repository(plan, root / "model_repo", **deploy_args)
    (root / "build.json").write_text(json.dumps({"options": {"model": model}}))
    return root


@pytest.fixture(scope="module")
def builds(tiny_llama, smollm2_hf_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builds")
    checkpoint = root / "checkpoint"
    convert_model(resolve_model(str(tiny_llama("gqa"))), checkpoint, progress=False)
    (checkpoint / "tokenizer").mkdir(exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2_hf_dir / f, checkpoint / "tokenizer" / f)
    smollm2, llama = resolve_model_info("smollm2-135m"), resolve_model_info("llama-3-8b")
    return {
        "cpu": make_build(root / "cpu", make_plan(smollm2, get_target("cpu"), "fp32"), "smollm2-135m",
                          checkpoint=checkpoint),
        "rtx4090": make_build(root / "rtx4090", make_plan(llama, get_target("rtx4090"), "fp8"), "llama-3-8b",
                              engine=root / "engine-4090", tokenizer=smollm2_hf_dir),
        "h100-tp2": make_build(root / "h100", make_plan(llama, get_target("h100"), "fp16", "auto", 2),
                               "meta-llama/Meta-Llama-3-8B", engine=root / "engine-h100", tokenizer=smollm2_hf_dir),
    }


@pytest.fixture(scope="module")
def written(builds, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("k8s")
    return {key: write_k8s(build, out / key, K8sOptions(image="registry.example/trtpipe:0.1.0",
                                                        namespace="llm")).out
            for key, build in builds.items()}


def objects(out: Path) -> dict[str, dict]:
    """kind -> object for every YAML file written (the kustomization's and the loader pod)."""
    found = {}
    for f in sorted(out.glob("*.yaml")):
        obj = yaml.safe_load(f.read_text())
        found[obj["kind"]] = obj
    return found


def pod(out: Path) -> dict:
    return objects(out)["Deployment"]["spec"]["template"]["spec"]


# ---------------------------------------------------------------------------------------- validation


def test_every_manifest_validates_strictly_against_two_kubernetes_versions(written):
    checked = set()
    for out in written.values():
        for kind, obj in objects(out).items():
            if kind in ("Kustomization", "PodMonitor", "PrometheusRule"):
                continue
            for version in K8S_VERSIONS:
                assert kubernetes_validate.validate(obj, version, strict=True)
            checked.add(kind)
    assert checked == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                       "PersistentVolumeClaim", "ConfigMap", "Pod"}
    # the validator is strict: a misspelt field is refused
    broken = objects(written["cpu"])["Deployment"]
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    """The CRD's v1 openAPIV3Schema, closed like `kubectl --validate=strict` (tests/data/.../SOURCE.md)."""
    crd_file = {"PodMonitor": CRD_DIR / "monitoring.coreos.com_podmonitors.yaml",
                "PrometheusRule": CRD_DIR / "monitoring.coreos.com_prometheusrules.yaml",
                "HTTPRoute": GATEWAY_CRD}[kind]
    crd = yaml.safe_load(crd_file.read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
    close(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_prometheus_operator_kinds_validate_against_the_crd_schemas(written, kind):
    validator = crd_validator(kind)
    for out in written.values():
        obj = objects(out)[kind]
        assert not list(validator.iter_errors(obj)), [e.message for e in validator.iter_errors(obj)]
    broken = objects(written["cpu"])[kind]
    if kind == "PodMonitor":
        broken["spec"]["podMetricsEndpoints"][0]["prot"] = "metrics"
    else:
        broken["spec"]["groups"][0]["rules"][0]["recrd"] = "x"
    assert list(validator.iter_errors(broken))


def test_kustomization_applies_every_manifest_in_the_namespace(written):
    for out in written.values():
        kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
        manifests = {f.name for f in out.glob("*.yaml")} - {"kustomization.yaml", "model-repo-loader.yaml"}
        assert set(kustomization["resources"]) == manifests and kustomization["namespace"] == "llm"
        assert yaml.safe_load((out / "model-repo-loader.yaml").read_text())["metadata"]["namespace"] == "llm"


# ---------------------------------------------------------------------------------------- sized from the plan


@pytest.mark.parametrize("key", ["rtx4090", "h100-tp2"])
def test_gpu_pod_is_sized_from_the_plan(builds, written, key):
    plan = load_plan(builds[key] / "plan.json")
    ranks = plan.tp_size * plan.pp_size
    spec = pod(written[key])
    triton, front = spec["containers"]
    assert front["name"] == "openai" and front["command"][-4:] == ["--url", "http://127.0.0.1:8000", "--timeout",
                                                                   str(startup_seconds(triton))]
    assert "nvidia.com/gpu" not in front["resources"]["requests"]
    resources = triton["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == str(ranks)
    memory = int(resources["requests"]["memory"].removesuffix("Gi")) * GIB
    assert memory >= plan.weights_bytes + ranks * SHM_PER_RANK
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    product = next(e for e in terms[0]["matchExpressions"] if e["key"] == "nvidia.com/gpu.product")
    assert product["values"] == GPU_PRODUCTS[plan.target.name]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": f"{ranks * SHM_PER_RANK // GIB}Gi"}
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= plan.weights_bytes / LOAD_BYTES_PER_S
    # liveness exercises the models (a dead Python model's process leaves /v2/health/live at 200): trtpipe probe
    liveness = triton["livenessProbe"]
    assert liveness["exec"]["command"][:4] == ["trtpipe", "probe", "--url", "http://127.0.0.1:8000"]
    assert liveness["timeoutSeconds"] > float(liveness["exec"]["command"][-1])
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert [p["name"] for p in triton["ports"]] == ["http", "grpc", "metrics"]
    servers = [i for i, arg in enumerate(triton["command"]) if arg == "tritonserver"]
    assert len(servers) == ranks
    drain = int(next(a for a in triton["command"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    assert drain >= plan.max_seq_len * plan.decode_step_s >= plan.max_seq_len * plan.roofline.decode_step_s
    assert spec["terminationGracePeriodSeconds"] > drain
    if ranks > 1:   # leader mode: mpirun, ranks above 0 load only tensorrt_llm
        assert triton["command"][:2] == ["mpirun", "--allow-run-as-root"]
        assert triton["command"].count("--load-model=tensorrt_llm") == ranks - 1


def startup_seconds(container: dict) -> int:
    probe = container["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_the_pod_serves_the_openai_api_beside_triton_and_the_service_exposes_it(builds, written):
    """trtpipe's front over the pod's Triton, from the same image, with the repository's tokenizer; its command is
    one `trtpipe serve` accepts (tests/test_openai_front.py runs it over a live server)."""
    from pipeline.cli import main

    for key in ("cpu", "rtx4090"):
        spec = pod(written[key])
        triton, front = spec["containers"]
        assert front["image"] == triton["image"] and front["ports"] == [{"name": "openai", "containerPort": 9000}]
        assert front["command"][:4] == ["trtpipe", "serve", f"{VOLUME_ROOT}/model_repo", "--openai"]
        assert front["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"}
        assert {"name": "model-repo", "mountPath": VOLUME_ROOT, "readOnly": True} in front["volumeMounts"]
        assert front["securityContext"] == triton["securityContext"]
        serve = main.get_command(None, "serve").make_context("serve", front["command"][2:])
        assert serve.params["url"] == "http://127.0.0.1:8000" and serve.params["openai_port"] == 9000
        ports = objects(written[key])["Service"]["spec"]["ports"]
        assert {"name": "openai", "port": 9000, "targetPort": "openai"} in ports


def test_cpu_target_gets_the_same_manifests_without_gpus(builds, written):
    gpu_kinds = set(objects(written["rtx4090"]))
    cpu = objects(written["cpu"])
    assert set(cpu) == gpu_kinds - {"ConfigMap"}   # no engine, so no engine path to rewrite
    text = "".join(f.read_text() for f in written["cpu"].glob("*.yaml"))
    assert "nvidia.com/gpu" not in text
    spec = pod(written["cpu"])
    assert "affinity" not in spec and "tolerations" not in spec
    assert "--allow-gpu-metrics=false" in spec["containers"][0]["command"]
    # NVIDIA's Python models resolve the repository-relative tokenizer_dir against the working directory
    assert spec["containers"][0]["workingDir"] == f"{VOLUME_ROOT}/model_repo"
    plan = load_plan(builds["cpu"] / "plan.json")
    memory = int(spec["containers"][0]["resources"]["requests"]["memory"].removesuffix("Gi")) * GIB
    assert memory >= plan.memory.weights_bytes_per_rank + plan.memory.kv_cache_bytes + SHM_PER_RANK


def test_engine_path_is_rewritten_into_the_volume_and_nothing_else_changes(builds, written):
    config_map = objects(written["rtx4090"])["ConfigMap"]
    served = parse_pbtxt(config_map["data"]["config.pbtxt"])
    original = parse_pbtxt((builds["rtx4090"] / "model_repo" / "tensorrt_llm" / "config.pbtxt").read_text())
    assert served.parameters["gpt_model_path"].string_value == "/trtpipe/engine"
    served.parameters["gpt_model_path"].string_value = original.parameters["gpt_model_path"].string_value
    assert served == original
    mounts = pod(written["rtx4090"])["containers"][0]["volumeMounts"]
    assert {"name": "engine-config", "mountPath": "/trtpipe/model_repo/tensorrt_llm/config.pbtxt",
            "subPath": "config.pbtxt", "readOnly": True} in mounts


def test_nothing_written_names_the_build_machine(builds, written):
    for key, out in written.items():
        text = "".join(f.read_text() for f in out.iterdir())
        assert str(builds[key].parent) not in text
        assert not re.search(r"/(home|tmp|root|work)/", text)


def test_names_come_from_the_model_and_target(written):
    assert objects(written["cpu"])["Deployment"]["metadata"]["name"] == "smollm2-135m-cpu"
    assert objects(written["h100-tp2"])["Deployment"]["metadata"]["name"] == "meta-llama-3-8b-h100"


def test_autoscaler_target_comes_from_the_plan_or_the_flag(builds, tmp_path):
    src = read_source(builds["rtx4090"], None)
    assert scale_ratio(src, None) == 1.0 and scale_ratio(src, 2.5) == 2.5
    latency = src.plan.request_latency_s     # the performance model's (derived for the 4090)
    assert src.plan.performance.source == "derived" and latency > src.plan.roofline.request_latency_s
    budgeted = make_plan(resolve_model_info("llama-3-8b"), get_target("rtx4090"), "fp8",
                         workload=Workload(p99_latency_s=3 * latency))
    build = make_build(tmp_path / "b", budgeted, "llama-3-8b", engine=tmp_path / "engine",
                       tokenizer=builds["rtx4090"] / "model_repo" / "preprocessing" / "1" / "tokenizer")
    expected = (3 * latency - budgeted.request_latency_s) / budgeted.request_latency_s
    assert scale_ratio(read_source(build, None), None) == pytest.approx(expected, abs=1e-3)
    result = CliRunner().invoke(main, ["k8s", str(build), "-o", str(tmp_path / "k8s"), "--scale-ratio", "1.5",
                                       "--replicas", "2:6"])
    assert result.exit_code == 0, result.output
    hpa = objects(tmp_path / "k8s")["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["metrics"][0]["pods"] == {"metric": {"name": mon.QUEUE_COMPUTE_RATIO},
                                         "target": {"type": "AverageValue", "averageValue": "1500m"}}


# ---------------------------------------------------------------------------------------- PromQL and metric names


def selector_names(expr: str) -> set[str]:
    names: set[str] = set()
    promql_parser.walk(promql_parser.parse(expr), lambda node: names.add(node.name)
                       if isinstance(node, promql_parser.VectorSelector) else None)
    return names


def used_expressions(out: Path) -> list[str]:
    rule = objects(out)["PrometheusRule"]
    board = json.loads((out / "grafana-dashboard.json").read_text())
    hpa_metric = objects(out)["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    return [*mon.rule_expressions(rule), *dashboard_expressions(board), hpa_metric]


RECORDED = {mon.QUEUE_COMPUTE_RATIO, mon.QUEUE_AVERAGE, mon.COMPUTE_AVERAGE, mon.REQUEST_AVERAGE}
KNOWN = (set(mon.TRITON) | set(mon.TRTLLM_BACKEND) | set(gpu.TRITON_GPU) | set(mon.DCGM_EXPORTER) | set(mon.CLUSTER)
         | RECORDED | {mon.OUTPUT_TOKENS})   # OUTPUT_TOKENS: a series of the OUTPUT_TOKEN_LEN histogram


def check_expression(expr: str) -> set[str]:
    """The series `expr` reads, after checking it parses, names only monitoring's series and stays in this
    deployment: its scrape job, or (dcgm-exporter's series, scraped under the exporter's job) its namespace and pods."""
    names = selector_names(expr)
    assert names <= KNOWN, names - KNOWN
    if names & set(mon.DCGM_EXPORTER):
        assert 'namespace="llm", pod=~"' in expr, expr
    else:
        assert 'job="llm/' in expr or expr == mon.QUEUE_COMPUTE_RATIO or mon.REPLICAS_UNAVAILABLE in expr, expr
    return names


def test_every_expression_parses_and_reads_only_known_series(written):
    rule = objects(written["cpu"])["PrometheusRule"]
    recorded = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    assert recorded == RECORDED
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {"TritonRequestFailureRate", "TritonQueueTimeHigh", "TensorRTLLMKVCacheFreeBlocksLow",
                      "TritonPodsNotReady"}
    used: set[str] = set()
    for out in written.values():
        for expr in used_expressions(out):
            used |= check_expression(expr)
    # the dashboard shows each kind the issue lists
    assert {mon.REQUEST_FAILURE, mon.QUEUE_COMPUTE_RATIO, mon.TRTLLM_INFLIGHT, mon.TRTLLM_KV_BLOCKS,
            gpu.GPU_UTILIZATION, gpu.GPU_MEMORY_USED, gpu.GPU_POWER, mon.OUTPUT_TOKENS, gpu.GPU_ENERGY,
            mon.CPU_MEMORY_USED, *mon.DCGM_EXPORTER} <= used


def board_panels(out: Path) -> dict[str, dict]:
    """Title -> panel of the dashboard written in `out` (rows left out)."""
    board = json.loads((out / "grafana-dashboard.json").read_text())
    return {p["title"]: p for p in board["panels"] if p.get("type") != "row"}


def targets(panel: dict) -> list[tuple[str, str]]:
    return [(t["expr"], t["legendFormat"]) for t in panel["targets"]]


def test_the_energy_row_shows_joules_per_token_from_triton_and_a_dcgm_exporter(written):
    found = board_panels(written["rtx4090"])
    joules = found["Joules per output token"]
    assert joules["fieldConfig"]["defaults"]["unit"] == "joule"
    (triton, _), (dcgm, legend) = targets(joules)
    assert selector_names(triton) == {gpu.GPU_ENERGY, mon.OUTPUT_TOKENS}
    assert f"rate({gpu.GPU_ENERGY}{{" in triton and f"rate({mon.OUTPUT_TOKENS}{{" in triton
    assert selector_names(dcgm) == {mon.DCGM_ENERGY, mon.OUTPUT_TOKENS}
    assert f"/ {mon.MILLIJOULES_PER_JOULE} /" in dcgm and legend.endswith("(DCGM exporter)")   # mJ -> J
    power = dict((legend, expr) for expr, legend in targets(found["GPU power (DCGM) and its limit"]))
    assert selector_names(power["{{pod}} power (DCGM exporter)"]) == {mon.DCGM_POWER}
    per_joule = [legend for _, legend in targets(found["Output tokens per joule"])]
    assert per_joule == ["{{pod}}", "{{pod}} (DCGM exporter)"]
    # only the deployment's own pods: a canary named <name>-fp8 has one more '-' part and is not matched
    pods = re.search(r'pod=~"([^"]+)"', dcgm).group(1)
    name = objects(written["rtx4090"])["Deployment"]["metadata"]["name"]
    assert re.fullmatch(pods, f"{name}-7d9f8b6c5d-x2k4p") and not re.fullmatch(pods, f"{name}-fp8-7d9f8b6c5d-x2k4p")


def test_peak_memory_is_shown_for_the_gpus_and_the_host(written):
    for out in written.values():
        peak = targets(board_panels(out)[f"Peak memory (over {mon.PEAK_WINDOW})"])
        exprs = [expr for expr, _ in peak]
        assert any(f"max_over_time({gpu.GPU_MEMORY_USED}{{" in e and f"[{mon.PEAK_WINDOW}]" in e for e in exprs)
        assert any(f"max_over_time({mon.CPU_MEMORY_USED}{{" in e for e in exprs)
        assert all(e.startswith("max by (pod) ") for e in exprs)


def test_the_cost_panel_appears_only_with_a_price(builds, written, tmp_path):
    assert not [t for t in board_panels(written["cpu"]) if "Cost" in t]
    priced = write_k8s(builds["cpu"], tmp_path / "k8s", K8sOptions(image="registry.example/trtpipe:0.1.0",
                                                                    namespace="llm", price_per_hour=0.69)).out
    found = board_panels(priced)
    (cost,) = [p for t, p in found.items() if t.startswith("Cost per million output tokens")]
    assert cost["fieldConfig"]["defaults"]["unit"] == "currencyUSD"
    ((expr, _),) = targets(cost)
    assert "0.69 / 3600 / (" in expr and expr.endswith(" * 1e6")
    assert check_expression(expr) == {mon.OUTPUT_TOKENS}
    # nothing else changes: the same files, the same panels but the one
    assert sorted(p.name for p in priced.iterdir()) == sorted(p.name for p in written["cpu"].iterdir())
    assert set(found) - set(board_panels(written["cpu"])) == {cost["title"]}
    for f in ("deployment.yaml", "prometheusrule.yaml", "hpa.yaml"):
        assert (priced / f).read_text() == (written["cpu"] / f).read_text()


@pytest.fixture(scope="module")
def live_metrics(triton_pool) -> set[str]:
    """Metric families the embedded Triton serves after good and bad requests to the fixture ensemble."""
    server = triton_pool.get(FIXTURE_REPO)
    url = f"{server.http_url}/v2/models/ensemble/generate"
    for prompt in ("one two three", "four five"):
        assert requests.post(url, json={"text_input": prompt, "max_tokens": 4}, timeout=30).status_code == 200
    assert requests.post(url, json={"text_input": "no max_tokens"}, timeout=30).status_code >= 400
    text = requests.get(f"{server.endpoints.metrics_url}/metrics", timeout=30).text
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


def test_triton_names_are_served_by_a_live_triton(live_metrics):
    assert set(mon.TRITON) <= live_metrics, set(mon.TRITON) - live_metrics
    # the other lists are what this GPU-less Triton cannot serve: they rest on the documented sources
    unserved = set(mon.TRTLLM_BACKEND) | set(gpu.TRITON_GPU) | set(mon.DCGM_EXPORTER) | set(mon.CLUSTER)
    assert not unserved & live_metrics


# ---------------------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0:3"], "at least 1"),
    (["--replicas", "3:2"], "below the minimum"),
    (["--replicas", "two"], "MIN:MAX"),
    (["--replicas", "1:"], "MIN:MAX"),
    (["--repo-source", "s3://bucket/repo"], "--repo-source"),
    (["--repo-source", "artifact:/srv/model.tar"], "artifact:URL"),
    (["--repo-source", "artifact:https://a.example/m.tar"], "pin the archive: artifact:URL#sha256=HEX"),
    (["--repo-source", "artifact:https://a.example/m.tar#sha256=12ab"], "pin the archive"),
    (["--namespace", "Bad_NS"], "--namespace"),
    (["--name", "-x"], "--name"),
    (["--price-per-hour", "0"], "--price-per-hour must be a positive number"),
    (["--price-per-hour", "-1.5"], "--price-per-hour must be a positive number"),
    (["--price-per-hour", "two dollars"], "--price-per-hour must be a positive number"),
    (["--price-per-hour", "nan"], "--price-per-hour must be a positive number"),
    (["--price-per-hour", "inf"], "--price-per-hour must be a positive number"),
])
def test_bad_flags_exit_2_with_one_message_and_write_nothing(builds, tmp_path, flags, message):
    out = tmp_path / "k8s"
    result = CliRunner().invoke(main, ["k8s", str(builds["cpu"]), "-o", str(out), *flags])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_plan_for_an_unknown_target_exits_2_and_writes_nothing(builds, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(builds["rtx4090"], build)
    plan = json.loads((build / "plan.json").read_text())
    plan["target"]["name"] = "tpu9000"
    (build / "plan.json").write_text(json.dumps(plan))
    result = CliRunner().invoke(main, ["k8s", str(build), "-o", str(tmp_path / "k8s")])
    assert result.exit_code == 2 and "unknown target 'tpu9000'" in result.output, result.output
    assert not (tmp_path / "k8s").exists()


def test_a_repository_is_read_through_its_deploy_manifest_and_an_existing_claim_is_used(builds, tmp_path):
    result = CliRunner().invoke(main, ["k8s", str(builds["cpu"] / "model_repo"), "-o", str(tmp_path / "k8s"),
                                       "--repo-source", "pvc:models", "--name", "chat"])
    assert result.exit_code == 0, result.output
    found = objects(tmp_path / "k8s")
    assert "PersistentVolumeClaim" not in found
    assert pod(tmp_path / "k8s")["volumes"][0]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert found["Deployment"]["metadata"]["name"] == "chat"
    again = CliRunner().invoke(main, ["k8s", str(builds["cpu"]), "-o", str(tmp_path / "k8s")])
    assert again.exit_code == 2 and "--force" in again.output
    assert objects(tmp_path / "k8s")["Deployment"]["metadata"]["name"] == "chat"


def test_build_with_k8s_writes_them_next_to_the_repository(builds, tmp_path, monkeypatch):
    """The build itself is replaced by a copy of a finished one: what is tested is the --k8s step."""
    import pipeline.build
    from pipeline.build import BuildSummary

    def fake_build(options, say):
        shutil.copytree(builds["cpu"], options.out)
        return BuildSummary(options={}, passed=True, verdict="passed")

    monkeypatch.setattr(pipeline.build, "build", fake_build)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", "smollm2-135m", "--target", "cpu", "-o", str(out), "--k8s"])
    assert result.exit_code == 0, result.output
    assert objects(out / "k8s")["Deployment"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
    assert "kubectl apply -k" in result.output


# ---------------------------------------------------------------------------------------- canary (issue 17)


def apply_patch(route: dict, command: str) -> dict:
    """The JSON patch of a `kubectl patch --type=json -p '...'` command (replace ops) applied to `route`."""
    patched = json.loads(json.dumps(route))
    for op in json.loads(command.split("-p '", 1)[1].rstrip("'")):
        assert op["op"] == "replace"
        *parents, last = op["path"].strip("/").split("/")
        node = patched
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = op["value"]
    return patched


def test_canary_route_validates_against_the_gateway_api_crd_and_its_commands_shift_and_roll_back(builds, tmp_path):
    out = tmp_path / "canary"
    result = CliRunner().invoke(main, ["k8s", str(builds["cpu"]), "-o", str(out), "--canary-of", str(builds["cpu"]),
                                       "--weight", "10", "--name", "smollm2-135m-cpu-fp8", "--namespace", "llm",
                                       "--gateway", "infra/edge"])
    assert result.exit_code == 0, result.output
    route = yaml.safe_load((out / "httproute.yaml").read_text())
    validator = crd_validator("HTTPRoute")
    assert not list(validator.iter_errors(route)), [e.message for e in validator.iter_errors(route)]
    assert route["metadata"]["namespace"] == "llm"
    assert route["spec"]["parentRefs"] == [{"name": "edge", "namespace": "infra"}]
    service_port = next(p["port"] for p in objects(out)["Service"]["spec"]["ports"] if p["name"] == "http")
    assert [(b["kind"], b["name"], b["port"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]] == [
        ("Service", "smollm2-135m-cpu", service_port, 90), ("Service", "smollm2-135m-cpu-fp8", service_port, 10)]
    # the canary's own objects are named for it; the route stays out of its kustomization (delete -k keeps it)
    assert objects(out)["Service"]["metadata"]["name"] == "smollm2-135m-cpu-fp8"
    assert "httproute.yaml" not in yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
    # the strict schema refuses a misspelt field
    broken = json.loads(json.dumps(route))
    broken["spec"]["rules"][0]["backendRefs"][0]["weigth"] = 5
    assert list(validator.iter_errors(broken))
    # CANARY.md: shift to 50%, promote, roll back; each patched route still validates
    patches = re.findall(r"^kubectl -n llm patch httproute smollm2-135m-cpu-ab .*$", (out / "CANARY.md").read_text(),
                         re.MULTILINE)
    weights = []
    for command in patches:
        patched = apply_patch(route, command)
        assert not list(validator.iter_errors(patched))
        weights.append([b["weight"] for b in patched["spec"]["rules"][0]["backendRefs"]])
    assert weights == [[50, 50], [0, 100], [100, 0]]
    assert f"kubectl delete -k {out}" in (out / "CANARY.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--weight", "10"], "both named 'smollm2-135m-cpu'"),
    (["--weight", "101", "--name", "b"], "0 to 100"),
    (["--gateway", "Bad_GW", "--name", "b"], "--gateway"),
])
def test_bad_canary_flags_exit_2_and_write_nothing(builds, tmp_path, flags, message):
    result = CliRunner().invoke(main, ["k8s", str(builds["cpu"]), "-o", str(tmp_path / "k8s"),
                                       "--canary-of", str(builds["cpu"]), *flags])
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_a_packaged_artifact_is_fetched_verified_and_unpacked_by_every_pod(builds, tmp_path):
    """--repo-source artifact:URL: no claim and no loader; an init container downloads the `trtpipe package`
    archive, `trtpipe unpack` checks every hash and the target's GPU architecture before anything is
    served, and model_repo/ and engine/ land where Triton and the engine-path ConfigMap expect them."""
    url, digest = "https://artifacts.example/llama-3-8b-rtx4090-fp8.tar", "ab" * 32
    options = K8sOptions(image="registry.example/trtpipe:0.1.0", repo_source=f"artifact:{url}#sha256={digest}")
    out = write_k8s(builds["rtx4090"], tmp_path / "k8s", options).out
    found = objects(out)
    assert "PersistentVolumeClaim" not in found and not (out / "model-repo-loader.yaml").exists()
    for version in K8S_VERSIONS:
        assert kubernetes_validate.validate(found["Deployment"], version, strict=True)
    spec = pod(out)
    (fetch,) = spec["initContainers"]
    assert {"name": "ARTIFACT_URL", "value": url} in fetch["env"] and url not in " ".join(fetch["command"])
    script = fetch["command"][-1]
    # the URL proves nothing of what it serves: the pod unpacks only the archive with the pinned digest
    assert f"trtpipe unpack /tmp/artifact.tar --target rtx4090 --sha256 {digest} -o /trtpipe/.unpack" in script
    assert script.index("trtpipe unpack") < script.index("mv /trtpipe/.unpack/* /trtpipe/")
    volume = next(v for v in spec["volumes"] if v["name"] == "model-repo")
    assert "emptyDir" in volume and "persistentVolumeClaim" not in volume
    triton = spec["containers"][0]
    assert any(a.startswith("--model-repository=/trtpipe/model_repo") for a in triton["command"])


def test_every_pod_runs_unprivileged_with_bounded_resources(builds, tmp_path):
    """issue 25 case 12: no securityContext, helper containers without limits. Every container (Triton, the
    artifact fetcher, the loader): non-root pod, RuntimeDefault seccomp, no privilege escalation, all capabilities
    dropped, read-only root (with /tmp a volume), requests and limits; the manifests still validate strictly."""
    url = "https://artifacts.example/a.tar#sha256=" + "cd" * 32
    fetched = objects(write_k8s(builds["rtx4090"], tmp_path / "a",
                                K8sOptions(image="registry.example/trtpipe:0.1.0", repo_source=f"artifact:{url}")).out)
    claimed = objects(write_k8s(builds["cpu"], tmp_path / "c", K8sOptions(image="registry.example/trtpipe:0.1.0")).out)
    pods = [fetched["Deployment"]["spec"]["template"]["spec"], claimed["Deployment"]["spec"]["template"]["spec"]]
    loader = yaml.safe_load((tmp_path / "c" / "model-repo-loader.yaml").read_text())
    pods.append(loader["spec"])
    for spec in pods:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert c["resources"]["limits"]["memory"] and c["resources"]["limits"]["cpu"], c["name"]
    assert len(pods[0]["initContainers"]) == 1
    for version in K8S_VERSIONS:
        for obj in (fetched["Deployment"], claimed["Deployment"], loader):
            assert kubernetes_validate.validate(obj, version, strict=True)
