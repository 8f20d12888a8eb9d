"""Helpers the tests share (tiny models, stand-ins for Triton's Python backend and for HTTP servers,
TensorRT-LLM's checkpoint rules written out); the fixtures that use them are in tests/conftest.py."""
