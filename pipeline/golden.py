"""The golden reference: the Hugging Face model run by transformers' own layers, one layer in memory at a time.

validate compares what the server generates with this reference. Loading the whole model in float32
(as `AutoModelForCausalLM.from_pretrained` does) needs 32 GB for an 8B model, so the model is built on
the meta device and each decoder layer gets its weights read from the safetensors files (rounded to the
served checkpoint's dtype, computed in float32 like the reference runtime), runs every sequence, and
goes back to meta. The embedding and lm_head are read in vocabulary chunks.

Greedy completion needs the logits after each new token: every step is one sweep over the layers
with all prompts (no KV cache is kept between sweeps), so `max_tokens` sweeps in all. Attention is
transformers' SDPA path with causal masking of one unpadded sequence at a time.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import UserError
from .runtime.stream import embed_in_chunks, running_argmax, vocab_ranges
from .safetensors_stream import LazyWeights


class StreamedTransformers:
    """Greedy next-token choices of a Hugging Face causal LM, computed layer by layer."""

    def __init__(self, hf_dir: Path, weights_dtype: str = "float32", device: torch.device | str = "cpu"):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.name = f"transformers ({Path(hf_dir).name})"
        self.device = torch.device(device)
        self.dtype = getattr(torch, weights_dtype)
        config = AutoConfig.from_pretrained(hf_dir)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.rotary = type(self.model.model.rotary_emb)(config=config, device=self.device)
        self.weights = LazyWeights(hf_dir)
        self.vocab = config.vocab_size
        head = "lm_head.weight"
        self.head_name = head if head in self.weights.names() else "model.embed_tokens.weight"

    def _rows(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A tensor (or a range of its rows) rounded to the served dtype, in float32 on the device."""
        return self.weights.read(name, rows).to(self.dtype).float().to(self.device)

    def _materialize(self, module: torch.nn.Module, prefix: str) -> None:
        module.to_empty(device=self.device)
        module.load_state_dict({key: self._rows(prefix + key) for key in module.state_dict()})

    @torch.inference_mode()
    def next_tokens(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """The greedy choice after every position of each sequence: int64 [T] per sequence."""
        hidden_size = self.model.config.hidden_size
        hidden = embed_in_chunks(sequences, self.vocab, hidden_size,
                                 lambda rows: self._rows("model.embed_tokens.weight", rows), self.device)
        positions = [torch.arange(len(s), device=self.device)[None] for s in sequences]
        embeddings = [self.rotary(h, p) for h, p in zip(hidden, positions)]
        for i, layer in enumerate(self.model.model.layers):
            self._materialize(layer, f"model.layers.{i}.")
            hidden = [layer(h, attention_mask=None, position_ids=p, position_embeddings=e)
                      for h, p, e in zip(hidden, positions, embeddings)]
            hidden = [h[0] if isinstance(h, tuple) else h for h in hidden]
            layer.to("meta")
        norm = self.model.model.norm
        self._materialize(norm, "model.norm.")
        normed = [norm(h)[0] for h in hidden]
        norm.to("meta")
        best = [torch.full((h.shape[0],), float("-inf"), device=self.device) for h in normed]
        best_id = [torch.zeros(h.shape[0], dtype=torch.long, device=self.device) for h in normed]
        for start, stop in vocab_ranges(self.vocab, hidden_size):
            head = self._rows(self.head_name, (start, stop))
            for j, x in enumerate(normed):
                best[j], best_id[j] = running_argmax(best[j], best_id[j], F.linear(x, head), start)
        return [b.cpu() for b in best_id]


class GoldenReference:
    """What the golden check compares the server with: greedy completions, and per-token agreement."""

    def __init__(self, hf_dir: Path, exact: bool = True, weights_dtype: str = "float32",
                 device: torch.device | str = "cpu"):
        from transformers import AutoTokenizer

        self.model = StreamedTransformers(hf_dir, weights_dtype, device)
        self.name = self.model.name
        self.exact = exact
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        eos = self.tokenizer.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()

    @classmethod
    def from_spec(cls, spec: str, exact: bool = True, weights_dtype: str = "float32",
                  device: str = "auto") -> GoldenReference:
        from .runtime import resolve_device
        from .sources import resolve_model

        return cls(resolve_model(spec).hf_dir(), exact=exact, weights_dtype=weights_dtype,
                   device=resolve_device(device))

    def complete_all(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Greedy completions of every prompt (stopping at EOS), one sweep over the layers per new token."""
        prompt_ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        if any(not ids for ids in prompt_ids):
            raise UserError("a golden prompt tokenizes to nothing")
        new: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_tokens):
            if not active:
                break
            choices = self.model.next_tokens([prompt_ids[r] + new[r] for r in active])
            still = []
            for r, choice in zip(active, choices):
                token = int(choice[-1])
                if token in self.stop_ids:
                    continue
                new[r].append(token)
                still.append(r)
            active = still
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def agreement(self, prompt: str, completion: str) -> tuple[int, int]:
        """(tokens of `completion` that are the reference's greedy choice given the same prefix, tokens)."""
        prompt_ids, tokens = self.tokenizer(prompt)["input_ids"], self.tokenize(completion)
        if not tokens:
            return 0, 0
        choices = self.model.next_tokens([prompt_ids + tokens])[0][len(prompt_ids) - 1:-1]
        return int((choices == torch.tensor(tokens)).sum()), len(tokens)
