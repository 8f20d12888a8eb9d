"""plan.json: the plan as written, with what vLLM and TGI would be launched with for the same budget beside it
(`servers`; written for people and other tools, never read back: `schema.load_plan` reads the plan alone).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..outputs import portable, write_atomic
from .schema import Plan
from .servers import equivalents


def plan_document(plan: Plan) -> dict:
    """What plan.json and `trtpipe plan --json` hold: the plan and its servers' equivalents."""
    return {**plan.to_dict(), "equivalents": equivalents(plan)}


def plan_json(plan: Plan, directory: Path) -> str:
    """plan.json's text in DIRECTORY: paths under it relative to it, under home `~/...` (`portable`), so the
    file names no machine and a moved build still reads; `load_plan` makes the model's path absolute again."""
    return json.dumps(portable(plan_document(plan), Path(directory)), indent=2) + "\n"


def save_plan(plan: Plan, path: Path) -> Path:
    """Write plan.json atomically (temporary sibling, then rename)."""
    return write_atomic(path, plan_json(plan, Path(path).parent))
