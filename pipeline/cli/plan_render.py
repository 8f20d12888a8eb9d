"""The plan for people: first its verdict (`verdict`: does it fit, what batch, how many KV tokens, how fast and from
what data), then with `plan --details` rich tables of every section, in the order a reader checks them.

Every figure says what it is: a prediction from measured kernels, one derived from another card's, a time measured
on this host, or a speed-of-light bound, which is never shown as a prediction (TTFT and TPOT ">= N", tokens/s
"<= N"). One memory budget (the plan's: it sets Triton's KV cache) and one speed of light per quantity; where
aiconfigurator-core's own memory check or trtpipe's coarser roofline is shown beside them, the row says why it
differs."""

from __future__ import annotations

import shlex
from dataclasses import asdict

from .. import TRTLLM_VERSION
from ..backends.runtime_images import IMAGES
from ..backends import backend_for
from ..backends.names import INFLIGHT_BATCHING
from ..plan import Plan
from ..plan.memory import format_gib
from ..plan.performance import (DERIVED_FROM, DERIVED_SOURCE, MEASURED, MEASURED_SOURCE, SOL_SOURCE, TIMED_SOURCE,
                                AIC_VERSION)
from ..plan.policy import describe_kv_cache

GIB = 1 << 30


# ----------------------------------------------------------------------------------------------- the verdict


def figure_source(plan: Plan) -> str:
    """Where the plan's TTFT, TPOT and tokens/s come from, in a few words."""
    p, name = plan.performance, plan.target.name
    through = " through AIC's Llama model" if p and "through AIC's" in p.basis else ""
    if p is None:
        return "speed-of-light bound (trtpipe's roofline), not a prediction"
    if p.source == MEASURED_SOURCE:
        system, version = MEASURED.get(name, (name, "?"))
        return f"measured: {system} kernels, TensorRT-LLM {version} (aiconfigurator-core {AIC_VERSION}){through}"
    if p.source == DERIVED_SOURCE:
        source = DERIVED_FROM.get(name, "another card")
        return f"derived: {source}'s measured kernels scaled to {name} (aiconfigurator-core {AIC_VERSION}){through}"
    if p.source == TIMED_SOURCE:
        return "timed: the reference runtime on this host" + (", corrected by --measured" if p.correction else "")
    return "speed-of-light bound, not a prediction (no measured data: see the warning)"


def is_bound(plan: Plan) -> bool:
    return plan.performance is None or plan.performance.source == SOL_SOURCE


def speed_rows(plan: Plan) -> list[tuple[str, str]]:
    """TTFT, TPOT and output tokens/s at the plan's batch, a bound marked as one."""
    p, roof = plan.performance, plan.roofline
    if p is None:
        ttft, tpot, rate = roof.prefill_s_per_request, roof.decode_step_s, roof.decode_tokens_per_s_aggregate
    else:
        ttft, tpot, rate = p.ttft_s, p.tpot_s, p.output_tokens_per_s
    low, high = (AT_LEAST, AT_MOST) if is_bound(plan) else ("", "")
    return [("TTFT", f"{low}{ttft * 1e3:.0f} ms"), ("TPOT", f"{low}{tpot * 1e3:.2f} ms"),
            ("tokens/s", f"{high}{rate:.0f}")]


#: how a speed-of-light figure is shown: a time at least, a rate at most
AT_LEAST, AT_MOST = "≥ ", "≤ "


def budget_total(plan: Plan) -> int:
    mem = plan.memory
    return (mem.weights_bytes_per_rank + mem.activation_bytes + mem.runtime_reserve_bytes + mem.kv_cache_bytes
            + mem.draft_bytes)


def fits(plan: Plan) -> bool:
    p = plan.performance
    return budget_total(plan) <= plan.memory.memory_bytes and not (p and p.memory and not p.memory.get("fits", True))


def verdict(plan: Plan) -> list[str]:
    """The first lines of `trtpipe plan`: what a reader asks first, each answer with where it comes from."""
    m, w, mem = plan.model, plan.workload, plan.memory
    gib = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    batch = plan.triton.triton_max_batch_size
    seq = w.input_len + w.output_len
    parts = [f"weights {gib(mem.weights_bytes_per_rank)}", f"KV cache {gib(mem.kv_cache_bytes)}"]
    parts += [f"activations {gib(mem.activation_bytes)}"] if mem.activation_bytes else []
    parts += [f"runtime {gib(mem.runtime_reserve_bytes)}"]
    parts += [f"draft model {gib(mem.draft_bytes)}"] if mem.draft_bytes else []
    where = "of host memory" if not plan.target.is_gpu else (
        "per GPU" if plan.tp_size * plan.pp_size > 1 else "of the GPU")
    fit = ("yes" if fits(plan) else "NO") + (f": {gib(budget_total(plan))} of {gib(mem.memory_bytes)} GiB {where} = "
                                             + " + ".join(parts))
    p = plan.performance
    if p and p.memory and plan.target.is_gpu:
        fit += f" (aiconfigurator-core's check: {gib(p.memory['total'])} GiB, --details says why it differs)"
    rows = [
        ("Plan", f"{m.name} on {plan.target.name}: {plan.precision}, tp {plan.tp_size}"
                 + (f", pp {plan.pp_size}" if plan.pp_size > 1 else "") + f", {plan.backend} backend"
                 + (f", runtime image {plan.runtime_image} ({IMAGES[plan.runtime_image].image}, TensorRT-LLM "
                    f"{IMAGES[plan.runtime_image].trtllm})" if plan.runtime_image in IMAGES else "")),
        ("Fits", fit),
        ("Batch", f"{batch} sequences at once (max_batch_size), {w.input_len} in + {w.output_len} out tokens each"
                  + (f", P99 budget {w.p99_latency_s:g} s" if w.p99_latency_s else "")
                  + (" (smaller than the KV cache holds: see the warning)"
                     if any(msg.startswith(f"batch {batch} instead of") for msg in plan.warnings) else "")),
        ("KV cache", f"{mem.kv_cache_tokens} tokens ({describe_kv_cache(plan)}): {mem.kv_cache_tokens // seq} "
                     f"sequences of {seq} tokens"),
    ]
    source = figure_source(plan)
    rows += [(name, f"{value:<11} {source}") for name, value in speed_rows(plan)]
    if plan.speculative:
        rows.append(("Speculate", speculative_line(plan.speculative)))
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{name:<{width}}{value}" for name, value in rows]
    bounds = [msg for msg in plan.warnings if msg.startswith(BOUND_WARNING)]
    if is_bound(plan) and not bounds:
        bounds = [f"{BOUND_WARNING}: " + "; ".join(p.notes if p else ["no performance model for this plan"])]
    lines += [f"{'Warning':<{width}}{msg}" for msg in bounds]
    lines.append(f"{'More':<{width}}--details: the memory budget, build_config, Triton parameters, speed of light, "
                 "energy; --json: plan.json")
    return lines


def speculative_line(spec) -> str:
    """--speculative: K, the acceptance assumed and the speedup predicted at each concurrency, and where it stops."""
    gains = ", ".join(f"{r} row{'s' if r > 1 else ''} x{s:.2f}" for r, s in zip(spec.rows, spec.speedup))
    stop = (f"drafts while at most {spec.max_rows} rows run" if spec.max_rows else "never gains here: off")
    named = spec.draft_model or spec.draft_checkpoint
    draft = ("" if named is None else
             f" (draft {spec.draft_weights_bytes / 1e6:.0f} MB of weights + {spec.draft_kv_bytes_per_token} B/token "
             "of KV cache)")
    drafts = "" if spec.drafts_per_step is None else f", {spec.drafts_per_step:g} drafts a step"
    mode = f" as {spec.decoding_mode}" if spec.decoding_mode else ""
    return (f"{spec.method}{mode}{draft}, K {spec.draft_len}{drafts}, acceptance {spec.acceptance:g} "
            f"({'--acceptance' if spec.acceptance_basis.startswith('--acceptance') else 'default'}): "
            f"tokens/s {gains}; {stop}")


#: how serving_choice's warning of a plan without measured or derived figures begins
BOUND_WARNING = "no measured data"


def other_warnings(plan: Plan) -> list[str]:
    """The warnings `verdict` does not already show."""
    return [msg for msg in plan.warnings if not msg.startswith(BOUND_WARNING)]


def plan_command_line(ctx, changes: dict) -> str:
    """`trtpipe plan` as the user ran it (every option not at its default), with `changes` (flag -> value) made."""
    import click

    words, left = ["trtpipe", ctx.info_name or "plan"], dict(changes)
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            words.append(shlex.quote(str(value)))
            continue
        name = next((o for o in param.opts if o.startswith("--")), param.opts[0])
        if name in left:
            value = left.pop(name)
        elif value is None or value is False or value == param.default:
            continue
        if getattr(param, "is_flag", False):
            words.append(name if value else (param.secondary_opts or [name])[0])
        else:
            words += [name, shlex.quote(str(value))]
    for name, value in left.items():
        words += [name, shlex.quote(str(value))]
    return " ".join(words)


# ----------------------------------------------------------------------------------------------- the details


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

    m, w, mem = plan.model, plan.workload, plan.memory
    a = m.arch
    backend = backend_for(plan.backend)
    out = [_kv_table(f"Plan: {m.name} on {plan.target.name}", [
        ("model", (f"{a.architecture}: {a.num_hidden_layers} layers, {a.num_attention_heads} heads "
                   f"({a.num_key_value_heads} KV) x {a.head_size}, hidden {a.hidden_size}, "
                   f"intermediate {a.intermediate_size}, vocab {a.vocab_size}")),
        ("target", (f"{plan.target.sku} (sm {plan.target.compute_capability or '-'}, "
                    f"{format_gib(plan.target.memory_bytes)}, {plan.target.bandwidth_bytes_per_s / 1e9:.0f} GB/s)")),
        ("backend", f"{plan.backend}: {backend.summary}"),
        ("precision", f"{plan.precision} (engine dtype {plan.dtype}), KV cache {describe_kv_cache(plan)}"),
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
        ("kv_bytes_per_token", f"{plan.kv_bytes_per_token} B ({describe_kv_cache(plan).split(',')[0]})"),
        ("KV cache tokens", mem.kv_cache_tokens),
        *([("draft model", f"{format_gib(mem.draft_bytes)}: its weights and the KV cache of as many tokens, "
                           "beside the target's (its activations and buffers are in the rows above)")]
          if mem.draft_bytes else []),
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
    out.append(speed_of_light_table(plan))
    return out   # the warnings: after the verdict (`verdict`, `other_warnings`)


def aic_speed_of_light(plan: Plan) -> bool:
    """Whether the plan's speed of light is aiconfigurator-core's (measured or derived figures), not the roofline."""
    return plan.performance is not None and plan.performance.source in (MEASURED_SOURCE, DERIVED_SOURCE)


def speed_of_light_table(plan: Plan):
    """One speed of light per quantity: AIC's where the figures are AIC's (trtpipe's roofline beside it, labelled with
    why it is lower), else trtpipe's roofline."""
    p, roof, w = plan.performance, plan.roofline, plan.workload
    batch1 = (f"{roof.decode_step_s_batch1 * 1e3:.2f} ms ({roof.decode_tokens_per_s_per_seq_batch1:.1f} tokens/s "
              "per sequence)")
    if aic_speed_of_light(plan):
        sol = p.speed_of_light
        return _kv_table("Speed of light (aiconfigurator-core: each operation's max(FLOPs / tensor rate, bytes / "
                         "bandwidth), summed)", [
            (f"prefill, one request of {w.input_len}", f"{sol['prefill_s'] * 1e3:.1f} ms"),
            (f"decode step, batch {p.batch}", (f"{sol['decode_step_s'] * 1e3:.2f} ms (the prediction is at "
                                               f"{p.percent_of_speed_of_light or 0:.0f}% of it)")),
            ("trtpipe's roofline", (f"prefill {roof.prefill_s_per_request * 1e3:.1f} ms, decode step "
                                    f"{roof.decode_step_s * 1e3:.2f} ms at batch {roof.batch}, {batch1} at batch 1 "
                                    "(plan.json `roofline`): a coarser bound, lower because it takes the whole "
                                    "model's FLOPs at the weights' peak rate and all its bytes at full bandwidth "
                                    "together, where aiconfigurator-core bounds each operation on its own (attention "
                                    "and lm_head at the 16-bit rate)")),
        ])
    return _kv_table("Speed of light (trtpipe's roofline: lower bounds of the times)", [
        (f"prefill, one request of {w.input_len}", f"{roof.prefill_s_per_request * 1e3:.1f} ms"),
        (f"decode step, batch {roof.batch}", (f"{roof.decode_step_s * 1e3:.2f} ms "
                                              f"({roof.decode_tokens_per_s_aggregate:.0f} output tokens/s at most)")),
        ("decode step, batch 1", batch1),
        ("basis", roof.basis),
    ])


def performance_table(plan: Plan):
    """What the target will do: the figures, what they are (measured, derived, speed of light, timed) and their
    basis."""
    p, w = plan.performance, plan.workload
    batching = "in-flight" if backend_for(plan.backend).batching == INFLIGHT_BATCHING else "static"
    low, high, bound = (AT_LEAST, AT_MOST, " (speed-of-light bound)") if is_bound(plan) else ("", "", "")
    rows = [
        ("figures", f"{p.source}: {p.basis}"),
        ("prefill, one request", f"{low}{p.prefill_s * 1e3:.1f} ms{bound}"),
        (f"decode step, batch {p.batch}", f"{low}{p.decode_step_s * 1e3:.2f} ms{bound}"),
        (f"serving {w.input_len}/{w.output_len}, {batching} batch {p.batch}",
         (f"TTFT {low}{p.ttft_s * 1e3:.0f} ms, TPOT {low}{p.tpot_s * 1e3:.2f} ms, {high}{p.output_tokens_per_s:.0f} "
          f"output tokens/s, request latency {low}{p.request_latency_s:.2f} s{bound}")),
    ]
    if p.memory:
        rows.append(("aiconfigurator-core's memory check", aic_memory(plan)))
    e = p.energy
    if e["watts"]:
        rows.append(("energy", f"{e['watts']:g} W, {high}{e['output_tokens_per_joule']:.2f} output tokens/J "
                               f"({e['basis']})"))
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


def aic_memory(plan: Plan) -> str:
    """AIC's memory check (what bounds the batch) beside the plan's budget, and why the two differ."""
    m, mem = plan.performance.memory, plan.memory
    text = (f"{format_gib(m['total'])} of {format_gib(m['capacity'])} at batch {plan.performance.batch}: weights "
            f"{format_gib(m['weights'])}, KV of the batch's sequences {format_gib(m['kv_cache'])}, activations "
            f"{format_gib(m['activations'])}, runtime {format_gib(m['others'])}. It sizes the batch; the budget above "
            "sets Triton's KV cache. They differ: AIC's runtime figure is its fixed safety reserve (3.5 GiB, and "
            f"NCCL's with tp > 1) where the budget counts {format_gib(mem.runtime_reserve_bytes)}; its activations "
            "are its own per-token coefficient")
    if plan.tp_size > 1 and abs(m["weights"] - mem.weights_bytes_per_rank) > GIB / 100:
        text += (f"; its weights ({format_gib(m['weights'])}, not {format_gib(mem.weights_bytes_per_rank)}) split the "
                 "input embedding table over the tp ranks, which TensorRT-LLM's checkpoint keeps whole on each "
                 "(use_parallel_embedding off)")
    return text


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
