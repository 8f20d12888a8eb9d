"""The Grafana dashboard of one deployment, built with grafana-foundation-sdk from monitoring's names.

Rows follow NVIDIA's "Inference Metrics" dashboard (tutorials, TensorRT-LLM_Autoscaling_and_Load_Balancing):
requests and failures, the queue:compute ratio, request/queue/compute durations, the TensorRT-LLM
in-flight batcher and KV cache, energy (DCGM's power beside output tokens/s, the plan's tokens-per-joule KPI,
joules per output token and, given `--price-per-hour`, the cost per million output tokens), GPU utilisation and
memory with its peaks. Unlike that dashboard, the TensorRT-LLM gauges are shown as they are (it applies rate() to
gauges), and GPU panels read Triton's own GPU families; the power and energy panels also read a DCGM exporter's
fields, for clusters that scrape one instead (legend "(DCGM exporter)").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .. import triton_metrics as gpu
from . import monitoring as mon
from .monitoring import Monitoring


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]   # (PromQL, legend)


def panels(m: Monitoring) -> dict[str, list[Panel]]:
    """Row title -> its panels; every expression reads names from `pipeline.k8s.monitoring`."""
    sel, entry, dcgm = m.select(), m.select(f'model=~"{mon.ENTRY_MODELS}"'), m.select_dcgm()
    tokens = f"sum by (pod) (rate({mon.OUTPUT_TOKENS}{sel}[1m]))"
    producing = f"({tokens} > 0)"   # output tokens/s, no point while a pod produces none (idle: no ratio)

    def by_pod(metric: str, extra: str = "") -> str:
        return f"sum by (pod) ({metric}{m.select(extra)})"

    def trtllm(metric: str, label: str, values: str) -> tuple[tuple[str, str], ...]:
        matcher = f'{label}=~"{values}"'
        return ((f"sum by (pod, {label}) ({metric}{m.select(matcher)})", "{{pod}} {{" + label + "}}"),)

    def peak(metric: str) -> str:
        return f"max by (pod) (max_over_time({metric}{sel}[{mon.PEAK_WINDOW}]))"

    cost = [] if m.price_per_hour is None else [
        Panel(f"Cost per million output tokens (at {m.price_per_hour:g} USD per pod-hour)", "currencyUSD",
              ((f"{m.price_per_hour!r} / 3600 / {producing} * 1e6", "{{pod}}"),))]
    return {
        "Requests": [
            Panel("Requests / second", "reqps", (
                (f"sum by (pod) (rate({mon.REQUEST_SUCCESS}{entry}[1m]))", "{{pod}} answered"),
                (f"sum by (pod) (rate({mon.REQUEST_FAILURE}{entry}[1m]))", "{{pod}} failed"))),
            Panel("Pending requests", "short", ((by_pod(mon.PENDING_REQUESTS), "{{pod}}"),)),
        ],
        "Autoscaling": [
            Panel("Queue : compute ratio (the autoscaler's metric)", "short",
                  ((f"{mon.QUEUE_COMPUTE_RATIO}{sel}", "{{pod}}"),)),
            Panel("Average durations per request", "µs", (
                (f"avg({mon.REQUEST_AVERAGE}{sel})", "request"), (f"avg({mon.QUEUE_AVERAGE}{sel})", "queue"),
                (f"avg({mon.COMPUTE_AVERAGE}{sel})", "compute"))),
            Panel("Compute input / output per request", "µs", tuple(
                (f"sum(rate({metric}{sel}[1m])) / clamp_min(sum(rate({mon.REQUEST_SUCCESS}{sel}[1m])), 1)", what)
                for metric, what in ((mon.COMPUTE_INPUT, "input"), (mon.COMPUTE_OUTPUT, "output")))),
        ],
        "TensorRT-LLM": [
            Panel("In-flight batcher", "short", trtllm(mon.TRTLLM_INFLIGHT, "inflight_batcher_specific_metric",
                                                       "generation_requests|total_context_tokens|paused_requests")),
            Panel("Requests in the executor", "short",
                  trtllm(mon.TRTLLM_REQUESTS, "request_type", "active|scheduled|context|waiting")),
            Panel("KV cache blocks", "short", trtllm(mon.TRTLLM_KV_BLOCKS, "kv_cache_block_type", "max|free|used")),
        ],
        "Energy": [
            Panel("GPU power (DCGM) and its limit", "watt", (
                (by_pod(gpu.GPU_POWER), "{{pod}} power"), (by_pod(gpu.GPU_POWER_LIMIT), "{{pod}} limit"),
                (f"sum by (pod) ({mon.DCGM_POWER}{dcgm})", "{{pod}} power (DCGM exporter)"))),
            Panel("Output tokens / second", "short", ((tokens, "{{pod}}"),)),
            Panel("Output tokens per joule", "short", (
                (f"{tokens} / clamp_min({by_pod(gpu.GPU_POWER)}, 1)", "{{pod}}"),
                (f"{tokens} / clamp_min(sum by (pod) ({mon.DCGM_POWER}{dcgm}), 1)", "{{pod}} (DCGM exporter)"))),
            Panel("Joules per output token", "joule", (
                (f"sum by (pod) (rate({gpu.GPU_ENERGY}{sel}[1m])) / {producing}", "{{pod}}"),
                (f"sum by (pod) (rate({mon.DCGM_ENERGY}{dcgm}[1m])) / {mon.MILLIJOULES_PER_JOULE} / {producing}",
                 "{{pod}} (DCGM exporter)"))),
            *cost,
        ],
        "GPU and host": [
            Panel("GPU utilisation", "percentunit", ((f"avg by (pod) ({gpu.GPU_UTILIZATION}{sel})", "{{pod}}"),)),
            Panel("GPU memory used", "bytes", ((by_pod(gpu.GPU_MEMORY_USED), "{{pod}} used"),
                                               (by_pod(gpu.GPU_MEMORY_TOTAL), "{{pod}} total"))),
            Panel("Host CPU and memory", "short", ((f"avg by (pod) ({mon.CPU_UTILIZATION}{sel})", "{{pod}} CPU"),
                                                   (by_pod(mon.CPU_MEMORY_USED), "{{pod}} memory bytes"))),
            Panel(f"Peak memory (over {mon.PEAK_WINDOW})", "bytes", (
                (peak(gpu.GPU_MEMORY_USED), "{{pod}} GPU (the fullest)"),
                (f"max by (pod) ({gpu.GPU_MEMORY_TOTAL}{sel})", "{{pod}} GPU total"),
                (peak(mon.CPU_MEMORY_USED), "{{pod}} host"))),
        ],
    }


def dashboard(m: Monitoring) -> dict:
    """The dashboard JSON model (a dict), with a Prometheus data-source variable."""
    from grafana_foundation_sdk.builders import dashboard as gd
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (gd.Dashboard(f"trtpipe {m.name}").uid(m.name).tags(["trtpipe", "triton"]).refresh("30s")
             .time("now-1h", "now"))
    board = board.with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    panel_id = 0
    for row, row_panels in panels(m).items():
        panel_id += 1
        board = board.with_row(gd.Row(row).id(panel_id))
        for p in row_panels:
            panel_id += 1
            built = timeseries.Panel().id(panel_id).title(p.title).unit(p.unit).datasource(source)
            for ref, (expr, legend) in zip("ABCDEFGH", p.queries):
                built = built.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref)
                                          .datasource(source))
            board = board.with_panel(built)
    return json.loads(JSONEncoder(sort_keys=True).encode(board.build()))


def dashboard_expressions(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
