"""The in-flight batch of an export whose KV cache is written in place (`export-onnx --in-place-kv`).

Such an export's attention is ONNX Runtime's GroupQueryAttention (pipeline/onnx/graph.py `attend_in_place`): past
and present of a layer are one buffer [rows, kv_heads, positions, head_size] the session is bound to through an
IOBinding, each row's tokens first (right-padded), its length told by `attention_mask` (ones over the row's tokens
after the step). A step writes each row's new keys and values at the row's length and attends over the row's own
length, so no step copies the cache, a rejected draft is forgotten by shortening the row's length and a row that
leaves is replaced by the last one (one row's copy).

ONNX Runtime's kernel computes several new tokens after a cache only for one row at a time ("batch_size must be 1
when sequence_length > 1 and past context is given", contrib_ops/cpu/bert/group_query_attention_helper.h): a prompt
and a row's drafts are computed alone, on that row's part of the buffers (a contiguous view), and a step of several
rows feeds one token a row. `InPlaceBatch.verify_rows` tells the speculation so.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..runtime.sampling import SamplingConfig
from . import LOGITS_TO_KEEP, PROMPT_IDS, PROMPT_LOGITS

#: the fewest positions a cache buffer is made with; it doubles when a row needs more
MIN_POSITIONS = 256
#: what an in-place export's inputs without a default are fed when unused: every position's logits, no prompt group
IN_PLACE_DEFAULTS = {LOGITS_TO_KEEP: np.array(0, np.int64), PROMPT_IDS: np.zeros(0, np.int64)}


class InPlaceBatch:
    """OrtDecoder's `InflightDecoder` for an in-place export: rows in the first cache rows of the buffers, in no
    order (`slots`), each with its length."""

    #: a step that feeds drafts feeds one row (the module docstring): what the speculation may ask of it
    verify_rows = 1

    def __init__(self, decoder, prompts: Sequence[Sequence[int]] = ()):
        """`decoder`: the export's `OrtDecoder` (pipeline/onnx/runner.py, which imports this module)."""
        self.decoder = decoder
        self.prompts: dict[int, Sequence[int]] = dict(enumerate(prompts))
        self.slots: list[int] = []              # the row in each used cache row
        self.lengths = np.zeros(0, np.int64)    # the tokens each cache row holds
        self.buffers: dict[str, np.ndarray] = {}
        self.bindings: dict[tuple[int, int, bool], object]   # (first row, rows, mixed) -> IOBinding
        self._allocate(0, 0)        # sets both

    # ---------------------------------------------------------------------------------- the decoder protocol

    def add(self, rows: list[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]) -> None:
        self.prompts.update(zip(rows, prompts))

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.prompts.pop(row, None)
            if row in self.slots:
                self._free(self.slots.index(row))

    @property
    def mixes_prompts(self) -> bool:
        return self.decoder.mixes_prompts

    def prefill(self, rows: list[int]) -> torch.Tensor:
        return torch.stack([torch.from_numpy(self._prefill(row, last_only=True)[-1]) for row in rows])

    def prefill_context(self, rows: list[int]) -> list[torch.Tensor]:
        """Each row's logits at every prompt position."""
        return [torch.from_numpy(self._prefill(row)) for row in rows]

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        order = self._keep(rows)
        logits = self._run(0, len(self.slots), self._tokens(rows, tokens))[0]
        return torch.from_numpy(logits[order, -1])

    def decode_with_prompt(self, rows: list[int], tokens: list[int], row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of the rows, and `row`'s prompt computed in the same run (the graph's prompt group), its keys and
        values then written into a cache row of its own."""
        order = self._keep(rows)
        prompt = self.prompts[row]
        logits, prompt_logits, prompt_cache = self._run(0, len(self.slots), self._tokens(rows, tokens), prompt)
        slot = self._place(row, len(prompt))
        for name, buffer in self.buffers.items():
            buffer[slot, :, :len(prompt)] = prompt_cache[name][0]
        return torch.from_numpy(logits[order, -1]), torch.from_numpy(prompt_logits[0])

    def verify(self, rows: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Each row's tokens after its cache, a run a row (the module docstring): float32 [len(tokens[i]), vocab]."""
        self._keep(rows)
        out = []
        for row, fed in zip(rows, tokens):
            slot = self.slots.index(row)
            ids = np.asarray([fed], np.int64)
            out.append(torch.from_numpy(self._run(slot, 1, ids)[0][0].copy()))
        return out

    def rewind(self, row: int, count: int) -> None:
        """Forget the row's last `count` tokens: the next step writes over them."""
        self.lengths[self.slots.index(row)] -= count

    # ---------------------------------------------------------------------------------- the cache rows

    def _prefill(self, row: int, last_only: bool = False) -> np.ndarray:
        """The row's prompt into a cache row of its own: its logits [prompt length (last_only: 1), vocab]."""
        prompt = self.prompts[row]
        slot = self._place(row, 0)
        return self._run(slot, 1, np.asarray([prompt], np.int64), last_only=last_only)[0][0]

    def _place(self, row: int, length: int) -> int:
        """A new cache row for `row` holding `length` tokens (the buffers grown when full)."""
        if len(self.slots) == self.buffers_rows or length > self.positions:
            self._allocate(max(len(self.slots) + 1, self.buffers_rows), fitting(max(length, self.positions)))
        self.slots.append(row)
        self.lengths = np.append(self.lengths, length)
        return len(self.slots) - 1

    def _keep(self, rows: list[int]) -> list[int]:
        """Free the cache rows of rows not in `rows` (a batch generation drops a row that ended by leaving it out):
        each row's cache row."""
        wanted = set(rows)
        for slot in reversed(range(len(self.slots))):
            if self.slots[slot] not in wanted:
                self._free(slot)
        slot_of = {r: slot for slot, r in enumerate(self.slots)}
        return [slot_of[r] for r in rows]

    def _free(self, slot: int) -> None:
        """Drop a cache row: the last one takes its place (its tokens copied), so the used rows stay first."""
        last = len(self.slots) - 1
        if slot != last:
            n = self.lengths[last]
            for buffer in self.buffers.values():
                buffer[slot, :, :n] = buffer[last, :, :n]
            self.slots[slot], self.lengths[slot] = self.slots[last], n
        self.slots.pop()
        self.lengths = self.lengths[:last]

    def _tokens(self, rows: list[int], tokens: list[int]) -> np.ndarray:
        ids = np.zeros((len(self.slots), 1), np.int64)
        ids[[self.slots.index(r) for r in rows], 0] = tokens
        return ids

    @property
    def buffers_rows(self) -> int:
        return next(iter(self.buffers.values())).shape[0]

    @property
    def positions(self) -> int:
        return next(iter(self.buffers.values())).shape[2]

    def _allocate(self, rows: int, positions: int) -> None:
        """Buffers of `rows` cache rows and `positions` positions, the used rows' tokens copied over."""
        d = self.decoder
        old, used = self.buffers, len(self.slots)
        self.buffers = {past: np.zeros((rows, d.kv_heads, positions, d.head_size), np.float32)
                        for past, _ in d.cache_names}
        for name, buffer in old.items():
            n = min(buffer.shape[2], positions)
            self.buffers[name][:used, :, :n] = buffer[:used, :, :n]
        self.bindings = {}

    # ---------------------------------------------------------------------------------- one run

    def _run(self, first: int, rows: int, ids: np.ndarray, prompt: Sequence[int] | None = None,
             last_only: bool = False) -> tuple:
        """Feed ids [rows, T] to cache rows [first, first + rows) after their tokens, growing their lengths by T:
        (logits [rows, T (last_only: 1), vocab], and with a prompt its last token's logits [1, vocab] and its
        cache {past name: [1, kv_heads, prompt length, head_size]})."""
        t = ids.shape[1]
        lengths = self.lengths[first:first + rows] + t
        total = int(lengths.max())
        if total > self.positions:
            self._allocate(self.buffers_rows, fitting(total))
        binding = self._binding(first, rows, prompt is not None)
        positions = self.lengths[first:first + rows, None] + np.arange(t)
        mask = (np.arange(total) < lengths[:, None]).astype(np.int64)
        feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                 LOGITS_TO_KEEP: np.array(1 if last_only else 0, np.int64),
                 PROMPT_IDS: np.asarray(prompt or (), np.int64)}
        for name, value in feeds.items():      # bound without a copy: `feeds` keeps them alive through the run
            binding.bind_cpu_input(name, value)
        for name in self._outputs(prompt is not None):     # unallocated: their shapes change from run to run
            binding.bind_output(name)
        self.decoder.session.run_with_iobinding(binding)
        self.lengths[first:first + rows] = lengths
        outputs = dict(zip(self._outputs(prompt is not None), binding.get_outputs()))
        logits = outputs["logits"].numpy()
        if prompt is None:
            return (logits,)
        cache = {past: outputs[present].numpy() for past, present in self.decoder.prompt_cache_names}
        return logits, outputs[PROMPT_LOGITS].numpy(), cache

    def _outputs(self, mixed: bool) -> list[str]:
        """The outputs a run binds to memory ONNX Runtime allocates (the cache's are the buffers)."""
        return ["logits", *((PROMPT_LOGITS, *(present for _, present in self.decoder.prompt_cache_names))
                            if mixed else ())]

    def _binding(self, first: int, rows: int, mixed: bool):
        """The IOBinding of cache rows [first, first + rows): each layer's past and present bound to the same view
        of its buffer, which GroupQueryAttention then writes in place."""
        key = (first, rows, mixed)
        if key not in self.bindings:
            import onnxruntime as ort

            binding = self.decoder.session.io_binding()
            for name in self._outputs(mixed):   # first: get_outputs() lists the outputs in the order first bound
                binding.bind_output(name)
            for past, present in self.decoder.cache_names:
                view = ort.OrtValue.ortvalue_from_numpy(self.buffers[past][first:first + rows])
                binding.bind_ortvalue_input(past, view)
                binding.bind_ortvalue_output(present, view)
            self.bindings[key] = binding
        return self.bindings[key]


def fitting(positions: int) -> int:
    """The buffer positions made for `positions`: a power of two, at least MIN_POSITIONS."""
    return max(MIN_POSITIONS, 1 << max(positions - 1, 0).bit_length())
