"""SUMMARY.md of a build folder: for a person, what build.json holds for tools — the verdict, what each folder
holds, and the commands that come next, each run from the build folder (so it names no machine path)."""

from __future__ import annotations

#: What each stage leaves in the build folder, for a person.
STAGE_OUTPUTS = {
    "convert": "the TensorRT-LLM checkpoint converted from the model",
    "sparsify": "the checkpoint pruned to the 2:4 pattern",
    "distill": "the sparse checkpoint after distillation from the dense one",
    "calibrate": "the quantized checkpoint, with its calibration/ report (perplexity, plots, TensorRT cache)",
    "export": "the Hugging Face export the backend serves or the golden reference reads",
    "plan": "the plan: memory, batch, build config and Triton parameters (`trtpipe plan` would print it)",
    "compile": "the engine, or the exact trtllm-build command where no engine could be built here",
    "deploy": "the Triton model repository (NVIDIA's inflight_batcher_llm layout; its README.md says how to serve it)",
    "validate": "the validation report (report.json)",
}


def summary_markdown(record: dict) -> str:
    """SUMMARY.md from build.json's record (its paths already relative to the build folder)."""
    options = record["options"]
    title = f"{options['model']} on {options['target']}, {options['precision']} ({options.get('backend')} backend)"
    lines = [f"# Build: {title}", "", f"**Verdict:** {record['verdict']}", "", "## What is here", "",
             "| path | stage | what it holds |", "|---|---|---|"]
    for stage in record["stages"]:
        lines.append(f"| `{stage['path']}` | {stage['stage']} ({stage['status'] or 'done'}) | "
                     f"{STAGE_OUTPUTS.get(stage['stage'], '')} |")
    lines += ["| `build.json` | | this record for tools: options, every stage's time and size, the verdict |", "",
              "## Next, from this folder", "", "```bash", *next_commands(record), "```", ""]
    return "\n".join(lines)


def next_commands(record: dict) -> list[str]:
    """What a person runs next on this build; serving commands only where a repository was written."""
    stages = {s["stage"]: s["path"] for s in record["stages"]}
    repo = stages.get("deploy")
    if repo is None:
        return ["trtpipe build ...   # on the GPU machine: no repository was written here (see the verdict)"]
    name = f"{record['options']['model']}-{record['options']['target']}-{record['options']['precision']}"
    commands = [(f"trtpipe serve {repo}", "Triton on :8000 until Ctrl-C"),
                (f"trtpipe validate {repo}", "readiness, golden outputs, streaming, bad requests"),
                ('trtpipe tune . --slo "ttft_p99<=2s,itl_p99<=300ms"', "batching tuned by measurement"),
                (f"trtpipe package . -o ../{name}.tar", "one verified archive"),
                ("trtpipe k8s . -o k8s", "Kubernetes manifests, autoscaling, dashboard")]
    width = max(len(command) for command, _ in commands)
    return [f"{command:<{width}}  # {why}" for command, why in commands]
