"""2:4 sparsity: the pattern, SparseGPT against magnitude, `trtpipe sparsify` on tiny checkpoints (tp 1 and 2),
the claim checked where the runtime reads it, calibrate keeping every zero, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline.calibrate.rounding import HessianStats, gptq_inverse
from pipeline.checkpoint import CheckpointConfig
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.runtime.trtllm_reader import CheckpointReader
from pipeline.sparsity.pattern import CONFIG_KEY, SparsityClaim, check_claimed, dense_groups, magnitude_keep
from pipeline.sparsity.sparsegpt import prune_magnitude, prune_sparsegpt
from support.models import make_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")   # as tiny_hf has
OUTER = ("transformer.vocab_embedding.weight", "lm_head.weight", "transformer.ln_f.weight")
#: what TensorRT-LLM's PretrainedConfig sets itself or has as properties; any other config.json key it keeps as an
#: attribute (tensorrt_llm/models/modeling_utils.py@01ea6d79, docs/upstream-facts.md §H)
PRETRAINED_CONFIG_NAMES = {
    "architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
    "logits_dtype", "norm_epsilon", "runtime_defaults", "position_embedding_type", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "mapping", "quantization", "use_parallel_embedding",
    "embedding_sharding_dim", "head_size", "qk_layernorm", "rotary_embedding_dim", "kv_dtype", "quant_mode",
    "quant_algo",
}


def cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def sparsify(ckpt: Path, out: Path, data: Path, *extra):
    return cli("sparsify", ckpt, "-o", out, "--dataset", data, "--samples", "6", "--seq-len", "48", "--quiet",
               *extra)


def convert(hf: Path, out: Path, tp: int = 1) -> Path:
    result = cli("convert", hf, "-o", out, "--precision", "fp32", "--tp", tp)
    assert result.exit_code == 0, result.output
    return out


def decoder_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(ckpt / "rank0.safetensors").items()
            if k.startswith("transformer.layers.") and k.endswith(".weight") and v.dim() == 2}


# -- the pattern --------------------------------------------------------------------------------------------------

def test_dense_groups_counts_the_groups_with_more_than_two_nonzeros():
    w = torch.zeros(2, 10)
    w[0, :3] = 1.0               # group 0 of row 0: three nonzeros
    w[1, 4:6] = 1.0              # two: fine
    w[1, 8:10] = 1.0             # the short last group (2 columns): fine
    assert dense_groups(w) == 1
    w[0, 9] = w[0, 8] = 1.0
    assert dense_groups(w) == 1 and dense_groups(torch.ones(3, 8)) == 6


def test_magnitude_keeps_the_two_largest_of_each_group_of_four():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 4.0, 1.0, -1.5, 0.0]])
    assert magnitude_keep(w).tolist() == [[False, True, True, False, True, False, True, False]]
    pruned = prune_magnitude(torch.randn(16, 32))
    assert dense_groups(pruned) == 0 and int((pruned != 0).sum()) == 16 * 16


def test_a_weight_that_breaks_its_claim_is_refused_by_name():
    claim = SparsityClaim("2:4", "sparsegpt", ("transformer.layers.0.mlp.fc",))
    check_claimed("transformer.layers.0.mlp.fc", prune_magnitude(torch.randn(4, 8)), claim, "ck")
    with pytest.raises(UserError, match=r"layers\.0\.mlp\.fc.*6 of its 8 groups"):
        check_claimed("transformer.layers.0.mlp.fc", torch.cat([torch.ones(3, 8), torch.zeros(1, 8)]), claim, "ck")


def test_sparsegpt_loses_less_output_than_magnitude_on_correlated_inputs():
    """The weight update is what SparseGPT adds: on inputs with correlated features its x W^T error is well under
    magnitude pruning's; with the update thrown away (modelopt's mask only) it would not be."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=gen) @ torch.randn(16, 64, generator=gen)    # 64 features, rank 16
    x += 0.05 * torch.randn(2048, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    stats = HessianStats()
    stats.collect(x)
    sparse = prune_sparsegpt(w, gptq_inverse(stats.finish(), 0.01))
    assert dense_groups(sparse) == 0 and int((sparse != 0).sum()) == 32 * 32

    def error(v):
        return float(((x @ (w - v).T) ** 2).mean())

    mask_only = torch.where(sparse != 0, w, torch.zeros(()))
    assert error(sparse) < 0.3 * error(prune_magnitude(w))
    assert error(sparse) < 0.3 * error(mask_only)


# -- trtpipe sparsify ---------------------------------------------------------------------------------------------

def test_sparsify_prunes_every_decoder_linear_and_leaves_the_rest(tiny_sparse_ckpt, tiny_ckpt):
    cfg = CheckpointConfig.read(tiny_sparse_ckpt)
    claim = cfg.sparsity
    assert (claim.pattern, claim.method) == ("2:4", "sparsegpt")
    assert len(claim.modules) == 4 * 5 and "transformer.layers.3.mlp.proj" in claim.modules
    sparse, dense = load_file(tiny_sparse_ckpt / "rank0.safetensors"), load_file(tiny_ckpt / "rank0.safetensors")
    assert sparse.keys() == dense.keys()
    for name, w in decoder_weights(tiny_sparse_ckpt).items():
        assert dense_groups(w) == 0 and int((w != 0).sum()) == w.numel() // 2, name
        assert not torch.equal(w[w != 0], dense[name][w != 0]), f"{name}: the kept weights were not updated"
    for name in OUTER:
        assert torch.equal(sparse[name], dense[name]), name
    assert (tiny_sparse_ckpt / "tokenizer" / "tokenizer.json").is_file()
    manifest = json.loads((tiny_sparse_ckpt / "manifest.json").read_text())
    ppl = manifest["perplexity"]
    assert ppl["sparse"] > ppl["dense"] > 1 and ppl["ratio"] == pytest.approx(ppl["sparse"] / ppl["dense"])


def test_the_claim_is_a_key_tensorrt_llm_keeps(tiny_sparse_ckpt, tiny_ckpt):
    """trtllm-build reads the sparse checkpoint's config.json as the dense one's plus one key it keeps as it is."""
    sparse = json.loads((tiny_sparse_ckpt / "config.json").read_text())
    dense = json.loads((tiny_ckpt / "config.json").read_text())
    assert CONFIG_KEY not in PRETRAINED_CONFIG_NAMES and CONFIG_KEY not in dense
    assert {k: v for k, v in sparse.items() if k != CONFIG_KEY} == dense
    assert set(sparse[CONFIG_KEY]) == {"pattern", "method", "modules"} and sparse[CONFIG_KEY]["pattern"] == "2:4"


def test_magnitude_needs_no_data_and_is_exactly_the_two_largest(tiny_ckpt, tmp_path):
    out = tmp_path / "mag"
    result = cli("sparsify", tiny_ckpt, "-o", out, "--method", "magnitude", "--eval-samples", "0", "--quiet")
    assert result.exit_code == 0, result.output
    assert "2:4 magnitude: 20 decoder linears pruned" in result.output
    dense = load_file(tiny_ckpt / "rank0.safetensors")
    for name, w in decoder_weights(out).items():
        assert torch.equal(w, prune_magnitude(dense[name])), name


def test_a_tp2_checkpoint_sparsifies_to_the_tp1_result_split(tiny_hf, text_file, tiny_sparse_ckpt, tmp_path):
    """Row-parallel linears are pruned over their full width and column-parallel ones whole, so the ranks of a
    tp=2 sparse checkpoint hold exactly the tp=1 one's weights, each rank's share 2:4 on its own."""
    ckpt2 = convert(tiny_hf, tmp_path / "ckpt-tp2", tp=2)
    out = tmp_path / "ckpt-tp2-24"
    result = sparsify(ckpt2, out, text_file, "--eval-samples", "0")
    assert result.exit_code == 0, result.output
    for rank in (0, 1):
        split = load_file(out / f"rank{rank}.safetensors")
        assert all(dense_groups(v) == 0 for k, v in split.items()
                   if k.startswith("transformer.layers.") and v.dim() == 2), rank
    one, two = CheckpointReader(tiny_sparse_ckpt), CheckpointReader(out)
    for i in range(one.num_layers):
        for name, lin in one.layer(i).linears.items():
            torch.testing.assert_close(two.layer(i).linears[name].weight, lin.weight, rtol=1e-4, atol=1e-5,
                                       msg=f"layer {i} {name}")


def test_a_broken_claim_is_refused_where_the_weights_are_read(tiny_sparse_ckpt, text_file, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_sparse_ckpt, broken)
    tensors = load_file(broken / "rank0.safetensors")
    tensors["transformer.layers.2.mlp.gate.weight"][0, :4] = 1.0
    save_file(tensors, broken / "rank0.safetensors", metadata={"format": "pt"})
    result = cli("calibrate", broken, "-o", tmp_path / "q", "--precision", "fp8", "--dataset", text_file,
                 "--samples", "2", "--seq-len", "16", "--eval-samples", "0", "--quiet")
    assert result.exit_code == 2, result.output
    assert "claims 2:4 sparsity" in result.output and "layers.2.mlp.gate" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()
    result = cli("eval", broken, "--dataset", text_file)
    assert result.exit_code == 2 and "claims 2:4 sparsity" in result.output, result.output


@pytest.mark.parametrize("rounding", ["gptq", "nearest"])
def test_calibrate_keeps_every_zero_of_a_sparse_checkpoint(rounding, tiny_sparse_ckpt, text_file, tmp_path):
    out = tmp_path / f"fp8-{rounding}"
    result = cli("calibrate", tiny_sparse_ckpt, "-o", out, "--precision", "fp8", "--weight-rounding", rounding,
                 "--dataset", text_file, "--samples", "4", "--seq-len", "32", "--eval-samples", "0", "--quiet")
    assert result.exit_code == 0, result.output
    assert "2:4" in result.output
    assert CheckpointConfig.read(out).sparsity == CheckpointConfig.read(tiny_sparse_ckpt).sparsity
    source = decoder_weights(tiny_sparse_ckpt)
    reader = CheckpointReader(out)           # dequantizes, and checks the claim on every weight it reads
    for i in range(reader.num_layers):
        for name, lin in reader.layer(i).linears.items():
            zeros = source[f"transformer.layers.{i}.{name}.weight"] == 0
            assert torch.equal(lin.weight == 0, zeros), f"layer {i} {name}"


def narrow_mlp_checkpoint(tmp_path: Path, smollm2_hf_dir: Path) -> Path:
    hf = make_tiny_model(tmp_path / "hf98", vocab_size=49152, intermediate_size=98, max_position_embeddings=128)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_hf_dir / name, hf / name)
    return convert(hf, tmp_path / "ck98")


@pytest.mark.parametrize("case", ["pattern", "already-sparse", "quantized", "too-long", "damp", "width",
                                  "no-checkpoint"])
def test_bad_input_exits_2_and_writes_nothing(case, tiny_ckpt, tiny_sparse_ckpt, text_file, smollm2_hf_dir, tmp_path):
    out = tmp_path / "out"
    source, extra = tiny_ckpt, []
    expect = {"pattern": "--pattern must be 2:4", "already-sparse": "already 2:4 sparse",
              "quantized": "is quantized", "too-long": "longer than the model's context",
              "damp": "--damp must be positive", "width": "not a multiple of 4", "no-checkpoint": "no config.json"}
    if case == "pattern":
        extra = ["--pattern", "4:8"]
    elif case == "already-sparse":
        source = tiny_sparse_ckpt
    elif case == "quantized":
        source = tmp_path / "fp8"
        assert cli("calibrate", tiny_ckpt, "-o", source, "--precision", "fp8", "--dataset", text_file,
                   "--samples", "2", "--seq-len", "16", "--eval-samples", "0", "--quiet").exit_code == 0
    elif case == "too-long":
        extra = ["--seq-len", "4096"]
    elif case == "damp":
        extra = ["--damp", "0"]
    elif case == "width":
        source = narrow_mlp_checkpoint(tmp_path, smollm2_hf_dir)
    elif case == "no-checkpoint":
        source = tmp_path
    result = cli("sparsify", source, "-o", out, "--dataset", text_file, "--samples", "2", *extra)
    assert result.exit_code == 2, result.output
    assert expect[case] in result.output and "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))
