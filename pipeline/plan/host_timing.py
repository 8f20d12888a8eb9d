"""What the cpu target's reference runtime does on this host, timed: the phase times the cpu plan predicts from.

A short run of the reference runtime itself (`pipeline.runtime.ReferenceModel`, float32, as it serves) on weights of
the plan's architecture: uniform random values, since a float32 GEMM's time does not depend on them, and only
`LAYERS_TIMED` decoder layers, since every layer is the same computation (the layers' time is scaled by
num_hidden_layers / LAYERS_TIMED; the final norm and lm_head are timed whole). With the threads the served model
uses (`serving_threads`) it times:

- one prompt of `SHORT_PROMPT` tokens and one of the workload's input_len (at most `LONG_PROMPT`, linear beyond)
  through the layers and the lm_head of its last token (a prefill: its time is linear in the prompt between the
  two, the lm_head a fixed part);
- one decode step of one sequence at the output's mean context and at SHORT_PROMPT tokens of context, and of the
  plan's batch at the mean context (the step: fixed + per sequence + per sequence and token of context).

The figures are kept per host in the cache ($TRTPIPE_CACHE/host-timing/, keyed by the architecture, lengths, batch,
threads, torch version and CPU model), so planning again on the same host gives the same plan (build's re-runs stay
no-ops) and costs nothing; another host times its own.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..arch import ModelArch
from ..host import cpu_model
from ..outputs import write_atomic
from ..targets import Target
from .performance import TIMED_SOURCE, Performance, energy_of
from .schema import Roofline, Workload
from ..backends.names import INFLIGHT_BATCHING
from .feedback import decode_step, serving_figures

LAYERS_TIMED = 2
REPEATS = 3
#: a run this long is timed once (its warm-up is the measurement): bounds the cost for the larger models
ONE_RUN_S = 1.0
SHORT_PROMPT = 16
#: the longest prompt timed; a longer input_len is extrapolated linearly from the two prompts timed
LONG_PROMPT = 512
TIMING_VERSION = 4


@dataclass(frozen=True)
class HostTiming:
    """Whole-model seconds of the reference runtime's phases on this host."""

    threads: int
    prefill_s: float               # one prompt of input_len tokens
    prefill_s_short: float         # one prompt of short_prompt tokens
    decode_step_s_batch1: float    # one step of one sequence at `context`
    decode_step_s: float           # one step of `batch` sequences at `context`
    decode_step_s_short: float     # one step of one sequence at short_prompt tokens of context
    input_len: int
    batch: int
    context: int
    layers_timed: int
    short_prompt: int = SHORT_PROMPT

    def to_dict(self) -> dict:
        return asdict(self)

    def phases(self) -> dict:
        """The phase model the per-level prediction reads (`Performance.phases`, plan/feedback.py): the prefill
        linear between the two prompts timed; the decode step fixed + per sequence + per sequence and context token,
        solved from the three steps timed."""
        per_token = max((self.decode_step_s_batch1 - self.decode_step_s_short) / (self.context - self.short_prompt),
                        0.0) if self.context > self.short_prompt else 0.0
        per_sequence = ((self.decode_step_s - self.decode_step_s_batch1) / (self.batch - 1) - per_token * self.context
                        if self.batch > 1 else 0.0)
        return {"prefill_tokens": [self.short_prompt, self.input_len],
                "prefill_s": [self.prefill_s_short, self.prefill_s],
                "decode_fixed_s": self.decode_step_s_batch1 - per_sequence - per_token * self.context,
                "decode_per_sequence_s": per_sequence, "decode_per_context_token_s": per_token}


def host_timing(arch: ModelArch, input_len: int, output_len: int, batch: int, threads: int) -> HostTiming:
    """The phase times for this plan on this host: from the cache, else timed now (about a second for SmolLM2)."""
    context = input_len + output_len // 2
    path = cache_path(arch, input_len, context, batch, threads)
    if path.is_file():
        try:
            return HostTiming(**json.loads(path.read_text()))
        except (TypeError, ValueError):
            pass   # an unreadable entry is timed again
    timing = time_reference_runtime(arch, input_len, context, batch, threads)
    write_atomic(path, json.dumps(timing.to_dict(), indent=2) + "\n")
    return timing


def cache_path(arch: ModelArch, input_len: int, context: int, batch: int, threads: int) -> Path:
    return timing_cache_file({"arch": arch.to_dict(), "input_len": input_len, "context": context, "batch": batch,
                              "threads": threads, "version": TIMING_VERSION})


def timing_cache_file(key: dict, prefix: str = "") -> Path:
    """The host-timing cache entry of what `key` names, timed with this torch on this processor (both added to it)."""
    from importlib.metadata import version

    from ..assets import cache_dir

    key = {**key, "torch": version("torch"), "cpu": cpu_model()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir() / "host-timing" / f"{prefix}{digest}.json"


def time_reference_runtime(arch: ModelArch, input_len: int, context: int, batch: int, threads: int) -> HostTiming:
    import torch

    layers = min(LAYERS_TIMED, arch.num_hidden_layers)
    model = timing_model(arch, layers)
    scale = arch.num_hidden_layers / layers
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            long = min(LONG_PROMPT, input_len)
            prefill = phase_seconds(model, 1, long, 0, scale)
            short = min(SHORT_PROMPT, input_len)
            prefill_short = phase_seconds(model, 1, short, 0, scale)
            step1 = phase_seconds(model, 1, 1, context, scale)
            step = phase_seconds(model, batch, 1, context, scale) if batch > 1 else step1
            step_short = phase_seconds(model, 1, 1, short, scale)
    finally:
        torch.set_num_threads(before)
    if long < input_len and long > short:   # the workload's prompt, linear beyond the longest one timed
        prefill = prefill_short + (prefill - prefill_short) * (input_len - short) / (long - short)
    return HostTiming(threads=threads, prefill_s=prefill, prefill_s_short=prefill_short, decode_step_s_batch1=step1,
                      decode_step_s=step, decode_step_s_short=step_short, input_len=input_len, batch=batch,
                      context=context, layers_timed=layers, short_prompt=short)


def timing_model(arch: ModelArch, layers: int):
    """A ReferenceModel of `arch` cut to `layers` decoder layers, its weights uniform random."""
    import torch

    from ..checkpoint import CheckpointConfig
    from ..model import family_of
    from ..model.spec import dims
    from ..runtime.trtllm_reader import Layer, Linear, ModelWeights
    from ..runtime.model import ReferenceModel

    cut = replace(arch, num_hidden_layers=layers)
    cfg = CheckpointConfig.new(cut, "float32")
    rank, sizes = cfg.layout.rank(0), dims(cut)
    family = family_of(cut.architecture)

    def uniform(*shape: int) -> torch.Tensor:
        return torch.empty(*shape).uniform_(-0.02, 0.02)

    def layer() -> Layer:
        linears = {}
        for lin in family.linears:
            out, inp = rank.linear_shape(cut, lin)
            linears[lin.name] = Linear(uniform(out, inp), uniform(out) if family.has_bias(lin, cut) else None)
        return Layer(linears, {n.name: torch.ones(sizes[n.size]) for n in family.layer_norms(cut)})

    embedding = uniform(cut.vocab_size, cut.hidden_size)
    lm_head = embedding if cut.tie_word_embeddings else uniform(cut.vocab_size, cut.hidden_size)
    weights = ModelWeights(embedding, [layer() for _ in range(layers)], torch.ones(cut.hidden_size), lm_head)
    return ReferenceModel(cfg, weights)


def phase_seconds(model, batch: int, tokens: int, cached: int, scale: float) -> float:
    """The median of REPEATS runs (after one warm-up; a first run of ONE_RUN_S or more is the one) of `tokens` new
    tokens for `batch` sequences after `cached` tokens in the cache: the layers' time x `scale` + the final norm
    and lm_head of each sequence's last token."""
    import torch

    cache = model._cache(batch, cached + tokens)
    ids = torch.zeros(batch, tokens, dtype=torch.long)
    positions = torch.arange(cached, cached + tokens).expand(batch, tokens)

    def run() -> tuple[float, float]:
        start = time.perf_counter()
        hidden = model._hidden(ids, positions, cache, None, None)
        middle = time.perf_counter()
        model._logits(hidden[:, -1])
        return middle - start, time.perf_counter() - middle

    first = run()
    runs = [first] if sum(first) >= ONE_RUN_S else [run() for _ in range(REPEATS)]
    return statistics.median(r[0] for r in runs) * scale + statistics.median(r[1] for r in runs)


def timed_performance(target: Target, workload: Workload, batch: int, timing: HostTiming,
                      roof: Roofline) -> Performance:
    """What the cpu plan predicts at its batch of clients: the in-flight model with its prefills charged
    (plan/feedback.py) over the timed phases, the roofline beside them as the speed of light; `decode_step_s` is the
    planned batch's step."""
    phases = timing.phases()

    def step(rows: float) -> float:
        return decode_step(phases, rows, workload.input_len + workload.output_len / 2)

    ttft, tpot, rate = serving_figures(INFLIGHT_BATCHING, timing.prefill_s, step, batch, batch, workload.output_len,
                                       stall_s=timing.prefill_s)
    return Performance(
        source=TIMED_SOURCE,
        basis=(f"the reference runtime timed on this host ({timing.threads} thread(s), {timing.layers_timed} of the "
               "layers timed and scaled, torch): in-flight batching, each admitted prompt prefilled between two decode "
               "steps"),
        batch=batch, max_num_tokens=0, prefill_s=timing.prefill_s, decode_step_s=timing.decode_step_s,
        ttft_s=ttft, tpot_s=tpot, output_tokens_per_s=rate, request_latency_s=ttft + (workload.output_len - 1) * tpot,
        speed_of_light={"prefill_s": roof.prefill_s_per_request, "decode_step_s": roof.decode_step_s},
        percent_of_speed_of_light=100 * roof.decode_step_s / timing.decode_step_s,
        memory=None, energy=energy_of(target, rate, 1), phases=phases)
