"""`trtpipe k8s`: Kubernetes manifests, autoscaling, alerts and a dashboard for a built model repository.

- `source`: reads a build directory or a `trtpipe deploy` repository (the plan sizes everything) and the flags;
- `manifests`: Deployment, Service, HorizontalPodAutoscaler, PodDisruptionBudget, the model-repository
  volume (a PersistentVolumeClaim and a loader pod) and, for an engine, the engine path's ConfigMap;
- `monitoring`: the metric names, the queue:compute recording rules and alerts, PodMonitor, PrometheusRule;
- `dashboard`: the Grafana dashboard from the same names.

`write_k8s` writes them into a temporary sibling of the output directory and renames it into place, so
a failure leaves no half-written set. docs/kubernetes.md says why each choice was made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..outputs import atomic_output_dir, check_output_free
from . import manifests as k
from .monitoring import QUEUE_COMPUTE_RATIO, Monitoring, check_price, pod_monitor, prometheus_rule
from .source import (DeploymentSource, Replicas, RepoSource, check_name, parse_replicas, parse_repo_source,
                     read_source)

__all__ = ["K8sOptions", "K8sResult", "parse_replicas", "read_source", "scale_ratio", "write_k8s"]

#: The queue:compute ratio the autoscaler holds when the plan gives no latency budget: queueing as long
#: as computing (the tutorial chart's default, 1000m).
DEFAULT_SCALE_RATIO = 1.0
#: Labels kube-prometheus-stack's Prometheus selects PodMonitors and PrometheusRules by (its Helm release
#: name, `prometheus` in NVIDIA's tutorial).
PROMETHEUS_LABELS = {"release": "prometheus"}
KUSTOMIZATION = "kustomization.yaml"
LOADER = "model-repo-loader.yaml"


@dataclass(frozen=True)
class K8sOptions:
    image: str
    replicas: str = "1:4"
    namespace: str = "default"
    repo_source: str | None = None
    scale_ratio: float | None = None     # None: from the plan
    name: str | None = None
    force: bool = False
    canary_of: Path | None = None        # A: its manifests directory, build or repository: write B as its canary
    weight: int = 10                     # % of requests to the canary
    gateway: str = "trtpipe"             # the Gateway the canary's HTTPRoute attaches to
    price_per_hour: float | None = None  # USD for an hour of one pod: the dashboard's cost panel (None: no panel)


@dataclass(frozen=True)
class K8sResult:
    out: Path
    files: list[str]
    name: str
    scale_ratio: float
    notes: tuple[str, ...] = ()   # what the user should know (a canary's assumed stable name)

    def to_dict(self) -> dict:
        return {"out": str(self.out), "files": list(self.files), "name": self.name, "scale_ratio": self.scale_ratio,
                "notes": list(self.notes)}

    def summary(self) -> str:
        fill = (f"the model repository goes onto its volume with {LOADER}" if LOADER in self.files
                else "every pod fetches and verifies the artifact before Triton starts")
        return (f"wrote {len(self.files)} files to {self.out} for {self.name} (autoscaling at queue:compute "
                f"{self.scale_ratio:g})\napply with `kubectl apply -k {self.out}` (see docs/kubernetes.md first: "
                f"{fill})" + "".join(f"\nnote: {n}" for n in self.notes))


def scale_ratio(src: DeploymentSource, flag: float | None) -> float:
    """The flag's ratio, else the plan's: the queueing its p99 budget leaves per second of computing.

    With `--p99-latency` the plan knows the end-to-end budget and its performance model the request latency; the
    difference is what a request may wait. Without one, the tutorial's 1.0.
    """
    if flag is not None:
        return flag
    budget, compute = src.plan.workload.p99_latency_s, src.plan.request_latency_s
    if budget is None or compute <= 0:
        return DEFAULT_SCALE_RATIO
    return round(min(10.0, max(0.1, (budget - compute) / compute)), 3)


def monitoring_for(src: DeploymentSource, namespace: str, ratio: float,
                   price_per_hour: float | None = None) -> Monitoring:
    """The queue-time alert fires at twice the queueing the autoscaler aims for (at least a second)."""
    queue_alert_us = round(2 * ratio * src.plan.request_latency_s * 1e6)
    return Monitoring(name=src.name, namespace=namespace, queue_alert_us=max(queue_alert_us, 1_000_000),
                      price_per_hour=price_per_hour)


def render(src: DeploymentSource, options: K8sOptions, replicas: Replicas, source: RepoSource, ratio: float,
           m: Monitoring) -> dict[str, dict]:
    """File name -> object, for everything applied with `kubectl apply -k` (the loader pod is apart)."""
    sizing = k.PodSizing.from_plan(src.plan)
    objects = {
        "deployment.yaml": k.deployment(src, options.image, replicas, source, sizing),
        "service.yaml": k.service(src.name, k.speaks_openai_here(src)),
        "hpa.yaml": k.autoscaler(src.name, replicas, QUEUE_COMPUTE_RATIO, ratio),
        "pdb.yaml": k.disruption_budget(src.name),
        "podmonitor.yaml": pod_monitor(m, {**k.labels(src.name), **PROMETHEUS_LABELS}, k.selector(src.name)),
        "prometheusrule.yaml": prometheus_rule(m, {**k.labels(src.name), **PROMETHEUS_LABELS}),
    }
    if source.create:
        objects["model-repo-pvc.yaml"] = k.volume_claim(src, source)
    if src.engine_config is not None:
        objects["engine-config.yaml"] = k.engine_config_map(src)
    return objects


def write_k8s(path: Path, out: Path, options: K8sOptions) -> K8sResult:
    """Read the build or repository at `path`, check every flag, then write the set into `out` atomically."""
    from .dashboard import dashboard

    replicas = parse_replicas(options.replicas)
    check_name(options.namespace, "--namespace")
    price = check_price(options.price_per_hour)
    src = read_source(path, options.name)
    source = parse_repo_source(options.repo_source, src.name)
    ratio = scale_ratio(src, options.scale_ratio)
    m = monitoring_for(src, options.namespace, ratio, price)
    objects = render(src, options, replicas, source, ratio, m)
    loader = k.loader_pod(src.name, source) if source.claim else None
    board = dashboard(m)
    canary = None
    if options.canary_of is not None:
        from .canary import check_canary, stable_name, stable_note

        stable = stable_name(options.canary_of)
        canary = check_canary(stable.name, src.name, options.weight, options.gateway, stable.read)
    check_output_free(Path(out), options.force, lambda out: (out / "kustomization.yaml").is_file())
    with atomic_output_dir(Path(out)) as tmp:
        for name, obj in objects.items():
            (tmp / name).write_text(yaml.safe_dump(obj, sort_keys=False))
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "namespace": options.namespace, "resources": list(objects)}
        (tmp / KUSTOMIZATION).write_text(yaml.safe_dump(kustomization, sort_keys=False))
        if loader is not None:
            (tmp / LOADER).write_text(yaml.safe_dump({**loader, "metadata": {**loader["metadata"],
                                                                             "namespace": options.namespace}},
                                                     sort_keys=False))
        (tmp / "grafana-dashboard.json").write_text(json.dumps(board, indent=2) + "\n")
        if canary is not None:
            from .canary import COMMANDS_FILE, ROUTE_FILE, commands, http_route

            route = http_route(canary)
            route["metadata"]["namespace"] = options.namespace
            (tmp / ROUTE_FILE).write_text(yaml.safe_dump(route, sort_keys=False))
            (tmp / COMMANDS_FILE).write_text(commands(canary, options.namespace, str(out)))
        files = sorted(p.name for p in tmp.iterdir())
    notes = () if canary is None or canary.stable_read else (stable_note(canary),)
    return K8sResult(out=Path(out), files=files, name=src.name, scale_ratio=ratio, notes=notes)
