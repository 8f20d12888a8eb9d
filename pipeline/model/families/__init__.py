"""One module per model family; each defines one `Family` (pipeline/model/spec.py)."""
