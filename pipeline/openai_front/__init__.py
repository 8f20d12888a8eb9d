"""An OpenAI-compatible front over a repository's ensemble, for the servers where Triton's own frontend cannot
run: the embedded tritonserver 2.51 has no in-process Python API (`tritonserver` module), which Triton's frontend
(server `python/openai`) needs. It behaves as that frontend does for the same repository: /v1/models,
/v1/completions, /v1/chat/completions (the tokenizer's chat template, applied once), streaming with `usage`,
/health/ready; its refusals are OpenAI error objects (`protocol`), served by `app.OpenAIFront`.
"""
