"""`trtpipe compare BUILD_A BUILD_B`: two builds of one model side by side on the same prompts and load.

    report = compare_builds(CompareOptions(build_a, build_b, out, thresholds=Thresholds(max_ppl_increase=2)))
    report.passed        # every threshold holds; the CLI exits 1 when not

Modules: `builds` (a build directory, model and tokenizer identity), `serving` (prompts; serve one build,
greedy completions, the load test at one concurrency), `quality` (perplexity, token agreement, ROUGE-L,
BLEU, exact match), `verdict` (thresholds), `report` (figures, changes, JSON/Markdown/plot).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from ..outputs import atomic_output_dir
from .builds import BuildInfo, identity_differences, load_build
from .quality import generation_figures, heldout_perplexity
from .report import CompareReport, changes
from .serving import ServeOptions, load_prompts, serve_and_measure
from .verdict import THRESHOLDS, Thresholds, judge, parse_percent

__all__ = ["THRESHOLDS", "CompareOptions", "CompareReport", "Thresholds", "compare_builds", "parse_percent"]


@dataclass(frozen=True)
class CompareOptions:
    build_a: Path
    build_b: Path
    out: Path
    thresholds: Thresholds = field(default_factory=Thresholds)
    serve: ServeOptions = field(default_factory=ServeOptions)
    prompts: str | None = None            # a file or a recipe (serving.PROMPT_RECIPES); None: held-out news
    num_prompts: int = 16
    ppl_samples: int = 16
    url_a: str | None = None
    url_b: str | None = None
    allow_different_tokenizer: bool = False
    device: str = "auto"


def compare_builds(options: CompareOptions, say=lambda message: None) -> CompareReport:
    """Everything is checked before any server starts; the report directory appears only when complete."""
    from transformers import AutoTokenizer

    a, b = load_build(options.build_a, "A"), load_build(options.build_b, "B")
    options.thresholds.check(options.serve.load_test)
    if options.ppl_samples < 1:
        raise UserError(f"--eval-samples must be at least 1 (got {options.ppl_samples})")
    source, prompts = load_prompts(options.prompts, options.num_prompts)
    tok_a, tok_b = AutoTokenizer.from_pretrained(a.tokenizer), AutoTokenizer.from_pretrained(b.tokenizer)
    differences = identity_differences(a, b, tok_a, tok_b)
    notes = []
    if differences and not options.allow_different_tokenizer:
        raise UserError("the builds are not the same model and tokenizer, so per-token figures do not compare ("
                        + "; ".join(differences) + "); pass --allow-different-tokenizer to compare them anyway")
    if differences:
        notes.append("the builds differ (" + "; ".join(differences) + "): perplexities are per token of each "
                     "build's own tokenizer, and token agreement uses A's tokenizer")
    with atomic_output_dir(Path(options.out)) as tmp:
        sides = {}
        for side, build, url in (("A", a, options.url_a), ("B", b, options.url_b)):
            say(f"[{side}] {build.label}: held-out perplexity of {build.checkpoint.name}")
            ppl = heldout_perplexity(build.checkpoint, options.ppl_samples, options.device)
            served = serve_and_measure(build.repo, url, prompts, options.serve, lambda m, s=side: say(f"[{s}] {m}"),
                                       build.speculative)
            sides[side] = (build, ppl, served)
        completions_a, completions_b = sides["A"][2].completions, sides["B"][2].completions
        generation = generation_figures(tok_a, completions_a, completions_b).to_dict()
        builds = {side: _build_record(build, ppl, served) for side, (build, ppl, served) in sides.items()}
        figures = changes(builds["A"], builds["B"], generation)
        report = CompareReport(
            builds=builds, prompts={"source": source, "count": len(prompts), "max_tokens": options.serve.max_tokens},
            generation=generation, changes=figures, thresholds=judge(options.thresholds, figures),
            completions=[{"prompt": p, "a": x, "b": y} for p, x, y in zip(prompts, completions_a, completions_b)],
            notes=notes)
        report.write(tmp)
    return report


def _build_record(build: BuildInfo, ppl, served) -> dict:
    return {"label": build.label, "path": str(build.path), "precision": build.precision,
            "checkpoint": build.checkpoint.name, "server": served.server, "memory": build.memory(),
            "perplexity": asdict(ppl), "load": served.load, "speculation": served.speculation}
