"""The metric names, the recording rules and alerts, the PodMonitor and the PrometheusRule.

Every series the rules, the autoscaler and the dashboard read is named once here, in one of five lists
whose source is stated (docs/kubernetes.md; facts in docs/upstream-facts.md §S2, §S3 and §I):

- `TRITON`: Triton's own families, served by the embedded Triton of the tests after real requests
  (tests/test_k8s.py reads /metrics and checks each one);
- `TRTLLM_BACKEND`: the TensorRT-LLM backend's families (custom_metrics_reporter.cc, tensorrtllm_backend
  README "Triton Metrics"), served only by the tensorrtllm backend, so never on this GPU-less machine;
- `TRITON_GPU` (pipeline/triton_metrics.py): Triton's per-GPU families (Triton metrics.md), served only where a GPU is;
- `DCGM_EXPORTER`: NVIDIA's dcgm-exporter fields (its etc/default-counters.csv), the dashboard's alternative
  source of power and energy where a DCGM exporter is scraped instead of Triton's GPU families;
- `CLUSTER`: kube-state-metrics (part of kube-prometheus-stack), for pods that are not ready.

The queue:compute ratio and its companions are NVIDIA's recording rules (tutorials,
TensorRT-LLM_Autoscaling_and_Load_Balancing, triton-metrics_prometheus-rule.yaml), kept per pod
(`sum by (namespace, pod)`) so the HorizontalPodAutoscaler's Pods metric finds one value per pod, and
restricted to this deployment's scrape job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError

#: Triton core families (counters unless named; latencies are cumulative microseconds).
REQUEST_SUCCESS = "nv_inference_request_success"
REQUEST_FAILURE = "nv_inference_request_failure"
REQUEST_DURATION = "nv_inference_request_duration_us"
QUEUE_DURATION = "nv_inference_queue_duration_us"
COMPUTE_INPUT = "nv_inference_compute_input_duration_us"
COMPUTE_INFER = "nv_inference_compute_infer_duration_us"
COMPUTE_OUTPUT = "nv_inference_compute_output_duration_us"
PENDING_REQUESTS = "nv_inference_pending_request_count"    # gauge
CPU_UTILIZATION = "nv_cpu_utilization"                    # gauge, 0-1
CPU_MEMORY_USED = "nv_cpu_memory_used_bytes"              # gauge
TRITON = (REQUEST_SUCCESS, REQUEST_FAILURE, REQUEST_DURATION, QUEUE_DURATION, COMPUTE_INPUT, COMPUTE_INFER,
          COMPUTE_OUTPUT, PENDING_REQUESTS, CPU_UTILIZATION, CPU_MEMORY_USED)

#: TensorRT-LLM backend families (all gauges but the disaggregated-serving counter and the two histograms),
#: with the label that selects the value inside each family.
TRTLLM_REQUESTS = "nv_trt_llm_request_metrics"                  # request_type: active, max, scheduled, context, waiting
TRTLLM_MEMORY = "nv_trt_llm_runtime_memory_metrics"             # memory_type: cpu, gpu, pinned
TRTLLM_KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"          # kv_cache_block_type: max, free, used, tokens_per, ...
TRTLLM_INFLIGHT = "nv_trt_llm_inflight_batcher_metrics"         # inflight_batcher_specific_metric: ...
TRTLLM_V1 = "nv_trt_llm_v1_metrics"
TRTLLM_GENERAL = "nv_trt_llm_general_metrics"                   # general_type: timestamp, iteration_counter
TRTLLM_DISAGGREGATED = "nv_trt_llm_disaggregated_serving_metrics"
OUTPUT_TOKEN_LEN = "nv_llm_output_token_len"                    # histogram
INPUT_TOKEN_LEN = "nv_llm_input_token_len"                      # histogram
OUTPUT_TOKENS = f"{OUTPUT_TOKEN_LEN}_sum"                        # the histogram's sum: every output token
TRTLLM_BACKEND = (TRTLLM_REQUESTS, TRTLLM_MEMORY, TRTLLM_KV_BLOCKS, TRTLLM_INFLIGHT, TRTLLM_V1, TRTLLM_GENERAL,
                  TRTLLM_DISAGGREGATED, OUTPUT_TOKEN_LEN, INPUT_TOKEN_LEN)

# Triton's per-GPU families (`TRITON_GPU`) are named in pipeline/triton_metrics.py, a leaf the validate stage's
# energy meter reads too.

#: dcgm-exporter's fields (etc/default-counters.csv), one series per GPU; with its Kubernetes mapping on (the GPU
#: operator's default) each carries the `namespace` and `pod` of the pod using the GPU (`Monitoring.select_dcgm`).
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"                    # gauge, watts
DCGM_ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"      # counter, millijoules since boot
MILLIJOULES_PER_JOULE = 1000
DCGM_EXPORTER = (DCGM_POWER, DCGM_ENERGY)

REPLICAS_UNAVAILABLE = "kube_deployment_status_replicas_unavailable"
CLUSTER = (REPLICAS_UNAVAILABLE,)

#: The series the recording rules make.
QUEUE_COMPUTE_RATIO = "triton:queue_compute:ratio"
QUEUE_AVERAGE = "triton:queue_duration:average"
COMPUTE_AVERAGE = "triton:compute_duration:average"
REQUEST_AVERAGE = "triton:request_duration:average"

#: The models clients call (deploy's ensemble and BLS): request and failure rates are counted on these
#: alone, since a request that fails inside the ensemble also fails each composing model on its way.
ENTRY_MODELS = "ensemble|tensorrt_llm_bls"
#: Share of failed requests (5 minutes) that alerts.
FAILURE_RATIO_ALERT = 0.05
#: Share of the KV cache's blocks still free below which the cache is about to refuse new sequences.
KV_FREE_ALERT = 0.1
RULE_INTERVAL = "15s"
SCRAPE_INTERVAL = "15s"
#: The window the dashboard's peak-memory panel takes its maximum over (the dashboard's default time range).
PEAK_WINDOW = "1h"


@dataclass(frozen=True)
class Monitoring:
    """What the rules need to know about one deployment."""

    name: str
    namespace: str
    queue_alert_us: int     # average queue time above which requests wait too long (TritonQueueTimeHigh)
    price_per_hour: float | None = None   # USD for an hour of one pod (`--price-per-hour`): the cost panel

    @property
    def job(self) -> str:
        """The `job` label Prometheus gives series scraped through the PodMonitor: <namespace>/<name>."""
        return f"{self.namespace}/{self.name}"

    def select(self, extra: str = "") -> str:
        return "{" + ", ".join(filter(None, [f'job="{self.job}"', extra])) + "}"

    def select_dcgm(self) -> str:
        """dcgm-exporter's series of this deployment's GPUs: scraped under the exporter's own job, they are found by
        the pod its Kubernetes mapping names (<name>-<replica set hash>-<suffix>, so a canary named <name>-... is
        not matched). The exporter's ServiceMonitor needs `honorLabels: true`, or Prometheus renames the label to
        `exported_pod` (docs/kubernetes.md)."""
        return f'{{namespace="{self.namespace}", pod=~"{self.name}-[a-z0-9]+-[a-z0-9]+"}}'


def check_price(value: object) -> float | None:
    """`--price-per-hour` as a float: None stays None, anything but a finite positive number is refused."""
    if value is None:
        return None
    try:
        price = float(value)   # type: ignore[arg-type]
    except (TypeError, ValueError):
        price = math.nan
    if isinstance(value, bool) or not (math.isfinite(price) and price > 0):
        raise UserError(f"--price-per-hour must be a positive number (US dollars for an hour of the deployment), "
                        f"got {value!r}")
    return price


def per_pod_rate(metric: str, m: Monitoring, extra: str = "") -> str:
    return f"sum by (namespace, pod) (rate({metric}{m.select(extra)}[1m]))"


def recording_rules(m: Monitoring) -> list[dict]:
    success = f"clamp_min({per_pod_rate(REQUEST_SUCCESS, m)}, 1)"
    return [
        {"record": COMPUTE_AVERAGE, "expr": f"{per_pod_rate(COMPUTE_INFER, m)} / {success}"},
        {"record": QUEUE_AVERAGE, "expr": f"{per_pod_rate(QUEUE_DURATION, m)} / {success}"},
        {"record": REQUEST_AVERAGE, "expr": f"{per_pod_rate(REQUEST_DURATION, m)} / {success}"},
        {"record": QUEUE_COMPUTE_RATIO,
         "expr": f"{per_pod_rate(QUEUE_DURATION, m)} / clamp_min({per_pod_rate(COMPUTE_INFER, m)}, 1)"},
    ]


def alert(name: str, expr: str, duration: str, severity: str, summary: str) -> dict:
    return {"alert": name, "expr": expr, "for": duration, "labels": {"severity": severity},
            "annotations": {"summary": summary}}


def alerts(m: Monitoring) -> list[dict]:
    entry = f'model=~"{ENTRY_MODELS}"'
    failed = f"sum(rate({REQUEST_FAILURE}{m.select(entry)}[5m]))"
    answered = f"sum(rate({REQUEST_SUCCESS}{m.select(entry)}[5m]))"
    free = TRTLLM_KV_BLOCKS + m.select('kv_cache_block_type="free"')
    total = TRTLLM_KV_BLOCKS + m.select('kv_cache_block_type="max"')
    return [
        alert("TritonRequestFailureRate", f"{failed} / clamp_min({failed} + {answered}, 1e-9) > {FAILURE_RATIO_ALERT}",
              "5m", "warning", f"{m.name}: more than {FAILURE_RATIO_ALERT:.0%} of requests fail (over 5 minutes)"),
        alert("TritonQueueTimeHigh", f"{QUEUE_AVERAGE}{m.select()} > {m.queue_alert_us}", "10m", "warning",
              f"{m.name}: requests wait more than {m.queue_alert_us / 1e6:g} s in the queue on average; the "
              "autoscaler is at its maximum or cannot place pods"),
        alert("TensorRTLLMKVCacheFreeBlocksLow",
              f"{free} / ignoring(kv_cache_block_type) clamp_min({total}, 1) < {KV_FREE_ALERT}", "5m", "warning",
              f"{m.name}: under {KV_FREE_ALERT:.0%} of the KV cache's blocks are free; new requests wait for "
              "cache (TensorRT-LLM backend only)"),
        alert("TritonPodsNotReady",
              f'{REPLICAS_UNAVAILABLE}{{namespace="{m.namespace}", deployment="{m.name}"}} > 0', "10m",
              "warning", f"{m.name}: pods have not been ready for 10 minutes (engine loading, GPU scheduling)"),
    ]


def prometheus_rule(m: Monitoring, labels: dict) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": m.name, "labels": labels},
        "spec": {"groups": [
            {"name": f"{m.name}.autoscaling", "interval": RULE_INTERVAL, "rules": recording_rules(m)},
            {"name": f"{m.name}.alerts", "rules": alerts(m)},
        ]},
    }


def pod_monitor(m: Monitoring, labels: dict, selector: dict) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": m.name, "labels": labels},
        "spec": {"selector": {"matchLabels": selector},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": SCRAPE_INTERVAL}]},
    }


def rule_expressions(rule: dict) -> list[str]:
    """Every PromQL expression of a PrometheusRule (for checks and the dashboard's cross-references)."""
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
