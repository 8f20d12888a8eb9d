"""TensorRT-LLM's checkpoint rules written out independently with plain torch ops (docs/model-families.md
§2.2, §6; docs/upstream-facts.md §A1), for the tests to check convert against: what one rank file must hold."""

from __future__ import annotations

import torch


def repeat_heads(t: torch.Tensor, heads: int, reps: int) -> torch.Tensor:
    """Each of `heads` head blocks (rows) repeated `reps` times in place: TensorRT-LLM's dup_kv_weight/bias."""
    blocks = t.reshape(heads, -1, *t.shape[1:])
    return blocks.repeat_interleave(reps, dim=0).reshape(-1, *t.shape[1:])


def expected_rank(hf: dict, cfg: dict, tp: int, pp: int, rank: int) -> dict[str, torch.Tensor]:
    """The rank file TensorRT-LLM's converter writes for a Llama, Mistral, Qwen2 or Qwen3 HF state dict: q/k/v
    weight (and bias) fused per rank with K/V heads repeated when tp > kv heads, column linears split on
    dim 0, row linears on dim 1 (their biases whole), norms (Qwen3's q/k norms too) on every rank, lm_head
    zero-padded to a multiple of tp and split by rows."""
    tp_rank, pp_rank = rank % tp, rank // tp
    kv = cfg["num_key_value_heads"]
    layers = cfg["num_hidden_layers"] // pp
    out = {}
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = hf["model.embed_tokens.weight"]
    for local in range(layers):
        src, dst = f"model.layers.{pp_rank * layers + local}.", f"transformer.layers.{local}."

        def copy(theirs: str, ours: str, split: int | None = None) -> None:
            for kind in ("weight", "bias"):
                if f"{src}{theirs}.{kind}" in hf:
                    t = hf[f"{src}{theirs}.{kind}"]
                    cut = split if kind == "weight" or split == 0 else None
                    out[f"{dst}{ours}.{kind}"] = t if cut is None else t.chunk(tp, cut)[tp_rank]

        for kind in ("weight", "bias"):
            if src + f"self_attn.q_proj.{kind}" in hf:
                q, k, v = (hf[src + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
                if kv < tp:
                    k, v = repeat_heads(k, kv, tp // kv), repeat_heads(v, kv, tp // kv)
                out[dst + f"attention.qkv.{kind}"] = torch.cat([t.chunk(tp, 0)[tp_rank] for t in (q, k, v)])
        copy("self_attn.o_proj", "attention.dense", 1)
        copy("self_attn.q_norm", "attention.q_layernorm")
        copy("self_attn.k_norm", "attention.k_layernorm")
        copy("mlp.gate_proj", "mlp.fc", 0)
        copy("mlp.up_proj", "mlp.gate", 0)
        copy("mlp.down_proj", "mlp.proj", 1)
        copy("input_layernorm", "input_layernorm")
        copy("post_attention_layernorm", "post_layernorm")
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = hf["model.norm.weight"]
        head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
        padded = -(-head.shape[0] // tp) * tp
        head = torch.cat([head, head.new_zeros(padded - head.shape[0], head.shape[1])])
        out["lm_head.weight"] = head.chunk(tp, 0)[tp_rank]
    return out
