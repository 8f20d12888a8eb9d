"""The plan for people: rich tables of every section, in the order a reader checks them."""

from __future__ import annotations

from dataclasses import asdict

from .. import TRTLLM_VERSION
from ..backends import backend_for
from ..backends.names import INFLIGHT_BATCHING
from ..plan import Plan
from ..plan.memory import format_gib


def _kv_table(title: str, rows: list[tuple[str, object]]):
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, "-" if value is None else str(value))
    return table


def render_plan(plan: Plan) -> list:
    """Rich renderables: a readable summary of every section of the plan."""
    from rich.table import Table

    m, w, mem, roof = plan.model, plan.workload, plan.memory, plan.roofline
    a = m.arch
    backend = backend_for(plan.backend)
    out = [_kv_table(f"Plan: {m.name} on {plan.target.name}", [
        ("model", (f"{a.architecture}: {a.num_hidden_layers} layers, {a.num_attention_heads} heads "
                   f"({a.num_key_value_heads} KV) x {a.head_size}, hidden {a.hidden_size}, "
                   f"intermediate {a.intermediate_size}, vocab {a.vocab_size}")),
        ("target", (f"{plan.target.sku} (sm {plan.target.compute_capability or '-'}, "
                    f"{format_gib(plan.target.memory_bytes)}, {plan.target.bandwidth_bytes_per_s / 1e9:.0f} GB/s)")),
        ("backend", f"{plan.backend}: {backend.summary}"),
        ("precision", f"{plan.precision} (engine dtype {plan.dtype}), KV cache {plan.kv_cache_dtype}"),
        ("parallelism", f"tp {plan.tp_size}, pp {plan.pp_size}"),
        ("workload", (f"input {w.input_len}, output {w.output_len} tokens, concurrency "
                      f"{w.concurrency or 'as many as fit'}, P99 budget "
                      f"{f'{w.p99_latency_s:g} s' if w.p99_latency_s else 'none'}")),
        ("max_seq_len", f"{plan.max_seq_len} tokens (longest prompt + output of one request)"),
    ])]
    out.append(_kv_table(f"Memory budget ({backend.memory_scope})", [
        ("total", format_gib(mem.memory_bytes)),
        ("weights", f"{format_gib(mem.weights_bytes_per_rank)} (all ranks: {format_gib(plan.weights_bytes)})"),
        ("activations", f"{format_gib(mem.activation_bytes)} = {mem.activation_formula}"),
        ("  basis", mem.activation_basis),
        ("runtime reserve", f"{format_gib(mem.runtime_reserve_bytes)} = {mem.runtime_reserve_formula}"),
        ("free for KV", (f"{format_gib(mem.free_bytes)} x kv_cache_free_gpu_mem_fraction "
                         f"{mem.kv_cache_free_gpu_mem_fraction:g} = {format_gib(mem.kv_cache_bytes)}")),
        ("kv_bytes_per_token", f"{plan.kv_bytes_per_token} B ({plan.kv_cache_dtype})"),
        ("KV cache tokens", mem.kv_cache_tokens),
        ("max_concurrent_sequences", (f"{plan.max_concurrent_sequences} at "
                                      f"{w.input_len}+{w.output_len} tokens")),
    ]))
    if plan.build_config is not None:
        out.append(_kv_table(f"build_config (TensorRT-LLM {TRTLLM_VERSION} BuildConfig)",
                             list(asdict(plan.build_config).items())))
        out.append(_kv_table("plugin_config (PluginConfig)", list(asdict(plan.plugin_config).items())))
        profiles = Table(title="optimization_profiles (as trtllm-build derives them)", title_justify="left")
        for col in ("#", "num_tokens [min, opt, max]", "batch_size_beam_width", "max_blocks_per_seq"):
            profiles.add_column(col)
        for i, p in enumerate(plan.optimization_profiles):
            profiles.add_row(str(i), str(p.num_tokens), str(p.batch_size_beam_width), str(p.max_blocks_per_seq))
        out.append(profiles)
    out.append(_kv_table("triton (tensorrt_llm model parameters)", list(asdict(plan.triton).items())))
    if plan.performance is not None:
        out.append(performance_table(plan))
    out.append(_kv_table("Roofline estimate (speed of light)", [
        ("decode, batch 1", (f"{roof.decode_tokens_per_s_per_seq_batch1:.1f} tokens/s "
                             f"({roof.decode_step_s_batch1 * 1e3:.2f} ms/step)")),
        (f"decode, batch {roof.batch}", (f"{roof.decode_tokens_per_s_per_seq:.1f} tokens/s per sequence, "
                                         f"{roof.decode_tokens_per_s_aggregate:.0f} tokens/s aggregate")),
        ("prefill per request", f"{roof.prefill_s_per_request * 1e3:.1f} ms ({w.input_len} tokens)"),
        ("request latency", (f"{roof.request_latency_s_batch1:.2f} s at batch 1, "
                             f"{roof.request_latency_s:.2f} s at batch {roof.batch}")),
        ("basis", roof.basis),
    ]))
    if plan.warnings:
        out.append(_kv_table("Warnings", [("!", msg) for msg in plan.warnings]))
    return out


def performance_table(plan: Plan):
    """What the target will do: the figures, what they are (measured, derived, speed of light, timed) and their
    basis."""
    p, w = plan.performance, plan.workload
    batching = "in-flight" if backend_for(plan.backend).batching == INFLIGHT_BATCHING else "static"
    sol = p.speed_of_light
    rows = [
        ("figures", f"{p.source}: {p.basis}"),
        ("prefill, one request", f"{p.prefill_s * 1e3:.1f} ms (speed of light {sol['prefill_s'] * 1e3:.1f} ms)"),
        (f"decode step, batch {p.batch}", (f"{p.decode_step_s * 1e3:.2f} ms (speed of light "
                                           f"{sol['decode_step_s'] * 1e3:.2f} ms: at "
                                           f"{p.percent_of_speed_of_light or 0:.0f}% of it)")),
        (f"serving {w.input_len}/{w.output_len}, {batching} batch {p.batch}",
         (f"TTFT {p.ttft_s * 1e3:.0f} ms, TPOT {p.tpot_s * 1e3:.2f} ms, {p.output_tokens_per_s:.0f} output "
          f"tokens/s, request latency {p.request_latency_s:.2f} s")),
    ]
    if p.memory:
        m = p.memory
        rows.append(("memory (AIC)", (f"{format_gib(m['total'])} of {format_gib(m['capacity'])} usable: weights "
                                      f"{format_gib(m['weights'])}, KV {format_gib(m['kv_cache'])}, activations "
                                      f"{format_gib(m['activations'])}, other {format_gib(m['others'])}")))
    e = p.energy
    if e["watts"]:
        rows.append(("energy", f"{e['watts']:g} W, {e['output_tokens_per_joule']:.2f} output tokens/J ({e['basis']})"))
    rows += [("note", note) for note in p.notes]
    if p.correction:
        c = p.correction
        rows.append(("measured correction", (f"prefill x{c['prefill']:.3f}, decode x{c['decode']:.3f} from "
                                             f"{c['levels']} levels of {c['measured']}; median TTFT/TPOT error "
                                             f"{percent(c['median_error_before']['ttft'])}/"
                                             f"{percent(c['median_error_before']['tpot'])} before, "
                                             f"{percent(c['median_error_after']['ttft'])}/"
                                             f"{percent(c['median_error_after']['tpot'])} after")))
    where = "the GPU" if plan.target.kind == "gpu" else "this host"
    return _kv_table(f"Performance (what {where} will do)", rows)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
