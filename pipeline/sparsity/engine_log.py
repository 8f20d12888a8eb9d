"""Which layers of a TensorRT build went sparse, read from the builder's log.

TensorRT logs two INFO lines for a network built with SPARSE_WEIGHTS (trtllm-build --weight_sparsity), whatever
the logger's prefix ("[TRT] [I]", "[TensorRT] INFO:"):

    (Sparsity) Layers eligible for sparse math: <layer>, <layer>, ...
    (Sparsity) TRT inference plan picked sparse implementation for layers: <layer>, ...

The first lists the layers whose constant weights hold the 2:4 pattern, the second those whose fastest tactic
was a sparse one (docs/upstream-facts.md). A layer name may itself hold ", " only inside a fused name's " + ",
never as a separator, so splitting on ", " is exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

ELIGIBLE = re.compile(r"\(Sparsity\) Layers eligible for sparse math:(.*)$")
PICKED = re.compile(r"\(Sparsity\) TRT inference plan picked sparse implementation for layers:(.*)$")


@dataclass(frozen=True)
class SparseLayers:
    logged: bool                  # the build logged TensorRT's sparsity lines at all
    eligible: tuple[str, ...]
    picked: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"logged": self.logged, "eligible": list(self.eligible), "picked": list(self.picked)}

    def warning(self) -> str | None:
        """The loud line for a sparse build where no layer went sparse; None when some did."""
        if self.picked:
            return None
        if not self.logged:
            return ("WARNING: --weight_sparsity was set but TensorRT logged no sparsity lines: no layer is known to "
                    "have gone sparse (was the log level below info?); the engine runs dense")
        if not self.eligible:
            return ("WARNING: --weight_sparsity was set but TensorRT found no layer eligible for sparse math (the "
                    "GEMMs went to plugins, or the weights lost their 2:4 pattern): the engine runs dense")
        return (f"WARNING: {len(self.eligible)} layers were eligible for sparse math but TensorRT picked the dense "
                "tactic for every one (they timed faster): the engine runs dense, as on an RTX 4090 in "
                "TensorRT-LLM #1913")


def sparse_layers(lines: Iterable[str]) -> SparseLayers:
    """The eligible and picked layers of the last build the log holds."""
    logged, eligible, picked = False, (), ()
    for line in lines:
        line = line.rstrip("\n")
        if m := ELIGIBLE.search(line):
            logged, eligible = True, _names(m.group(1))
        elif m := PICKED.search(line):
            logged, picked = True, _names(m.group(1))
    return SparseLayers(logged, eligible, picked)


def _names(listed: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in listed.split(", ") if name.strip())
