"""The headline job at its real size: convert, calibrate and eval of Llama-shaped checkpoints, peak memory and time.

    python benchmarks/bench_scale.py --shape 1.1b                            # TinyLlama-shaped, 22 layers
    python benchmarks/bench_scale.py --shape 8b --stages convert,eval         # Llama-3-8B, 32 layers, 16 GB
    python benchmarks/bench_scale.py --shape 8b --layers 1 --stages calibrate # Llama-3-8B widths, one layer
    python benchmarks/bench_scale.py --shape 8b --layers 1 --stages calibrate --precision int4-awq,w4a8-awq

A synthetic random fp16 checkpoint of the shape is written once into --cache (reused). Each command is
its own process (`trtpipe ...`, as a user runs it); its peak RSS comes from wait4() and is printed next
to the goal of issue 11, with the convert time as a ratio to `cp -r` of the same files (best of
--repeat, alternating, page cache synced before each run). Peak memory of a layer-streamed stage does
not depend on the number of layers (one layer is held), so --layers trades run time (GPTQ of one
Llama-3-8B layer takes minutes on 2 cores) for nothing but the total; the embedding and lm_head stay
at full vocabulary size. Each calibrated checkpoint's size is printed as measured and as the full shape's
(the per-layer bytes times the shape's own layer count, plus everything outside the layers).

The vocabulary of the 1.1b shape is SmolLM2's (49152, not TinyLlama's 32000) so the offline
tokenizer's ids fit; calibration and eval text is the offline corpus.

The checkpoint is written by a child process and this one never imports torch: Linux keeps a process's
peak RSS across exec, and a child forked from a large parent starts from the parent's RSS, so a big
benchmark process would inflate every figure it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=49152, rope_theta=10000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}
#: issue 11's goals: peak RSS of calibrate and eval per shape
STAGE_GOAL_BYTES = {"1.1b": 2 << 30, "8b": 4 << 30}
SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_tensors(cfg: dict) -> list:
    from pipeline.safetensors_stream import TensorSpec

    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    specs = [TensorSpec("model.embed_tokens.weight", "F16", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        specs += [TensorSpec(p + "input_layernorm.weight", "F16", (h,)),
                  TensorSpec(p + "post_attention_layernorm.weight", "F16", (h,)),
                  TensorSpec(p + "self_attn.q_proj.weight", "F16", (h, h)),
                  TensorSpec(p + "self_attn.k_proj.weight", "F16", (kv, h)),
                  TensorSpec(p + "self_attn.v_proj.weight", "F16", (kv, h)),
                  TensorSpec(p + "self_attn.o_proj.weight", "F16", (h, h)),
                  TensorSpec(p + "mlp.gate_proj.weight", "F16", (i, h)),
                  TensorSpec(p + "mlp.up_proj.weight", "F16", (i, h)),
                  TensorSpec(p + "mlp.down_proj.weight", "F16", (h, i))]
    return specs + [TensorSpec("model.norm.weight", "F16", (h,)),
                    TensorSpec("lm_head.weight", "F16", (v, h))]


def make_checkpoint(directory: Path, cfg: dict) -> Path:
    """A random fp16 Llama in Hugging Face layout (sharded safetensors + index), written by a child process."""
    if not (directory / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--write-checkpoint", str(directory), json.dumps(cfg)], check=True)
    return directory


def write_checkpoint(directory: Path, cfg: dict) -> None:
    """Write the checkpoint tensor by tensor (this process imports torch: never the measuring one)."""
    import torch

    from pipeline.safetensors_stream import SafetensorsWriter

    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, current, size = [], [], 0
    for spec in hf_tensors(cfg):
        if current and size + spec.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    shards.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, specs in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with SafetensorsWriter(tmp / name, specs, metadata={"format": "pt"}) as writer:
            for spec in specs:
                scale = 0.1 if "norm" in spec.name else 0.02
                base = 1.0 if "norm" in spec.name else 0.0
                writer.write((base + scale * torch.randn(spec.shape, generator=gen)).to(torch.float16))
                weight_map[spec.name] = name
    (tmp / "largest.json").write_text(json.dumps({"bytes": max(s.nbytes for s in hf_tensors(cfg))}))
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float16",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **cfg}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    from pipeline.sources import resolve_model

    tok_dir = resolve_model("smollm2-135m").hf_dir()        # SmolLM2's tokenizer, from trtpipe's cache
    for f in TOKENIZER_FILES:
        shutil.copy(tok_dir / f, tmp / f)
    tmp.rename(directory)


def run(cmd: list[str]) -> tuple[float, int, str]:
    """(seconds, peak RSS bytes, output) of one command, as its own process."""
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return seconds, usage.ru_maxrss * 1024, output


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def bench(shape: str, layers: int | None, cache: Path, repeat: int, trtpipe: str, stages: set[str],
          precisions: list[str]) -> None:
    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    tag = f"{shape}-L{cfg['num_hidden_layers']}"
    hf = make_checkpoint(cache / f"hf-{tag}", cfg)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    largest = json.loads((hf / "largest.json").read_text())["bytes"]
    print(f"== {shape} shape, {cfg['num_hidden_layers']} layers: {gib(size)} fp16 in {hf}", flush=True)

    work = cache / f"work-{tag}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    cp_times, conv_times, conv_rss = [], [], 0
    for _ in range(repeat if "convert" in stages else 1):
        for target in (work / "cp", work / "ckpt"):
            shutil.rmtree(target, ignore_errors=True)
        cp_times.append(run(["cp", "-r", str(hf), str(work / "cp")])[0])
        seconds, rss, _ = run([trtpipe, "convert", str(hf), "-o", str(work / "ckpt"), "--precision", "fp16"])
        conv_times.append(seconds)
        conv_rss = max(conv_rss, rss)
    shutil.rmtree(work / "cp")
    ratio = min(conv_times) / min(cp_times)
    conv_goal = 3 * largest + (500 << 20)
    if "convert" in stages:
        print(f"convert: {min(conv_times):.1f} s vs cp -r {min(cp_times):.1f} s -> ratio {ratio:.2f} (goal <= 1.5); "
              f"peak RSS {gib(conv_rss)} (goal <= 3 x largest tensor + 500 MB = {gib(conv_goal)})", flush=True)

    goal = STAGE_GOAL_BYTES[shape]
    if "calibrate" in stages:
        calibrate(work, cfg, shape, trtpipe, goal, precisions)
    if "eval" in stages:
        seconds, rss, out = run([trtpipe, "eval", str(work / "ckpt"), "--eval-samples", "4", "--json", "--device",
                                 "cpu"])
        print(f"eval, 4 documents: {seconds:.0f} s, {json.loads(out.strip().splitlines()[-1])}; peak RSS "
              f"{gib(rss)} (goal <= {gib(goal)})", flush=True)
    shutil.rmtree(work)


def calibrate(work: Path, cfg: dict, shape: str, trtpipe: str, goal: int, precisions: list[str]) -> None:
    layers, full_layers = cfg["num_hidden_layers"], SHAPES[shape]["num_hidden_layers"]
    float_layers, float_outside = checkpoint_bytes(work / "ckpt")
    float_full = float_outside + float_layers / layers * full_layers
    for precision in precisions:
        out = work / f"ckpt-{precision}"
        seconds, rss, _ = run([trtpipe, "calibrate", str(work / "ckpt"), "-o", str(out), "--precision", precision,
                               "--samples", "4", "--seq-len", "128", "--eval-samples", "0", "--quiet", "--device",
                               "cpu"])
        per_layer = seconds / layers
        in_layers, outside = checkpoint_bytes(out)
        full = outside + in_layers / layers * full_layers
        print(f"calibrate {precision} (GPTQ), 4 x 128 tokens: {seconds:.0f} s ({per_layer:.1f} s per layer -> "
              f"{per_layer * full_layers:.0f} s for all {full_layers}); peak RSS {gib(rss)} (goal <= {gib(goal)}); "
              f"checkpoint {gib(in_layers + outside)}, {full / 1e9:.2f} GB at {full_layers} layers (fp16: "
              f"{float_full / 1e9:.2f} GB)", flush=True)
        shutil.rmtree(out)


def checkpoint_bytes(directory: Path) -> tuple[int, int]:
    """(bytes of the decoder layers' tensors, bytes of the rest) from the rank files' safetensors headers."""
    in_layers = outside = 0
    for rank_file in directory.glob("rank*.safetensors"):
        with rank_file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            if ".layers." in name:
                in_layers += size
            else:
                outside += size
    return in_layers, outside


def main() -> None:
    if sys.argv[1:2] == ["--write-checkpoint"]:
        sys.path.insert(0, str(ROOT))
        write_checkpoint(Path(sys.argv[2]), json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--layers", type=int, default=None, help="Decoder layers (default: the shape's own).")
    cache = Path(os.environ.get("TRTPIPE_CACHE", Path.home() / ".cache/trtpipe")) / "bench-scale"
    parser.add_argument("--cache", type=Path, default=cache, help="Where the synthetic checkpoints are kept.")
    parser.add_argument("--repeat", type=int, default=2, help="convert and cp runs (best of).")
    parser.add_argument("--stages", default="convert,calibrate,eval",
                        help="Which to measure (the checkpoint is always converted).")
    parser.add_argument("--precision", default="fp8", help="calibrate's precisions, comma-separated "
                        "(fp8, int8-sq, int4-awq, w4a8-awq).")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    for shape in (SHAPES if args.shape == "both" else [args.shape]):
        bench(shape, args.layers, args.cache, args.repeat, trtpipe, set(args.stages.split(",")),
              args.precision.split(","))


if __name__ == "__main__":
    main()
