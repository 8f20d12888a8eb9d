"""`trtpipe versions`: several builds as versions of one Triton repository's `tensorrt_llm`, for rollback inside
one server (issue 17).

- `repository`: the versions on disk, the one the config serves (`version_policy`), the manifest's records;
- `compat`: why a build cannot be another version (engines, other models or tokenizers, per-model settings);
- `edit`: add / serve / remove, each atomic on disk;
- `live`: switching a running Triton (model control, `--model-control-mode=explicit`);
- `commands`: the click group.

Nothing is imported here, so `trtpipe --help` stays fast. docs/versions.md has the commands, the rollback
procedure and what does not work.
"""
