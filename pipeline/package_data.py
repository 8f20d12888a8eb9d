"""Where the data trtpipe ships lies: the package itself, and the design card's two top-level folders.

`model_repo/` (the Triton model sources deploy copies) and `calibration/` (the recipes) live at the top level of
the source tree, beside `pipeline/`. The wheel carries them inside the package, as `pipeline/data/model_repo/` and
`pipeline/data/calibration/` (pyproject.toml's package-dir), so an installed trtpipe finds them there and a source
checkout (an editable install, the tests) at the top level: one copy in either case.

`copy_model_support` puts the part of the package trtpipe's model.py files import (`MODEL_SUPPORT_FILES`:
`pipeline/__init__.py`, constants only, `pipeline/triton_names.py` and `pipeline/spans.py`, standard library only)
beside a model.py in a repository, so the model imports that copy whatever trtpipe, if any, the server's Python has.
"""

from __future__ import annotations

import shutil
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
#: The package's own data files (the target catalogue, the LLM API argument list).
DATA_DIR = PACKAGE_DIR / "data"


def shipped_folder(name: str) -> Path:
    """The top-level folder NAME as this installation has it: inside the package (a wheel), else the checkout's."""
    installed = DATA_DIR / name
    return installed if installed.is_dir() else PACKAGE_DIR.parent / name


#: The Python model sources (model_repo/<model>/1/model.py).
MODEL_SOURCES = shipped_folder("model_repo")
#: The calibration recipes (calibration/<name>.json).
RECIPES = shipped_folder("calibration")
#: What trtpipe's own model.py files import of the package (each puts its version directory first on sys.path).
MODEL_SUPPORT_FILES = (PACKAGE_DIR / "__init__.py", PACKAGE_DIR / "triton_names.py", PACKAGE_DIR / "spans.py")


def copy_model_support(version_dir: Path) -> None:
    """MODEL_SUPPORT_FILES into `version_dir` (a model's version directory, beside its model.py) as
    `pipeline/__init__.py`, `pipeline/triton_names.py` and `pipeline/spans.py`."""
    package = Path(version_dir) / PACKAGE_DIR.name
    package.mkdir(parents=True, exist_ok=True)
    for f in MODEL_SUPPORT_FILES:
        shutil.copyfile(f, package / f.name)
