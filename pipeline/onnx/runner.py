"""An exported decoder run with ONNX Runtime (CPU): one step over the KV cache, prefill logits, generation.

`OrtDecoder.forward(input_ids [B, T]) -> logits [B, T, vocab]` (torch, from position 0) is the
`LogitsModel` perplexity expects; `step` feeds new tokens after a cache of any length and returns the
cache to feed next, which is how ONNX Runtime runs the graph in a decode loop. `generate` is the
reference runtime's (`ReferenceModel.generate`, the loop of pipeline/runtime/generate.py): the prompts
are prefilled together, left-padded into one cache (padding masked by `attention_mask`, every row's
`position_ids` its own), then decoded one token per row per step; a finished row leaves the cache.
Only `pipeline.runtime` and this package's names are imported, so the cpu target's Triton model can
copy it (`trtpipe deploy` with the onnxruntime runtime) and needs onnxruntime, not onnx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..runtime.generate import (
    EndCallback, PollCallback, RowResult, StepCallback, TokenCallback, check_requests, generate_rows, serve_rows,
    token_steps,
)
from ..runtime.sampling import SamplingConfig
from ..runtime.scheduler import Scheduler
from . import CONFIG_FILE, LOGITS_TO_KEEP, PROMPT_IDS, PROMPT_LOGITS, prompt_present


@dataclass
class Cache:
    """past_key_values.N.key/value of every layer, [B, kv_heads, P, d] float32, and the attention mask [B, P]."""

    tensors: dict[str, np.ndarray]
    mask: np.ndarray

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def select(self, rows: list[int]) -> Cache:
        return Cache({name: t[rows] for name, t in self.tensors.items()}, self.mask[rows])


class OrtDecoder:
    def __init__(self, directory: Path, threads: int | None = None, spinning: bool = True):
        import onnxruntime as ort

        directory = Path(directory)
        config = json.loads((directory / CONFIG_FILE).read_text())
        model = config["model"]
        decoder = model["decoder"]
        self.vocab_size, self.max_position_embeddings = model["vocab_size"], model["context_length"]
        self.layers, self.kv_heads = decoder["num_hidden_layers"], decoder["num_key_value_heads"]
        self.head_size = decoder["head_size"]
        inputs, outputs = decoder["inputs"], decoder["outputs"]
        #: (past key, present key) and (past value, present value) names of every layer
        self.cache_names = [(inputs[f"past_{kind}_names"] % i, outputs[f"present_{kind}_names"] % i)
                            for i in range(self.layers) for kind in ("key", "value")]
        opts = session_options(ort, config["trtpipe"]["precision"], threads, spinning)
        self.session = ort.InferenceSession(str(directory / decoder["filename"]), opts,
                                            providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        #: (past, present) of the prompt group's cache, in self.cache_names' order
        self.prompt_cache_names = [(past, prompt_present(present)) for past, present in self.cache_names]
        prompt_outputs = {PROMPT_LOGITS, *(present for _, present in self.prompt_cache_names)}
        self.rows_outputs = [name for name in self.outputs if name not in prompt_outputs]
        #: the optional inputs the export has (inputs with a default: ONNX Runtime lists them with the overridable
        #: initializers). Older exports compute every position's logits, and have no prompt group.
        optional = {i.name for i in self.session.get_overridable_initializers()}
        self.keeps_logits = LOGITS_TO_KEEP in optional
        self.mixes_prompts = PROMPT_IDS in optional

    def empty_cache(self, batch: int) -> Cache:
        shape = (batch, self.kv_heads, 0, self.head_size)
        tensors = {past: np.zeros(shape, np.float32) for past, _ in self.cache_names}
        return Cache(tensors, np.zeros((batch, 0), np.int64))

    def step(self, input_ids: np.ndarray, cache: Cache, positions: np.ndarray | None = None,
             mask: np.ndarray | None = None, last_only: bool = False) -> tuple[np.ndarray, Cache]:
        """Logits [B, T, vocab] of T new tokens per sequence after the cache (last_only: [B, 1, vocab] of the last
        one, the lm_head skipped for the others where the export allows), and the grown cache. `positions`
        (default: right after the cache) and `mask` (default: all ones) describe the new tokens."""
        feeds = self._feeds(input_ids, cache, positions, mask)
        if last_only and self.keeps_logits:
            feeds[LOGITS_TO_KEEP] = np.array(1, np.int64)
        results = dict(zip(self.rows_outputs, self.session.run(self.rows_outputs, feeds)))
        logits = results["logits"][:, -1:] if last_only else results["logits"]
        return logits, Cache({past: results[now] for past, now in self.cache_names}, feeds["attention_mask"])

    def step_with_prompt(self, input_ids: np.ndarray, cache: Cache, prompt: Sequence[int],
                         positions: np.ndarray | None = None) -> tuple[np.ndarray, Cache, np.ndarray, Cache]:
        """`step` of the rows (logits [B, T, vocab]) and, in the same run, one more sequence's prompt (the graph's
        prompt group, `mixes_prompts`): its last token's logits [vocab] and its cache."""
        feeds = self._feeds(input_ids, cache, positions)
        feeds[PROMPT_IDS] = np.asarray(prompt, np.int64)
        results = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        prompt_cache = Cache({past: results[now] for past, now in self.prompt_cache_names},
                             np.ones((1, len(prompt)), np.int64))
        return (results["logits"], Cache({past: results[now] for past, now in self.cache_names},
                                         feeds["attention_mask"]), results[PROMPT_LOGITS][0], prompt_cache)

    def _feeds(self, input_ids: np.ndarray, cache: Cache, positions: np.ndarray | None,
               mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
        b, t = input_ids.shape
        if positions is None:
            positions = np.arange(cache.length, cache.length + t, dtype=np.int64)
        mask = np.concatenate([cache.mask, np.ones((b, t), np.int64) if mask is None else mask], axis=1)
        return {"input_ids": input_ids.astype(np.int64), "attention_mask": mask,
                "position_ids": np.ascontiguousarray(np.broadcast_to(positions, (b, t)), np.int64), **cache.tensors}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = np.asarray(torch.as_tensor(input_ids))
        logits, _ = self.step(ids, self.empty_cache(ids.shape[0]))
        return torch.from_numpy(logits)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                 on_token: TokenCallback | None = None, on_end: EndCallback | None = None) -> list[list[int]]:
        """New tokens of every prompt, as `ReferenceModel.generate` makes them."""
        return [result.tokens for result in self.generate_rows(prompts, sampling, token_steps(on_token), on_end)]

    def generate_rows(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                      on_step: StepCallback | None = None, on_end: EndCallback | None = None) -> list[RowResult]:
        """Each request's record, as `ReferenceModel.generate_rows` makes it."""
        configs = check_requests(prompts, sampling, self.vocab_size, self.max_position_embeddings)
        return generate_rows(OrtBatch(self, prompts), configs, on_step, on_end, prompts)

    def serve_rows(self, scheduler: Scheduler, poll: PollCallback, on_step, on_end) -> None:
        """In-flight generation, as `ReferenceModel.serve_rows` does it (pipeline/runtime/generate.py)."""
        serve_rows(OrtBatch(self), scheduler, poll, on_step, on_end)


def session_options(ort, precision: str, threads: int | None, spinning: bool = True):
    """ONNX Runtime's options for an export of `precision`.

    FP8: the CPU provider has no FP8 GEMM, and while it handles Q/DQ graphs it keeps each weight's
    DequantizeLinear in the graph, dequantizing every weight on every step. With Q/DQ handling off
    (`session.disable_quant_qdq`) constant folding dequantizes the weights once at load, to the same float32
    values; the activations' and the KV cache's Q/DQ stay. INT8 keeps Q/DQ handling on: that is what fuses
    each W8A8 linear into an integer GEMM (MatMulIntegerToFloat).

    spinning False: the intra-op threads sleep between parallel regions instead of spinning
    (`session.intra_op.allow_spinning` 0), leaving the cores to the other processes between them.
    """
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if precision == "fp8":
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    return opts


class OrtBatch:
    """OrtDecoder's `InflightDecoder` (pipeline/runtime/generate.py): the running rows in one left-padded cache.
    A prefill puts its rows' prompts into a cache of their own; the next decode joins every such cache to the running
    one in one copy, the shorter ones padded on the left (masked); positions no running row uses any more are cut
    off as rows leave."""

    def __init__(self, decoder: OrtDecoder, prompts: Sequence[Sequence[int]] = ()):
        self.decoder = decoder
        self.prompts: dict[int, Sequence[int]] = dict(enumerate(prompts))
        self.rows: list[int] = []         # the row of each cache row
        self.next: np.ndarray = np.zeros((0, 1), np.int64)  # [rows, 1] the position of each row's next token
        self.cache = decoder.empty_cache(0)
        self.fresh: list[tuple[list[int], Cache, np.ndarray]] = []   # prefilled (rows, cache, next), not yet joined

    def add(self, rows: list[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]) -> None:
        self.prompts.update(zip(rows, prompts))

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.prompts.pop(row, None)

    def prefill(self, rows: list[int]) -> torch.Tensor:
        return torch.from_numpy(self._prefill(rows, last_only=True)[:, -1])

    def prefill_context(self, rows: list[int]) -> list[torch.Tensor]:
        """Each row's logits at every prompt position (left-padded: each row's last len(prompt) positions)."""
        logits = self._prefill(rows)
        return [torch.from_numpy(logits[i, logits.shape[1] - len(self.prompts[r]):].copy()) for i, r in enumerate(rows)]

    def _prefill(self, rows: list[int], last_only: bool = False) -> np.ndarray:
        """The rows' prompts, left-padded, into a cache joined to the running rows': logits [len(rows), longest
        prompt (last_only: 1), vocab]."""
        width = max(len(self.prompts[r]) for r in rows)
        ids, positions, mask = (np.zeros((len(rows), width), np.int64) for _ in range(3))
        for i, r in enumerate(rows):
            n = len(self.prompts[r])
            ids[i, width - n:], positions[i, width - n:], mask[i, width - n:] = self.prompts[r], np.arange(n), 1
        logits, cache = self.decoder.step(ids, self.decoder.empty_cache(len(rows)), positions, mask, last_only)
        self.fresh.append((rows, cache, positions[:, -1:] + 1))
        return logits

    def _join_fresh(self) -> None:
        """The prefilled caches joined to the running one (its rows that left dropped first), in one copy."""
        if not self.fresh:
            return
        self._keep([r for r in self.rows if r in self.prompts])
        parts = ([self.cache] if self.rows else []) + [cache for _, cache, _ in self.fresh]
        self.cache = joined(*parts) if len(parts) > 1 else parts[0]
        self.rows = self.rows + [r for rows, _, _ in self.fresh for r in rows]
        self.next = np.concatenate([self.next] + [nxt for _, _, nxt in self.fresh])
        self.fresh = []

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        self._join_fresh()
        self._keep(rows)
        logits, self.cache = self.decoder.step(np.array(tokens, np.int64)[:, None], self.cache, self.next)
        self.next = self.next + 1
        return torch.from_numpy(logits[:, -1])

    @property
    def mixes_prompts(self) -> bool:
        return self.decoder.mixes_prompts

    def decode_with_prompt(self, rows: list[int], tokens: list[int], row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of the rows, and `row`'s prompt prefilled in the same run: (the rows' logits, the row's last
        prompt token's logits). The row's cache joins the running one at the next decode."""
        self._join_fresh()
        self._keep(rows)
        prompt = self.prompts[row]
        logits, self.cache, prompt_logits, prompt_cache = self.decoder.step_with_prompt(
            np.array(tokens, np.int64)[:, None], self.cache, prompt, self.next)
        self.next = self.next + 1
        self.fresh.append(([row], prompt_cache, np.array([[len(prompt)]], np.int64)))
        return torch.from_numpy(logits[:, -1]), torch.from_numpy(prompt_logits)

    def _keep(self, rows: list[int]) -> None:
        """The cache of `rows` only, in that order, without the leading positions none of them uses."""
        if rows != self.rows:
            index = {r: i for i, r in enumerate(self.rows)}
            keep = [index[r] for r in rows]
            self.rows, self.next, self.cache = rows, self.next[keep], self.cache.select(keep)
        used = self.cache.mask.any(axis=0)
        if self.cache.length and not used[0]:
            first = int(np.argmax(used)) if used.any() else self.cache.length
            self.cache = Cache({name: t[:, :, first:] for name, t in self.cache.tensors.items()},
                               self.cache.mask[:, first:])


def joined(*caches: Cache) -> Cache:
    """The rows of each cache in turn, the shorter ones padded on the left (masked out) to the longest's length."""
    length = max(c.length for c in caches)

    def pad(cache: Cache) -> Cache:
        extra = length - cache.length
        if not extra:
            return cache
        return Cache({name: np.pad(t, ((0, 0), (0, 0), (extra, 0), (0, 0))) for name, t in cache.tensors.items()},
                     np.pad(cache.mask, ((0, 0), (extra, 0))))

    padded = [pad(c) for c in caches]
    return Cache({name: np.concatenate([c.tensors[name] for c in padded]) for name in padded[0].tensors},
                 np.concatenate([c.mask for c in padded]))
