"""Presets and hub ids: the user's directory first, then the Hugging Face cache offline or a download online.

The cache is laid out here exactly as huggingface_hub lays it out and read by huggingface_hub's own
code. Nothing reaches the network: the online cases replace `snapshot_download` as pipeline.sources
sees it, to check what is asked for and how huggingface_hub's own errors are reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from pipeline import sources
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.presets import PRESETS
from pipeline.sources import HUB_FILES, HUB_SKIP, resolve_model

COMMIT = "6ab0f3f1c4e1b2a9d8c7e6f5a4b3c2d1e0f9a8b7"
LLAMA3 = "meta-llama/Meta-Llama-3-8B"


def cache_model(cache: Path, hub_id: str, files: list[Path]) -> Path:
    """`files` as huggingface_hub caches them: content-addressed blobs, a snapshot of links, refs/main."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in files:
        data = f.read_bytes()
        lfs = f.suffix == ".safetensors"  # LFS files are named by sha256, the others by their git blob hash
        etag = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / etag).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", etag))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def model_files(hf_dir: Path) -> list[Path]:
    return [hf_dir / "config.json", hf_dir / "model.safetensors"]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def run_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


# ------------------------------------------------------------------------------------ offline: the cache

def test_preset_converts_offline_from_the_hub_cache(tiny_llama, hub_cache, tmp_path):
    snapshot = cache_model(hub_cache, LLAMA3, model_files(tiny_llama("gqa")))
    source = resolve_model("llama-3-8b")
    assert (source.kind, source.path) == ("hf-dir", snapshot)
    assert source.arch.num_attention_heads == 8  # the cached model's config, not the preset's numbers (32)
    code, output = run_cli("convert", "llama-3-8b", "-o", tmp_path / "ckpt", "--json")
    assert code == 0, output
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["num_attention_heads"] == 8


def test_hub_id_resolves_offline_from_the_hub_cache(tiny_llama, hub_cache):
    cache_model(hub_cache, "some-org/tiny-mistral", model_files(tiny_llama("mistral")))
    source = resolve_model("some-org/tiny-mistral")
    assert source.kind == "hf-dir" and source.arch.architecture == "MistralForCausalLM"
    assert (source.hf_dir() / "model.safetensors").is_file()


def test_cached_config_without_weights_is_not_a_model(tiny_llama, hub_cache):
    cache_model(hub_cache, LLAMA3, [tiny_llama("gqa") / "config.json"])
    source = resolve_model("llama-3-8b")  # the preset still plans: its numbers need no weights
    assert source.kind == "preset" and source.arch == PRESETS["llama-3-8b"].arch
    with pytest.raises(UserError, match=f"HF_HUB_OFFLINE is set.*hf download {LLAMA3}") as err:
        source.hf_dir()
    assert str(hub_cache) in str(err.value)
    cache_model(hub_cache, "some-org/config-only", [tiny_llama("gqa") / "config.json"])
    config_only = resolve_model("some-org/config-only")  # its architecture plans and dry-runs a build
    assert config_only.kind == "config" and config_only.arch.num_attention_heads == 8
    with pytest.raises(UserError, match="some-org/config-only.*not on this machine"):
        config_only.hf_dir()


def test_a_hub_id_without_its_config_offline_says_what_to_fetch(hub_cache):
    with pytest.raises(UserError, match="hf download some-org/absent config.json") as err:
        resolve_model("some-org/absent")
    assert "\n" not in str(err.value)


def test_user_directories_come_before_the_cache(tiny_llama, hub_cache, tmp_path, monkeypatch):
    cache_model(hub_cache, LLAMA3, model_files(tiny_llama("gqa")))
    shutil.copytree(tiny_llama("mha"), tmp_path / "models" / "Meta-Llama-3-8B")
    monkeypatch.setenv("TRTPIPE_MODEL_DIR", str(tmp_path / "models"))
    source = resolve_model("llama-3-8b")
    assert source.path == tmp_path / "models" / "Meta-Llama-3-8B" and source.arch.num_key_value_heads == 4


def test_invalid_hub_id_is_one_clear_error(hub_cache):
    code, output = run_cli("convert", "some org/na me", "-o", hub_cache.parent / "out")
    assert code == 2 and "not a valid Hugging Face hub id" in output and "Traceback" not in output


# ------------------------------------------------------------------------------------ online: downloads

@pytest.fixture
def online(hub_cache, monkeypatch):
    """The network allowed; `snapshot_download` records its calls and returns the cached snapshot."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(hub_cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT)

    monkeypatch.setattr(sources, "snapshot_download", fake_snapshot_download)
    return calls


def test_preset_downloads_only_when_a_stage_needs_the_weights(tiny_llama, hub_cache, online):
    snapshot = cache_model(hub_cache, LLAMA3, model_files(tiny_llama("gqa")))
    source = resolve_model("llama-3-8b")
    assert source.kind == "hub" and source.arch == PRESETS["llama-3-8b"].arch and online == []
    assert source.hf_dir() == snapshot
    assert online == [(LLAMA3, {"allow_patterns": HUB_FILES, "ignore_patterns": HUB_SKIP, "cache_dir": hub_cache})]


def test_hub_id_fetches_its_config_first(tiny_llama, hub_cache, online):
    cache_model(hub_cache, "some-org/tiny", model_files(tiny_llama("mqa")))
    source = resolve_model("some-org/tiny")
    assert source.kind == "hub" and source.arch.num_key_value_heads == 1
    assert [(repo, kw["allow_patterns"]) for repo, kw in online] == [("some-org/tiny", ["config.json"])]


def test_download_without_safetensors_says_so(tiny_llama, hub_cache, online):
    cache_model(hub_cache, LLAMA3, [tiny_llama("gqa") / "config.json"])
    with pytest.raises(UserError, match="no safetensors weights"):
        resolve_model("llama-3-8b").hf_dir()


@pytest.mark.parametrize("listing,wanted", [
    (["config.json", "generation_config.json", "model-00001-of-00004.safetensors", "model-00004-of-00004.safetensors",
      "model.safetensors.index.json", "original/consolidated.00.pth", "original/params.json",
      "original/tokenizer.model", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "LICENSE",
      "README.md", "USE_POLICY.md", ".gitattributes"],
     {"config.json", "generation_config.json", "model-00001-of-00004.safetensors", "model-00004-of-00004.safetensors",
      "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}),
    (["config.json", "consolidated.safetensors", "model-00001-of-00003.safetensors", "model.safetensors.index.json",
      "params.json", "tokenizer.model", "tokenizer.model.v3", "pytorch_model-00001-of-00002.bin",
      "pytorch_model.bin.index.json"],
     {"config.json", "model-00001-of-00003.safetensors", "model.safetensors.index.json", "tokenizer.model"}),
    (["config.json", "model.safetensors", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
      "onnx/model.onnx", "flax_model.msgpack"],
     {"config.json", "model.safetensors", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"}),
])
def test_download_patterns_select_what_conversion_reads(listing, wanted):
    """huggingface_hub's own filter over real repository listings (Llama 3, Mistral v0.3, a BPE model)."""
    assert set(filter_repo_objects(listing, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP)) == wanted


def http_response(status: int) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response.url = f"https://huggingface.co/api/models/{LLAMA3}"
    return response


@pytest.mark.parametrize("spec", ["llama-3-8b", "some-org/private-model"])
@pytest.mark.parametrize("error,says", [
    (GatedRepoError("403 Client Error. Cannot access gated repo.", response=http_response(403)),
     ["is a gated model", "accept its license at https://huggingface.co/", "HF_TOKEN", "huggingface-cli login"]),
    (RepositoryNotFoundError("404 Client Error. Repository Not Found.", response=http_response(404)),
     ["was not found on the Hugging Face Hub", "check the id", "HF_TOKEN"]),
    (HfHubHTTPError("401 Client Error. Invalid credentials in Authorization header", response=http_response(401)),
     ["refused the token", "HTTP 401", "HF_TOKEN", "huggingface-cli login"]),
    (LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub."),
     ["Hugging Face Hub is not reachable", "--model-dir"]),
])
def test_hub_errors_are_one_line_saying_what_to_do(hub_cache, online, monkeypatch, spec, error, says):
    def refuse(repo_id, **kwargs):
        raise error

    monkeypatch.setattr(sources, "snapshot_download", refuse)
    code, output = run_cli("convert", spec, "-o", hub_cache.parent / "out")
    assert code == 2, output
    line, = output.splitlines()
    hub_id = LLAMA3 if spec == "llama-3-8b" else spec
    assert line.startswith("error: ") and hub_id in line and all(s in line for s in says), line
    assert not (hub_cache.parent / "out").exists()


def test_environment_is_read_when_resolving(hub_cache, monkeypatch):
    """HF_HUB_OFFLINE and HF_HUB_CACHE apply as set now, although huggingface_hub read them at import."""
    assert sources.hub_offline() and sources.hub_cache() == hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", os.fspath(hub_cache / "elsewhere"))
    assert not sources.hub_offline() and sources.hub_cache() == hub_cache / "elsewhere"


# ------------------------------------------------------------------------------------ GGUF materialization
class _Saved:
    """Stands in for the dequantized model and tokenizer: what materialize_gguf saves is the cache entry."""

    config = None

    def save_pretrained(self, directory, **_):
        (Path(directory) / "config.json").write_text("{}")


def test_gguf_cache_entry_is_keyed_by_content_not_modification_time(tmp_path, monkeypatch):
    import transformers

    loads = []
    monkeypatch.setenv("TRTPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_load_gguf_config", lambda path: transformers.LlamaConfig(num_hidden_layers=1))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda directory, gguf_file, **_: loads.append(Path(directory, gguf_file)) or _Saved())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saved())
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    entry = sources.materialize_gguf(first)
    assert loads == [first] and (entry / "config.json").is_file()

    reinstalled = tmp_path / "b" / "model.gguf"  # the same wheel installed again: same bytes, newer mtime
    reinstalled.parent.mkdir()
    shutil.copyfile(first, reinstalled)
    os.utime(reinstalled, ns=(first.stat().st_mtime_ns + 10**9,) * 2)
    assert sources.materialize_gguf(reinstalled) == entry and loads == [first]

    edited = tmp_path / "c" / "model.gguf"  # other weights under the same name and size: a new entry
    edited.parent.mkdir()
    edited.write_bytes(first.read_bytes()[:-1] + b"\x01")
    other = sources.materialize_gguf(edited)
    assert other != entry and loads == [first, edited] and len(list((tmp_path / "cache" / "hf").iterdir())) == 2


SENTENCE = "The capital of France is Paris.  Two  spaces,\nnew line; émigré 123"


def test_the_gguf_tokenizer_is_labelled_to_load_its_tokenizer_json_as_saved(smollm2_hf_dir):
    """SmolLM2's tokenizer reads the same in every consumer: labelled PreTrainedTokenizerFast (not the
    LlamaTokenizer transformers' GGUF conversion names, whose spaces transformers 5.x drops), AutoTokenizer's ids
    are those of tokenizer.json read with `tokenizers` alone, and decoding gives the sentence back, spaces and all."""
    import tokenizers
    from transformers import AutoTokenizer

    config = json.loads((smollm2_hf_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    raw = tokenizers.Tokenizer.from_file(str(smollm2_hf_dir / "tokenizer.json"))
    ids = tokenizer(SENTENCE, add_special_tokens=False)["input_ids"]
    assert ids == raw.encode(SENTENCE, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == raw.decode(ids) == SENTENCE


def test_an_older_cache_entry_is_relabelled_and_keeps_its_ids(smollm2_hf_dir, tmp_path, monkeypatch):
    """An entry an older trtpipe wrote (LlamaTokenizer) is relabelled when it is read again; the ids are the same
    under either label with this transformers."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("TRTPIPE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(64)))
    st = gguf.stat()
    entry = sources.cache_dir() / "hf" / f"m-{sources._content_digest(gguf.resolve(), st.st_size, st.st_mtime_ns)[:16]}"
    shutil.copytree(smollm2_hf_dir, entry, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((entry / "tokenizer_config.json").read_text())
    (entry / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    before = AutoTokenizer.from_pretrained(entry)(SENTENCE)
    assert type(AutoTokenizer.from_pretrained(entry)).__name__ == "LlamaTokenizerFast"
    assert sources.materialize_gguf(gguf) == entry
    assert json.loads((entry / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    after = AutoTokenizer.from_pretrained(entry)(SENTENCE)
    assert type(AutoTokenizer.from_pretrained(entry)).__name__ == "PreTrainedTokenizerFast"
    assert dict(after) == dict(before)   # the same ids, and no token_type_ids a causal LM's generate refuses


@pytest.mark.slow
def test_the_first_gguf_conversion_on_an_empty_cache_prints_no_third_party_notice(tmp_path):
    """The README's main job on a new machine dequantizes SmolLM2's GGUF once: transformers must not print its
    `torch_dtype` deprecation or the Llama tokenizer's legacy notice then (a warm cache hides both)."""
    env = {**os.environ, "TRTPIPE_CACHE": str(tmp_path / "empty-cache")}
    trtpipe = Path(sys.executable).with_name("trtpipe")
    run = subprocess.run([str(trtpipe), "convert", "smollm2-135m", "-o", str(tmp_path / "ckpt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert list((tmp_path / "empty-cache" / "hf").iterdir()), "the cache was not empty: nothing was dequantized"
    printed = run.stdout + run.stderr
    for notice in ("deprecated", "legacy", "Warning", "warn("):
        assert notice not in printed, printed
