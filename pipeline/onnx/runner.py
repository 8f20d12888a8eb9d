"""An exported decoder run with ONNX Runtime (CPU): one step over the KV cache, prefill logits, greedy generation.

`OrtDecoder.forward(input_ids [B, T]) -> logits [B, T, vocab]` (torch, from position 0) is the
`LogitsModel` perplexity expects; `step` feeds new tokens after a cache of any length and returns the
cache to feed next, which is how ONNX Runtime runs the graph in a decode loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .export import CONFIG_FILE, MODEL_FILE
from .graph import past_names, present_names


@dataclass
class Cache:
    """past_key_values.N.key/value of every layer, [B, kv_heads, P, d] float32, and the attention mask [B, P]."""

    tensors: dict[str, np.ndarray]
    mask: np.ndarray

    @property
    def length(self) -> int:
        return self.mask.shape[1]


class OrtDecoder:
    def __init__(self, directory: Path, threads: int | None = None):
        import onnxruntime as ort

        directory = Path(directory)
        decoder = json.loads((directory / CONFIG_FILE).read_text())["model"]["decoder"]
        self.layers, self.kv_heads = decoder["num_hidden_layers"], decoder["num_key_value_heads"]
        self.head_size = decoder["head_size"]
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(directory / MODEL_FILE), opts, providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]

    def empty_cache(self, batch: int) -> Cache:
        shape = (batch, self.kv_heads, 0, self.head_size)
        tensors = {n: np.zeros(shape, np.float32) for i in range(self.layers) for n in past_names(i)}
        return Cache(tensors, np.zeros((batch, 0), np.int64))

    def step(self, input_ids: np.ndarray, cache: Cache) -> tuple[np.ndarray, Cache]:
        """Logits [B, T, vocab] of T new tokens per sequence after the cache, and the grown cache."""
        b, t = input_ids.shape
        mask = np.concatenate([cache.mask, np.ones((b, t), np.int64)], axis=1)
        positions = np.broadcast_to(np.arange(cache.length, cache.length + t, dtype=np.int64), (b, t))
        feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": mask,
                 "position_ids": np.ascontiguousarray(positions), **cache.tensors}
        results = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        present = {past: results[now] for i in range(self.layers)
                   for past, now in zip(past_names(i), present_names(i))}
        return results["logits"], Cache(present, mask)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = np.asarray(torch.as_tensor(input_ids))
        logits, _ = self.step(ids, self.empty_cache(ids.shape[0]))
        return torch.from_numpy(logits)

    def generate_greedy(self, prompt: list[int], max_new_tokens: int, end_id: int | None = None) -> list[int]:
        logits, cache = self.step(np.array([prompt]), self.empty_cache(1))
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(np.argmax(logits[0, -1]))
            if token == end_id:
                break
            out.append(token)
            if len(out) < max_new_tokens:
                logits, cache = self.step(np.array([[token]]), cache)
        return out
