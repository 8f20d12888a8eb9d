"""The 2:4 pattern, and the claim a checkpoint makes of it.

2:4 is the structured sparsity NVIDIA's sparse tensor cores run (TensorRT's `SPARSE_WEIGHTS`, set by
`trtllm-build --weight_sparsity`): in every group of 4 consecutive input weights of a row of a weight
[out, in] (columns 4k .. 4k+3) at most 2 are nonzero. A checkpoint holding such weights says so in its
config.json under `sparsity` (pattern, method, the linears it covers); TensorRT-LLM's PretrainedConfig keeps
a key it does not know as an attribute (docs/upstream-facts.md), and trtpipe's stages carry it through
(calibrate keeps every zero a zero). The runtime checks the claim where it reads each claimed weight, so
eval, calibrate and the cpu model refuse a checkpoint that claims 2:4 and breaks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError

PATTERN = "2:4"
PATTERNS = (PATTERN,)
KEPT, GROUP = 2, 4
#: the config.json key of the claim
CONFIG_KEY = "sparsity"


@dataclass(frozen=True)
class SparsityClaim:
    pattern: str
    method: str                      # how the zeros were chosen: sparsegpt | magnitude
    modules: tuple[str, ...]         # the linears it covers, global names (transformer.layers.0.attention.qkv)

    def covers(self, module: str) -> bool:
        return module in self.modules

    def to_dict(self) -> dict:
        return {"pattern": self.pattern, "method": self.method, "modules": list(self.modules)}


def check_pattern_name(pattern: str) -> None:
    if pattern not in PATTERNS:
        raise UserError(f"--pattern must be {PATTERN} (got {pattern!r}): 2:4 is the only structured sparsity "
                        "TensorRT's sparse kernels run")


def claim_of(raw: dict, where: str) -> SparsityClaim | None:
    """The claim in a checkpoint's config.json (None: a dense checkpoint); UserError for one that is malformed."""
    value = raw.get(CONFIG_KEY)
    if value is None:
        return None
    modules = value.get("modules") if isinstance(value, dict) else None
    if (not isinstance(value, dict) or value.get("pattern") not in PATTERNS or not isinstance(modules, list)
            or not all(isinstance(m, str) for m in modules)):
        raise UserError(f"{where}: `{CONFIG_KEY}` must be {{\"pattern\": \"{PATTERN}\", \"method\": ..., "
                        f"\"modules\": [linear names]}} (got {value!r})")
    return SparsityClaim(value["pattern"], str(value.get("method", "")), tuple(modules))


def dense_groups(weight: torch.Tensor) -> int:
    """The groups of GROUP consecutive input weights of `weight` [out, in] holding more than KEPT nonzeros (a
    last group cut short counts with the columns it has)."""
    nonzero = (weight != 0).reshape(weight.shape[0], -1)
    pad = -nonzero.shape[1] % GROUP
    if pad:
        nonzero = torch.cat([nonzero, nonzero.new_zeros(nonzero.shape[0], pad)], dim=1)
    return int((nonzero.reshape(nonzero.shape[0], -1, GROUP).sum(dim=-1) > KEPT).sum())


def check_claimed(module: str, weight: torch.Tensor, claim: SparsityClaim, where: str) -> None:
    """UserError when a weight the claim covers breaks the pattern."""
    bad = dense_groups(weight)
    if bad:
        groups = weight.shape[0] * -(-weight.shape[1] // GROUP)
        raise UserError(f"{where}: config.json claims {claim.pattern} sparsity ({claim.method or 'no method'}) for "
                        f"{module}, but {bad} of its {groups} groups of {GROUP} input weights hold more than {KEPT} "
                        "nonzeros: the weights were changed after sparsify; run `trtpipe sparsify` again or drop "
                        f"the `{CONFIG_KEY}` claim")


def magnitude_keep(weight: torch.Tensor) -> torch.Tensor:
    """bool [out, in]: in each group of GROUP inputs, the KEPT weights of largest magnitude (ties: the first)."""
    rows, cols = weight.shape
    groups = weight.abs().reshape(rows, cols // GROUP, GROUP)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(KEPT, dim=2, sorted=False).indices, True)
    return keep.reshape(rows, cols)


def check_width(module: str, width: int) -> None:
    if width % GROUP:
        raise UserError(f"{module}: {width} input features per rank is not a multiple of {GROUP}; 2:4 sparsity "
                        "needs whole groups of 4 (convert with another --tp)")
