"""plan.json: the plan as written, with what vLLM and TGI would be launched with for the same budget beside it
(`servers`; written for people and other tools, never read back: `schema.load_plan` reads the plan alone).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..outputs import check_output_file, portable, write_atomic
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
    """Write plan.json atomically (temporary sibling, then rename); only over a plan trtpipe wrote."""
    check_output_file(Path(path), is_plan_file)
    return write_atomic(path, plan_json(plan, Path(path).parent))


def is_plan_file(path: Path) -> bool:
    try:
        return json.loads(Path(path).read_text()).get("plan_version") is not None
    except (OSError, ValueError, AttributeError):
        return False
