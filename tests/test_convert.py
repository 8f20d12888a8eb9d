"""The convert stage, checked two ways: against TensorRT-LLM's rules written out here with plain torch
ops, and against NVIDIA's own exporter (nvidia-modelopt 0.37) as an independent second opinion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.sources import resolve_model
from support.trtllm_rules import expected_rank


def convert(hf_dir: Path, out: Path, **kw):
    return convert_model(resolve_model(str(hf_dir)), out, progress=False, **kw)


def hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(hf_dir / "model.safetensors"))


@pytest.mark.parametrize("variant,tp,pp", [
    ("mha", 1, 1), ("mha", 2, 1), ("gqa", 4, 1), ("mqa", 4, 1), ("gqa", 2, 2), ("tied", 2, 2),
    ("head-dim", 2, 1), ("llama3-rope", 1, 2), ("mistral", 2, 1),
])
def test_rank_files_follow_trtllm_sharding_rules(tiny_llama, tmp_path, variant, tp, pp):
    hf_dir = tiny_llama(variant)
    result = convert(hf_dir, tmp_path / "ckpt", tp=tp, pp=pp)
    cfg = result.config
    assert cfg["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    hf = hf_state(hf_dir)
    for rank in range(tp * pp):
        got = load_file(str(tmp_path / "ckpt" / f"rank{rank}.safetensors"))
        want = expected_rank(hf, cfg, tp, pp, rank)
        assert set(got) == set(want), f"rank {rank}"
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"rank {rank}: {name}"


def test_config_carries_checkpoint_and_llama_fields(tiny_llama, tmp_path):
    hf_cfg = json.loads((tiny_llama("llama3-rope") / "config.json").read_text())
    cfg = convert(tiny_llama("llama3-rope"), tmp_path / "c", dtype="bfloat16").config
    on_disk = json.loads((tmp_path / "c" / "config.json").read_text())
    assert on_disk == cfg
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["dtype"] == "bfloat16"
    assert cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["rotary_base"] == hf_cfg["rope_theta"] == 500000.0
    assert cfg["rotary_scaling"]["rope_type"] == "llama3" and cfg["rotary_scaling"]["factor"] == 8.0
    assert cfg["norm_epsilon"] == hf_cfg["rms_norm_eps"]
    assert cfg["head_size"] == hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    for key in ("logits_dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "hidden_act", "max_position_embeddings",
                "mlp_bias", "attn_bias", "residual_mlp", "disable_weight_only_quant_plugin",
                "fc_after_embed", "use_input_layernorm_in_first_layer", "use_last_layernorm",
                "layer_idx_offset", "moe", "tie_word_embeddings"):
        assert key in cfg, key
    weights = load_file(str(tmp_path / "c" / "rank0.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_head_dim_different_from_hidden_over_heads(tiny_llama, tmp_path):
    cfg = convert(tiny_llama("head-dim"), tmp_path / "c").config
    assert cfg["head_size"] == 16 != cfg["hidden_size"] // cfg["num_attention_heads"]
    qkv = load_file(str(tmp_path / "c" / "rank0.safetensors"))["transformer.layers.0.attention.qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16, 48)


@pytest.mark.parametrize("variant,tp", [("gqa", 1), ("tied", 1), ("mqa", 2), ("head-dim", 2)])
def test_matches_nvidia_modelopt_export(tiny_llama, tmp_path, variant, tp):
    """modelopt's exporter writes the same names, shapes and values (it shards the embedding too,
    with use_parallel_embedding, which TensorRT-LLM's own converter leaves off by default)."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_llama(variant)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=tmp_path / "mo",
                                   inference_tensor_parallel=tp)
    ours = convert(hf_dir, tmp_path / "ours", dtype="float16", tp=tp).config
    theirs = json.loads((tmp_path / "mo" / "config.json").read_text())
    for key in ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_size", "intermediate_size", "hidden_act", "norm_epsilon",
                "position_embedding_type", "rotary_base", "max_position_embeddings", "mapping"):
        assert ours[key] == theirs[key], key
    for rank in range(tp):
        a = load_file(str(tmp_path / "ours" / f"rank{rank}.safetensors"))
        b = load_file(str(tmp_path / "mo" / f"rank{rank}.safetensors"))
        if tp > 1:
            a.pop("transformer.vocab_embedding.weight"), b.pop("transformer.vocab_embedding.weight")
        assert set(a) == set(b)
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_rerun_is_a_noop_and_force_rewrites(tiny_llama, tmp_path):
    out = tmp_path / "c"
    first = convert(tiny_llama("gqa"), out)
    assert not first.skipped
    mtime = (out / "rank0.safetensors").stat().st_mtime_ns
    again = convert(tiny_llama("gqa"), out)
    assert again.skipped and (out / "rank0.safetensors").stat().st_mtime_ns == mtime
    forced = convert(tiny_llama("gqa"), out, dtype="float16", force=True)
    assert not forced.skipped and forced.config["dtype"] == "float16"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["params"] == {"dtype": "float16", "tp": 1, "pp": 1}
    assert "rank0.safetensors" in manifest["outputs"]


def test_interrupted_conversion_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    import pipeline.convert as conv

    calls = []

    def failing_write(path, jobs, advance):
        calls.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "write_rank_file", failing_write)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_llama("gqa"), tmp_path / "c", tp=2)
    assert calls and list(tmp_path.iterdir()) == []


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def corrupt_copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _truncate(d: Path):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _drop_tensor(d: Path):
    from safetensors.torch import save_file
    state = hf_state(d)
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def _wrong_shape(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))


def _unknown_arch(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))


def _int64_weight(d: Path):
    from safetensors.torch import save_file
    state = hf_state(d)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int64)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def _list_header(d: Path):
    header = json.dumps([{"dtype": "F32"}]).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def _bin_only(d: Path):
    (d / "model.safetensors").rename(d / "pytorch_model.bin")


@pytest.mark.parametrize("damage,message", [
    (_truncate, "truncated"),
    (_drop_tensor, "missing tensor(s) model.layers.1.mlp.up_proj.weight"),
    (_wrong_shape, "config.json implies"),
    (_unknown_arch, "unknown architecture 'GPT2LMHeadModel'"),
    (_bin_only, ".bin weights"),
    # issue 25's unclear cases: an int64 weight was silently cast, a JSON-list header was an AttributeError
    (_int64_weight, "tensor model.layers.0.mlp.up_proj.weight is I64, not a floating-point dtype"),
    (_list_header, "its header is a JSON list, not an object of tensors"),
])
def test_bad_weights_fail_cleanly(tiny_llama, tmp_path, damage, message):
    src = corrupt_copy(tiny_llama("gqa"), tmp_path / "hf")
    damage(src)
    code, output = run_cli("convert", src, "-o", tmp_path / "out")
    assert code == 2, output
    assert message in output and "Traceback" not in output
    assert len(output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp 3 does not divide num_attention_heads 8"),
    (["--tp", "16"], "does not divide num_attention_heads"),
    (["--pp", "3"], "--pp 3 does not divide num_hidden_layers 4"),
])
def test_impossible_parallelism_is_refused(tiny_llama, tmp_path, args, message):
    code, output = run_cli("convert", tiny_llama("gqa"), "-o", tmp_path / "out", *args)
    assert code == 2 and message in output
    assert not (tmp_path / "out").exists()


def test_kv_heads_must_divide_or_be_divided_by_tp(tmp_path):
    from support.models import make_tiny_model
    hf = make_tiny_model(tmp_path / "hf", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    code, output = run_cli("convert", hf, "-o", tmp_path / "out", "--tp", "2")
    assert code == 2 and "num_key_value_heads 3" in output


def test_existing_output_is_not_overwritten(tiny_llama, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, output = run_cli("convert", tiny_llama("gqa"), "-o", tmp_path / "out")
    assert code == 2 and "trtpipe did not write it" in output and "--force" not in output   # never offered for it
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert run_cli("convert", tiny_llama("gqa"), "-o", tmp_path / "ckpt")[0] == 0
    code, output = run_cli("convert", tiny_llama("tied"), "-o", tmp_path / "ckpt")     # its own, other inputs
    assert code == 2 and "already exists" in output and "--force" in output


def test_sharded_source_with_index(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama("gqa"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB", safe_serialization=True)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = convert(tmp_path / "sharded", tmp_path / "a", tp=2).path
    b = convert(tiny_llama("gqa"), tmp_path / "b", tp=2).path
    for rank in (0, 1):
        x, y = (load_file(str(p / f"rank{rank}.safetensors")) for p in (a, b))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_unknown_model_names_say_where_to_look(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, output = run_cli("convert", "llama-3-8b", "-o", tmp_path / "out", "--model-dir", tmp_path)
    assert code == 2 and "meta-llama/Meta-Llama-3-8B" in output and str(tmp_path) in output
    code, output = run_cli("convert", "no-such-model", "-o", tmp_path / "out")
    assert code == 2 and "not a directory, a .gguf file, a preset" in output


def test_hub_id_resolves_from_a_user_model_dir(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama("gqa"), tmp_path / "models" / "meta-llama" / "Meta-Llama-3-8B")
    source = resolve_model("llama-3-8b", tmp_path / "models")
    assert source.kind == "hf-dir" and source.arch.num_attention_heads == 8


@pytest.mark.slow
def test_smollm2_converts_end_to_end_at_tp3(smollm2_hf_dir, tmp_path):
    code, output = run_cli("convert", "smollm2-135m", "-o", tmp_path / "c", "--tp", "3", "--json")
    assert code == 0, output
    summary = json.loads(output[output.index("{"):])
    assert summary["tp_size"] == 3 and summary["dtype"] == "float32"
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["tie_word_embeddings"] is True
    hf = hf_state(smollm2_hf_dir)
    for rank in range(3):
        got = load_file(str(tmp_path / "c" / f"rank{rank}.safetensors"))
        want = expected_rank(hf, cfg, 3, 1, rank)
        assert set(got) == set(want)
        for name in ("transformer.layers.7.attention.qkv.weight", "transformer.layers.29.mlp.proj.weight",
                     "lm_head.weight"):
            assert torch.equal(got[name], want[name]), name
    assert (tmp_path / "c" / "tokenizer" / "tokenizer.json").is_file()


def test_a_conversion_of_byte_copies_never_imports_torch(tiny_llama, tmp_path):
    """Same dtype, tp=1: every tensor is copied file to file, so the CLI skips torch's ~2 s import."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    hf_fp16 = tmp_path / "fp16"
    AutoModelForCausalLM.from_pretrained(tiny_llama("gqa"), dtype=torch.float16).save_pretrained(hf_fp16)
    probe = ("import sys; from pathlib import Path; from pipeline.convert import convert_model; "
             "from pipeline.sources import resolve_model; "
             "convert_model(resolve_model(sys.argv[1]), Path(sys.argv[2]), dtype=sys.argv[3], progress=False); "
             "print('torch' in sys.modules)")

    def imports_torch(dtype: str) -> str:
        return subprocess.run([sys.executable, "-c", probe, str(hf_fp16), str(tmp_path / dtype), dtype],
                              capture_output=True, text=True, check=True).stdout.strip()

    assert imports_torch("float16") == "False"
    assert imports_torch("float32") == "True"      # a cast needs torch: the check above is not vacuous
    assert load_file(tmp_path / "float16" / "rank0.safetensors")["lm_head.weight"].dtype == torch.float16


def test_trtpipe_convert_starts_without_the_server_the_hub_or_the_backends(tiny_llama, tmp_path):
    """`trtpipe convert DIR` loads only its own command's module: not the serving commands (requests, the server),
    huggingface_hub (a local directory needs no hub) nor the backends and planner (issue 29: start-up was 0.5 s of
    a 3.8 GB conversion). A hub id still resolves through huggingface_hub (test_sources)."""
    import subprocess
    import sys

    probe = ("import sys; from pipeline.cli import main\n"
             "try:\n    main(['convert', sys.argv[1], '-o', sys.argv[2]])\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "heavy = ('requests', 'huggingface_hub', 'pipeline.server', 'pipeline.backends.engine', "
             "'pipeline.plan', 'pipeline.cli.serving', 'pipeline.cli.shipping', 'torch')\n"
             "print(' '.join(m for m in heavy if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe, str(tiny_llama("gqa")), str(tmp_path / "c")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1:] in ([], [""]), done.stderr
    assert (tmp_path / "c" / "rank0.safetensors").is_file()


def test_the_command_table_names_every_commands_module():
    """base.COMMAND_MODULES, by which the group imports a command's module on demand, matches what the modules
    register (a command missing from it would not be found; a wrong module would not register it)."""
    import importlib
    import inspect

    from pipeline.cli.base import COMMAND_MODULES, main

    for module in set(COMMAND_MODULES.values()):
        importlib.import_module(f"pipeline.cli.{module}")
    registered = {name: inspect.getmodule(cmd.callback).__name__ for name, cmd in main.commands.items()}
    assert set(registered) == set(COMMAND_MODULES)
    for name, module in COMMAND_MODULES.items():
        owner = registered[name]
        assert owner == f"pipeline.cli.{module}" or name == "versions", (name, owner)


@pytest.mark.parametrize("where", ["the source", "above the source"])
def test_an_output_that_is_or_holds_the_source_is_refused_even_with_force(tiny_llama, tmp_path, where):
    """`convert SRC -o SRC --force` exited 0 and deleted the Hugging Face model it converted (issue 25)."""
    src = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_llama("gqa"), src)
    before = sorted(p.name for p in src.iterdir())
    out = src if where == "the source" else src.parent
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(out), "--force"])
    assert result.exit_code == 2, result.output
    assert "would replace the stage's own input" in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in src.iterdir()) == before


def test_a_second_writer_of_the_same_output_is_refused_and_a_killed_runs_partial_is_removed(tiny_llama, tmp_path):
    """Two `calibrate -o SAME` at once both printed "wrote" and one output was lost; a killed run's
    `.NAME.partial-PID` stayed forever (issue 25 cases 3, 8). The lock is held by another process here."""
    import subprocess
    import sys

    out = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"), str(tmp_path / ".ckpt.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = CliRunner().invoke(main, ["convert", str(tiny_llama("gqa")), "-o", str(out)])
        assert busy.exit_code == 2 and "being written by another trtpipe process" in busy.output, busy.output
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    stale = tmp_path / ".ckpt.partial-4242"
    (stale / "half").mkdir(parents=True)
    done = CliRunner().invoke(main, ["convert", str(tiny_llama("gqa")), "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert not stale.exists() and not (tmp_path / ".ckpt.lock").exists()


@pytest.mark.parametrize("args, flag", [(["calibrate", "CKPT", "-o", "OUT", "--precision", "fp8", "--eval-samples",
                                          "-1"], "--eval-samples"),
                                        (["calibrate", "CKPT", "-o", "OUT", "--precision", "fp8", "--samples", "0"],
                                         "--samples"),
                                        (["eval", "CKPT", "--eval-samples", "0"], "--eval-samples")])
def test_a_count_below_its_range_is_exit_2_naming_the_option(args, flag, tmp_path):
    """`--eval-samples -1` was accepted (issue 25, unclear cases)."""
    args = [str(tmp_path / a) if a in ("CKPT", "OUT") else a for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and flag in result.output and "Traceback" not in result.output
