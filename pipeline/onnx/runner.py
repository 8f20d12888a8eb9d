"""An exported decoder run with ONNX Runtime (CPU): one step over the KV cache, prefill logits, generation.

`OrtDecoder.forward(input_ids [B, T]) -> logits [B, T, vocab]` (torch, from position 0) is the
`LogitsModel` perplexity expects; `step` feeds new tokens after a cache of any length and returns the
cache to feed next, which is how ONNX Runtime runs the graph in a decode loop. `generate` is the
reference runtime's (`ReferenceModel.generate`, the loop of pipeline/runtime/generate.py): the prompts
are prefilled together, left-padded into one cache (padding masked by `attention_mask`, every row's
`position_ids` its own), then decoded one token per row per step; a finished row's cache row is freed for the
next prompt (`OrtBatch`).
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

from ..errors import UserError
from ..host import int8_gemm_saturates
from ..runtime.generate import (
    EndCallback, PollCallback, RowResult, StepCallback, TokenCallback, check_requests, fed_context, generate_rows,
    serve_rows, token_steps,
)
from ..runtime.sampling import SamplingConfig
from ..runtime.scheduler import Scheduler
from ..runtime.speculative import Speculation
from . import CONFIG_FILE, LOGITS_TO_KEEP, PROMPT_IDS, PROMPT_LOGITS, prompt_present
from .inplace import IN_PLACE_DEFAULTS, InPlaceBatch


@dataclass
class Cache:
    """past_key_values.N.key/value of every layer, [B, kv_heads, P, d] float32, and the attention mask [B, P]."""

    tensors: dict[str, np.ndarray]
    mask: np.ndarray

    @property
    def length(self) -> int:
        return self.mask.shape[1]


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
        self.session = open_session(ort, directory / decoder["filename"], opts)
        self.outputs = [o.name for o in self.session.get_outputs()]
        #: (past, present) of the prompt group's cache, in self.cache_names' order
        self.prompt_cache_names = [(past, prompt_present(present)) for past, present in self.cache_names]
        prompt_outputs = {PROMPT_LOGITS, *(present for _, present in self.prompt_cache_names)}
        self.rows_outputs = [name for name in self.outputs if name not in prompt_outputs]
        #: the rows' cache is one buffer GroupQueryAttention writes in place (`InPlaceBatch`), not past + new; such
        #: an export requires logits_to_keep and prompt_ids (their defaults: `IN_PLACE_DEFAULTS`)
        self.in_place = config["trtpipe"].get("kv_cache") == "in-place"
        #: the optional inputs the export has (inputs with a default: ONNX Runtime lists them with the overridable
        #: initializers; an in-place export's are plain inputs). Older exports compute every position's logits, and
        #: have no prompt group.
        optional = {i.name for i in (self.session.get_inputs() if self.in_place
                                     else self.session.get_overridable_initializers())}
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
        (default: right after the cache) and `mask` (default: all ones) describe the new tokens. An in-place export
        takes caches without padding here (its rows are right-padded: `InPlaceBatch` is how it serves)."""
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
                "position_ids": np.ascontiguousarray(np.broadcast_to(positions, (b, t)), np.int64), **cache.tensors,
                **(IN_PLACE_DEFAULTS if self.in_place else {})}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = np.asarray(torch.as_tensor(input_ids))
        logits, _ = self.step(ids, self.empty_cache(ids.shape[0]))
        return torch.from_numpy(logits)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                 on_token: TokenCallback | None = None, on_end: EndCallback | None = None,
                 speculation: Speculation | None = None) -> list[list[int]]:
        """New tokens of every prompt, as `ReferenceModel.generate` makes them."""
        return [result.tokens for result in self.generate_rows(prompts, sampling, token_steps(on_token), on_end,
                                                                    speculation)]

    def generate_rows(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | Sequence[SamplingConfig],
                      on_step: StepCallback | None = None, on_end: EndCallback | None = None,
                      speculation: Speculation | None = None) -> list[RowResult]:
        """Each request's record, as `ReferenceModel.generate_rows` makes it."""
        configs = check_requests(prompts, sampling, self.vocab_size, self.max_position_embeddings)
        batch = InPlaceBatch if self.in_place else OrtBatch
        return generate_rows(batch(self, [fed_context(p, c) for p, c in zip(prompts, configs)]), configs, on_step,
                             on_end, prompts, speculation)

    def serve_rows(self, scheduler: Scheduler, poll: PollCallback, on_step, on_end,
                   speculation: Speculation | None = None) -> None:
        """In-flight generation, as `ReferenceModel.serve_rows` does it (pipeline/runtime/generate.py)."""
        serve_rows(self.inflight_decoder(), scheduler, poll, on_step, on_end, speculation)

    def inflight_decoder(self) -> "OrtBatch | InPlaceBatch":
        """An empty batch whose rows come and go (what serve_rows runs, and what a draft model drafts with)."""
        return InPlaceBatch(self) if self.in_place else OrtBatch(self)


def open_session(ort, path: Path, options):
    """The CPU session of an export; an ONNX Runtime without the 4-bit kernel an int4-awq export needs is one line."""
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:     # onnxruntime raises its own NotImplemented / Fail classes, by version
        if "MatMulNBits" not in str(exc):
            raise
        raise UserError(f"{path}: this ONNX Runtime ({ort.__version__}) has no MatMulNBits kernel, the com.microsoft "
                        "4-bit MatMul every int4-awq linear of this export is; install an onnxruntime with it "
                        "(1.32.0 has it) or serve the checkpoint with the torch runtime (--runtime torch)") from None


def session_options(ort, precision: str, threads: int | None, spinning: bool = True):
    """ONNX Runtime's options for an export of `precision`.

    FP8: the CPU provider has no FP8 GEMM, and while it handles Q/DQ graphs it keeps each weight's
    DequantizeLinear in the graph, dequantizing every weight on every step. With Q/DQ handling off
    (`session.disable_quant_qdq`) constant folding dequantizes the weights once at load, to the same float32
    values; the activations' and the KV cache's Q/DQ stay. INT8 keeps Q/DQ handling on: that is what fuses
    each W8A8 linear into an integer GEMM (MatMulIntegerToFloat).

    INT8 on an x86 processor whose integer GEMM saturates (`host.int8_gemm_saturates`: no VNNI) is handled like
    FP8: the weights dequantized once, the activations' Q/DQ kept, so the logits are the checkpoint's, at float32
    GEMM speed.

    spinning False: the intra-op threads sleep between parallel regions instead of spinning
    (`session.intra_op.allow_spinning` 0), leaving the cores to the other processes between them.
    """
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if precision == "fp8" or (precision == "int8-sq" and int8_gemm_saturates()):
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    return opts


#: decode steps a cache row whose request left is kept free for the next prompt before the cache is rebuilt
#: without it. Computing a free row costs about 1-1.5 ms a step (SmolLM2 fp32 at batch 8 on 2 cores); a rebuild
#: copies the whole cache once (about 4 ms at 8 rows of 87 tokens) and a prompt written into a free row saves one;
#: under steady load the next prompt comes within a step or two
FREE_ROW_STEPS = 4
#: leading cache positions no running row uses that are kept rather than cut: cutting copies the whole cache, an
#: unused position costs each step about its share of attention
UNUSED_POSITIONS = 16


class OrtBatch:
    """OrtDecoder's `InflightDecoder` (pipeline/runtime/generate.py): the running rows in one left-padded cache, one
    cache row per request. A prefill puts its rows' prompts into a cache of their own; the next decode writes each
    into a free cache row (one a request that left freed), in place, when its prompt fits the cache's length.
    Otherwise, and when a row stayed free FREE_ROW_STEPS steps or UNUSED_POSITIONS leading positions are no running
    row's, the cache is rebuilt in one copy: the running rows and the prompts, right-aligned, padded on the left
    (masked). A free row is computed with the others, its mask empty, its token and position 0."""

    def __init__(self, decoder: OrtDecoder, prompts: Sequence[Sequence[int]] = ()):
        self.decoder = decoder
        self.prompts: dict[int, Sequence[int]] = dict(enumerate(prompts))
        self.slots: list[int | None] = []   # the row in each cache row; None: free
        self.idle: list[int] = []           # the steps each cache row has been free
        self.next: np.ndarray = np.zeros((0, 1), np.int64)  # [cache rows, 1] the position of each row's next token
        self.cache = decoder.empty_cache(0)
        self.fresh: list[tuple[list[int], Cache, np.ndarray]] = []   # prefilled (rows, cache, next), not yet placed

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
        """The rows' prompts, left-padded, into a cache of their own that the next decode places: logits
        [len(rows), longest prompt (last_only: 1), vocab]."""
        width = max(len(self.prompts[r]) for r in rows)
        ids, positions, mask = (np.zeros((len(rows), width), np.int64) for _ in range(3))
        for i, r in enumerate(rows):
            n = len(self.prompts[r])
            ids[i, width - n:], positions[i, width - n:], mask[i, width - n:] = self.prompts[r], np.arange(n), 1
        logits, cache = self.decoder.step(ids, self.decoder.empty_cache(len(rows)), positions, mask, last_only)
        self.fresh.append((rows, cache, positions[:, -1:] + 1))
        return logits

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        slots = self._place(rows)
        ids, positions = self._inputs(slots, tokens)
        logits, self.cache = self.decoder.step(ids, self.cache, positions)
        self.next = positions + 1
        return torch.from_numpy(logits[slots, -1])

    @property
    def mixes_prompts(self) -> bool:
        return self.decoder.mixes_prompts

    def decode_with_prompt(self, rows: list[int], tokens: list[int], row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of the rows, and `row`'s prompt prefilled in the same run: (the rows' logits, the row's last
        prompt token's logits). The row's cache is placed by the next decode."""
        slots = self._place(rows)
        ids, positions = self._inputs(slots, tokens)
        prompt = self.prompts[row]
        logits, self.cache, prompt_logits, prompt_cache = self.decoder.step_with_prompt(ids, self.cache, prompt,
                                                                                        positions)
        self.next = positions + 1
        self.fresh.append(([row], prompt_cache, np.array([[len(prompt)]], np.int64)))
        return torch.from_numpy(logits[slots, -1]), torch.from_numpy(prompt_logits)

    def verify(self, rows: list[int], tokens: list[list[int]]) -> list[torch.Tensor]:
        """Each row's tokens after its cache in one run (shorter rows, and free ones, padded on the right and masked):
        float32 [len(tokens[i]), vocab] per row."""
        slots = self._place(rows)
        width = max(map(len, tokens))
        ids, positions, mask = (np.zeros((len(self.slots), width), np.int64) for _ in range(3))
        for slot, fed in zip(slots, tokens):
            n = len(fed)
            ids[slot, :n], positions[slot, :n], mask[slot, :n] = fed, self.next[slot, 0] + np.arange(n), 1
        logits, self.cache = self.decoder.step(ids, self.cache, positions, mask)
        for slot, fed in zip(slots, tokens):
            self.next[slot, 0] += len(fed)
        return [torch.from_numpy(logits[slot, :len(fed)].copy()) for slot, fed in zip(slots, tokens)]

    def rewind(self, row: int, count: int) -> None:
        """Mask the last `count` positions the row uses: the holes stay until a rebuild drops them (`_unused` counts
        them), since cutting the cache would hand ONNX Runtime a strided view, which it copies whole every step."""
        for rows, cache, nxt in self.fresh:     # prefilled with drafts it brought, not placed yet
            if row in rows:
                i = rows.index(row)
                forget_last(cache.mask[i], count)
                nxt[i, 0] -= count
                return
        slot = self.slots.index(row)
        forget_last(self.cache.mask[slot], count)
        self.next[slot, 0] -= count

    def _inputs(self, slots: list[int], tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """input_ids and position_ids [cache rows, 1]: each row's token at its next position, 0 in free rows."""
        ids, positions = np.zeros((len(self.slots), 1), np.int64), np.zeros((len(self.slots), 1), np.int64)
        ids[slots, 0], positions[slots] = tokens, self.next[slots]
        return ids, positions

    def _place(self, rows: list[int]) -> list[int]:
        """The cache made to hold `rows` (the prefilled ones placed; those that left freed): each one's cache row."""
        wanted = set(rows)
        for slot, r in enumerate(self.slots):
            if r is not None and r not in wanted:
                self.slots[slot], self.idle[slot] = None, 0
                self.cache.mask[slot] = 0
        fresh = [(r, cache, i, nxt[i, 0]) for fresh_rows, cache, nxt in self.fresh
                 for i, r in enumerate(fresh_rows) if r in wanted]
        self.fresh = []
        free = [slot for slot, r in enumerate(self.slots) if r is None]
        if len(fresh) <= len(free) and all(used(c, i) <= self.cache.length for _, c, i, _ in fresh):
            for (r, cache, i, nxt), slot in zip(fresh, free):
                self._write(slot, r, cache, i, nxt)
            self.idle = [0 if r is not None else n + 1 for r, n in zip(self.slots, self.idle)]
            if max(self.idle, default=0) > FREE_ROW_STEPS or self._unused() >= UNUSED_POSITIONS:
                self._rebuild([])
        else:
            self._rebuild(fresh)
        slot_of = {r: slot for slot, r in enumerate(self.slots)}
        return [slot_of[r] for r in rows]

    def _write(self, slot: int, row: int, cache: Cache, i: int, nxt: int) -> None:
        """Row i of `cache` into free cache row `slot`, right-aligned."""
        kept, length = np.flatnonzero(cache.mask[i]), self.cache.length
        n = len(kept)
        for name, t in self.cache.tensors.items():
            t[slot, :, length - n:] = cache.tensors[name][i][:, kept]
        self.cache.mask[slot, :length - n], self.cache.mask[slot, length - n:] = 0, 1
        self.slots[slot], self.idle[slot], self.next[slot] = row, 0, nxt

    def _unused(self) -> int:
        """Cache positions a rebuild drops: the leading ones no running row uses, and the holes rejected drafts
        left (rows are right-aligned, so without holes the row that uses most starts first)."""
        live = [slot for slot, r in enumerate(self.slots) if r is not None]
        return self.cache.length - max((used(self.cache, slot) for slot in live), default=0)

    def _rebuild(self, fresh: list[tuple[int, Cache, int, int]]) -> None:
        """A new cache of the running rows then the prefilled ones, each right-aligned, no free row and no
        unused leading position, in one copy."""
        parts = [(r, self.cache, slot, self.next[slot, 0]) for slot, r in enumerate(self.slots) if r is not None]
        parts += fresh
        lengths = [used(cache, i) for _, cache, i, _ in parts]
        length = max(lengths, default=0)
        names = list(self.cache.tensors)
        shape = (len(parts), self.decoder.kv_heads, length, self.decoder.head_size)
        tensors = {name: np.zeros(shape, np.float32) for name in names}
        mask = np.zeros((len(parts), length), np.int64)
        for b, ((_, cache, i, _), n) in enumerate(zip(parts, lengths)):
            kept = np.flatnonzero(cache.mask[i])
            for name in names:
                tensors[name][b, :, length - n:] = cache.tensors[name][i][:, kept]
            mask[b, length - n:] = 1
        self.cache = Cache(tensors, mask)
        self.slots = [r for r, _, _, _ in parts]
        self.idle = [0] * len(parts)
        self.next = np.array([[nxt] for _, _, _, nxt in parts], np.int64).reshape(len(parts), 1)


def forget_last(mask: np.ndarray, count: int) -> None:
    """Mask the last `count` positions a cache row uses."""
    kept = np.flatnonzero(mask)
    mask[kept[len(kept) - count:]] = 0


def used(cache: Cache, i: int) -> int:
    """The positions row i of a cache uses (padded on the left; with holes where drafts were rejected)."""
    return int(cache.mask[i].sum())
