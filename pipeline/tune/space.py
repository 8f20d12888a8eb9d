"""The search space of `trtpipe tune`, per backend, and the planner's memory model as its constraint.

A `Candidate` is one point: values the study chooses, applied to the deployment's plan as a typed overlay
(`candidate_plan`: the planner re-plans with the candidate's values as overrides, then the Triton fields are
replaced with `dataclasses.replace`), plus the models' instance counts, which the plan does not hold
(deploy writes NVIDIA's `count: 1`; `trial.render_candidate` sets them on the ModelConfig messages).

- reference backends (the cpu target): Triton's max_batch_size (the rows the model's scheduler runs at once; up to
  the larger of the plan's and the load's highest concurrency), its max_queue_delay_microseconds (as on a GPU: the
  model batches in flight, so a wait only groups arrivals into one admission), and the instance counts of
  tensorrt_llm, preprocessing and postprocessing; with a speculative plan, the draft length K (1 to
  MAX_TUNED_DRAFT_LEN; the plan predicts each K's speedup and break-even rows again, pipeline/plan/speculative.py).
  batch_scheduler_policy is not in it: the cpu plan's KV pool is the host's memory, which a workload that fits the
  instances (`check_host_memory`) never exhausts, so both policies schedule alike;
- engine backend, without rebuilding: Triton max_batch_size up to the engine's, the queue delay,
  kv_cache_free_gpu_mem_fraction, batch_scheduler_policy, enable_chunked_context (only with paged context
  FMHA in the engine) and the pre/postprocessing instance counts. max_num_tokens at run time is not in it:
  tensorrtllm_backend passes maxNumTokens to the executor as nullopt (docs/upstream-facts.md), so only the
  engine's own value applies;
- engine backend with --rebuild: also the build's max_batch_size (Triton's follows it), max_num_tokens and
  multiple_profiles, each candidate compiled.

A candidate the planner refuses (no room for the KV cache of one sequence, a batch over the P99 budget, a
profile TensorRT-LLM cannot derive) or whose instances do not fit in host memory raises `Infeasible` and is
never served.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..backends import backend_for
from ..errors import UserError
from ..triton_names import BATCH_SCHEDULER_POLICIES, POSTPROCESSING, PREPROCESSING
from ..plan import Overrides, Plan
from ..planner import replan as plan_again
from ..plan.memory import decode_step_seconds, weights_read_per_step, format_gib
from ..plan.speculative import plan_speculation, request_of
from ..plan.trtllm import MAX_BATCH_SIZE_CAP
from .slo import Slo

QUEUE_DELAYS_US = (0, 100, 500, 1000, 2000, 5000, 10000)
KV_FRACTION_RANGE = (0.5, 0.95)
BUILD_NUM_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
#: tensorrt_llm Python-model instances on the cpu target (each holds its own weights and KV cache)
CPU_MODEL_INSTANCES = 2
#: preprocessing/postprocessing instances (tokenizers)
TOKENIZER_INSTANCES = {"cpu": 2, "gpu": 4}
#: the longest draft a speculative cpu plan's tuning tries: past it prompt lookup rarely finds that many tokens and a
#: step of K + 1 tokens a row costs more than its drafts return (benchmarks/bench_speculative.py chose K = 3 of 3, 5, 8)
MAX_TUNED_DRAFT_LEN = 8


class Infeasible(Exception):
    """The planner's memory model (or its rules) says the candidate cannot run; the message says why."""


@dataclass(frozen=True)
class Param:
    """One dimension of the space (turned into an Optuna distribution by the study)."""

    name: str
    kind: str                    # "int" | "float" | "choice"
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple = ()


@dataclass(frozen=True)
class Instances:
    tensorrt_llm: int = 1
    preprocessing: int = 1
    postprocessing: int = 1


@dataclass(frozen=True)
class Candidate:
    """One point of the space; None: the field does not apply to the backend (or not without --rebuild)."""

    max_batch_size: int                     # Triton's (and with --rebuild the engine's)
    max_queue_delay_microseconds: int
    instances: Instances = field(default_factory=Instances)
    kv_cache_free_gpu_mem_fraction: float | None = None
    batch_scheduler_policy: str | None = None
    enable_chunked_context: bool | None = None
    max_num_tokens: int | None = None       # --rebuild: the engine's
    multiple_profiles: bool | None = None   # --rebuild
    draft_len: int | None = None            # a speculative plan's K (cpu target)

    @property
    def rebuild(self) -> bool:
        return self.max_num_tokens is not None

    def params(self) -> dict:
        """Flat name -> value, as the study records them."""
        flat = {k: v for k, v in asdict(self).items() if k != "instances" and v is not None}
        flat.update({f"{k}_instances": v for k, v in asdict(self.instances).items()})
        return flat

    @classmethod
    def from_params(cls, params: dict) -> Candidate:
        counts = {k.removesuffix("_instances"): int(v) for k, v in params.items() if k.endswith("_instances")}
        rest = {k: v for k, v in params.items() if not k.endswith("_instances")}
        return cls(instances=Instances(**counts), **rest)

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.params().items())


@dataclass(frozen=True)
class SearchSpace:
    backend: str
    params: tuple[Param, ...]
    default: Candidate           # the plan's own configuration (trial 0, the baseline)
    start: tuple[Candidate, ...]  # the roofline's suggestion, tried right after the default
    notes: tuple[str, ...] = ()


def build_space(plan: Plan, slo: Slo, concurrencies: tuple[int, ...], rebuild: bool = False) -> SearchSpace:
    """The space for `plan`'s backend; UserError for --rebuild without an engine."""
    builds_engine = backend_for(plan.backend).builds_engine
    if rebuild and not builds_engine:
        raise UserError(f"--rebuild recompiles TensorRT-LLM engines; this is a {plan.backend} deployment "
                        f"({plan.target.name}), which builds none")
    triton = plan.triton
    kind = "gpu" if builds_engine else "cpu"
    delays = tuple(sorted(set(QUEUE_DELAYS_US) | {triton.max_queue_delay_microseconds}))
    params = [Param("max_queue_delay_microseconds", "choice", choices=delays)]
    params += [Param(f"{model}_instances", "int", 1, TOKENIZER_INSTANCES[kind])
               for model in (PREPROCESSING, POSTPROCESSING)]
    notes: list[str] = []
    if not builds_engine:
        upper = max(triton.triton_max_batch_size, max(concurrencies))
        params += [Param("max_batch_size", "int", 1, upper, log=True),
                   Param("tensorrt_llm_instances", "int", 1, CPU_MODEL_INSTANCES)]
        default = Candidate(triton.triton_max_batch_size, triton.max_queue_delay_microseconds)
        if plan.speculative and not plan.target.is_gpu:    # a GPU plan's K is planned, not tuned here
            k = plan.speculative.draft_len
            params.append(Param("draft_len", "int", 1, max(MAX_TUNED_DRAFT_LEN, k)))
            default = replace(default, draft_len=k)
    else:
        params, default, notes = engine_params(plan, params, concurrencies, rebuild)
    space = SearchSpace(plan.backend, tuple(params), default, (), tuple(notes))
    candidate_plan(plan, default)   # the plan itself must be reproducible (else it was made by another planner)
    start = roofline_candidate(plan, slo, space)
    return replace(space, start=(start,) if start != default else ())


def engine_params(plan: Plan, params: list[Param], concurrencies: tuple[int, ...],
                  rebuild: bool) -> tuple[list[Param], Candidate, list[str]]:
    build, plugin, triton = plan.build_config, plan.plugin_config, plan.triton
    fraction = triton.kv_cache_free_gpu_mem_fraction
    params += [Param("kv_cache_free_gpu_mem_fraction", "float", min(KV_FRACTION_RANGE[0], fraction),
                     max(KV_FRACTION_RANGE[1], fraction)),
               Param("batch_scheduler_policy", "choice", choices=BATCH_SCHEDULER_POLICIES),
               Param("enable_chunked_context", "choice",
                     choices=(False, True) if plugin.use_paged_context_fmha else (False,))]
    notes = ["max_num_tokens at run time: tensorrtllm_backend passes maxNumTokens to the executor as nullopt, "
             "so the engine's value applies (change it with --rebuild)"]
    default = Candidate(triton.triton_max_batch_size, triton.max_queue_delay_microseconds,
                        kv_cache_free_gpu_mem_fraction=fraction, batch_scheduler_policy=triton.batch_scheduler_policy,
                        enable_chunked_context=bool(triton.enable_chunked_context))
    if not rebuild:
        return params + [Param("max_batch_size", "int", 1, build.max_batch_size, log=True)], default, notes
    upper = min(MAX_BATCH_SIZE_CAP, max(2 * build.max_batch_size, max(concurrencies)))
    tokens = tuple(sorted(set(BUILD_NUM_TOKENS) | {build.max_num_tokens}))
    params += [Param("max_batch_size", "int", 1, upper, log=True),
               Param("max_num_tokens", "choice", choices=tokens),
               Param("multiple_profiles", "choice", choices=(False, True))]
    default = replace(default, max_num_tokens=build.max_num_tokens, multiple_profiles=plugin.multiple_profiles)
    return params, default, ["every candidate is compiled (trtllm-build): the build's max_batch_size, max_num_tokens "
                             "and multiple_profiles change with it; Triton's max_batch_size follows the engine's"]


def roofline_candidate(plan: Plan, slo: Slo, space: SearchSpace) -> Candidate:
    """The planner's figures as a starting point: the largest batch whose estimated decode step (one token of
    every sequence: the inter-token latency) stays within the SLO's ITL bound, or the space's largest batch. The
    step is the roofline's, scaled by how far from it the plan's performance model puts the plan's own step (its
    percent of speed of light: measured or derived figures on a GPU, 100% where the plan has only the bound)."""
    upper = int(next(p.high for p in space.params if p.name == "max_batch_size"))
    itl = [c.limit for c in slo.clauses if c.metric.startswith("itl_")]
    context = plan.workload.input_len + plan.workload.output_len / 2
    read = weights_read_per_step(plan.model.arch, plan.precision, plan.dtype, plan.tp_size, plan.pp_size,
                                 plan.model.quantized_lm_head)
    performance = plan.performance
    slower = 100 / performance.percent_of_speed_of_light if performance and performance.percent_of_speed_of_light \
        else 1.0

    def step_ms(batch: int) -> float:
        return 1e3 * slower * decode_step_seconds(read, batch, context, plan.kv_bytes_per_token, plan.target)

    batch = upper
    if itl:
        batch = max([b for b in range(1, upper + 1) if step_ms(b) <= min(itl)], default=1)
    return replace(space.default, max_batch_size=batch)


# ----------------------------------------------------------------------------------------------
# The overlay, with the planner as the constraint


def candidate_plan(base: Plan, candidate: Candidate) -> Plan:
    """`base` with the candidate's values; Infeasible when the planner (or host memory) says it cannot run."""
    if backend_for(base.backend).builds_engine:
        return engine_candidate_plan(base, candidate)
    plan = replan(base, Overrides(max_batch_size=candidate.max_batch_size))
    if plan.triton.triton_max_batch_size != candidate.max_batch_size:
        raise Infeasible(f"the planner caps the batch at {plan.triton.triton_max_batch_size} "
                         f"(P99 budget {base.workload.p99_latency_s:g} s)")
    check_host_memory(plan, candidate)
    if candidate.draft_len is not None and candidate.draft_len != plan.speculative.draft_len:
        plan = with_draft_len(plan, candidate.draft_len)
    return replace(plan, triton=replace(plan.triton,
                                        max_queue_delay_microseconds=candidate.max_queue_delay_microseconds))


def with_draft_len(plan: Plan, k: int) -> Plan:
    """The speculative plan planned again with K drafts a step (its acceptance and drafts a step as it was asked
    for: a default drafts-per-step follows K)."""
    request = replace(request_of(plan.speculative), draft_len=k)
    if request.drafts_per_step is not None:
        request = replace(request, drafts_per_step=min(request.drafts_per_step, float(k)))
    try:
        return plan_speculation(replace(plan, speculative=None), request)
    except UserError as exc:
        raise Infeasible(str(exc)) from None


def engine_candidate_plan(base: Plan, c: Candidate) -> Plan:
    build, plugin, triton = base.build_config, base.plugin_config, base.triton
    profiles = c.multiple_profiles if c.rebuild else plugin.multiple_profiles
    plan = replan(base, Overrides(
        max_batch_size=c.max_batch_size if c.rebuild else build.max_batch_size,
        max_num_tokens=c.max_num_tokens if c.rebuild else build.max_num_tokens,
        opt_num_tokens=None if profiles or c.rebuild else build.opt_num_tokens,
        multiple_profiles=profiles, use_paged_context_fmha=plugin.use_paged_context_fmha,
        enable_kv_cache_reuse=triton.enable_kv_cache_reuse,
        kv_cache_free_gpu_mem_fraction=c.kv_cache_free_gpu_mem_fraction))
    if not c.rebuild and plan.build_config != build:
        raise UserError("this trtpipe's planner does not reproduce the plan's engine build (re-run `trtpipe plan` "
                        "and rebuild, or tune with --rebuild)")
    return replace(plan, triton=replace(
        plan.triton, triton_max_batch_size=c.max_batch_size, preferred_batch_size=[c.max_batch_size],
        max_queue_delay_microseconds=c.max_queue_delay_microseconds, batch_scheduler_policy=c.batch_scheduler_policy,
        enable_chunked_context=c.enable_chunked_context))


def replan(base: Plan, overrides: Overrides) -> Plan:
    """make_plan for the base plan's request with `overrides`; its UserError becomes Infeasible."""
    try:
        return plan_again(base, overrides)
    except UserError as exc:
        raise Infeasible(str(exc)) from None


def check_host_memory(plan: Plan, c: Candidate) -> None:
    """Each tensorrt_llm instance holds the float32 weights and the KV cache of a full batch of workload-length
    sequences (at least one of max_seq_len); with the planner's reserve all must fit in the target's memory."""
    workload = plan.workload
    tokens = max(c.max_batch_size * (workload.input_len + workload.output_len), plan.max_seq_len)
    per_instance = plan.weights_bytes_per_rank + tokens * plan.kv_bytes_per_token
    need = c.instances.tensorrt_llm * per_instance + plan.memory.runtime_reserve_bytes
    if need > plan.memory.memory_bytes:
        reserve = format_gib(plan.memory.runtime_reserve_bytes)
        raise Infeasible(f"{c.instances.tensorrt_llm} tensorrt_llm instances x "
                         f"({format_gib(plan.weights_bytes_per_rank)} weights + KV cache of {tokens} tokens) + "
                         f"{reserve} reserve = {format_gib(need)}, more than the "
                         f"{format_gib(plan.memory.memory_bytes)} of {plan.target.name}")
