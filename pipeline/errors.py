"""User-facing errors: one clear message and exit status 2, never a traceback."""

import json
from pathlib import Path


class UserError(Exception):
    """Bad input or usage. The CLI prints the message and exits with status 2."""

    exit_code = 2


def read_config_json(directory: Path, not_found: str) -> dict:
    """DIRECTORY/config.json as a dict; a UserError saying `not_found` when it is absent, or why it is unreadable."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(not_found)
    return read_json_object(path)


def read_json_object(path: Path, prefix: str = "") -> dict:
    """The JSON object in PATH; a UserError (after `prefix`) when it is not valid JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise UserError(f"{prefix}{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{prefix}{path} must hold a JSON object")
    return data
