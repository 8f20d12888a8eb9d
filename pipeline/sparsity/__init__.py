"""Structured 2:4 sparsity: the pattern and the claim a checkpoint makes (`pattern`), SparseGPT's mask selection
and weight update (`sparsegpt`), and the `trtpipe sparsify` stage (`stage`). docs/sparsity.md.

This package's `__init__` imports nothing, so the runtime can read `pattern` without the stage."""
