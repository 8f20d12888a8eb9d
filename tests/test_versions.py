"""`trtpipe versions`: two builds as versions of one repository's tensorrt_llm, refusals, and a live rollback."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from support.http import JsonHandler
from support.models import make_tiny_model, save_word_tokenizer
from pipeline.check import check_repository
from pipeline.cli import main
from pipeline.convert import convert_model
from pipeline.deploy import deploy_repository
from pipeline.model_repository import read_deployment
from pipeline.plan import resolve_model_info
from pipeline.planner import make_plan
from pipeline.plan.schema import Workload
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.tritonconfig import parse_pbtxt

WORKLOAD = Workload(input_len=64, output_len=32)
PROMPT = " w3 w4 w5 w6"
MAX_TOKENS = 6


def checkpoint_of(hf: Path, out: Path, tokenizer: Path) -> Path:
    ckpt = convert_model(resolve_model(str(hf)), out, dtype="float32", progress=False).path
    shutil.copytree(tokenizer, ckpt / "tokenizer", dirs_exist_ok=True)
    return ckpt


def cpu_repo(hf: Path, ckpt: Path, out: Path, workload: Workload = WORKLOAD) -> Path:
    plan = make_plan(resolve_model_info(str(hf)), get_target("cpu"), "fp32", workload=workload)
    return deploy_repository(plan, out, checkpoint=ckpt).path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Everything under one root (as builds are): two random seeds of one tiny model (A, B), a model with fewer
    layers, a repository planned for another context, one with another tokenizer, and an engine repository."""
    root = tmp_path_factory.mktemp("versions")
    tok, other_tok = root / "tokenizer", root / "tokenizer-other"
    for d in (tok, other_tok):
        d.mkdir()
        save_word_tokenizer(d)
    config = json.loads((other_tok / "tokenizer_config.json").read_text())
    (other_tok / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "\u0120w2"}))
    hf = {"a": make_tiny_model(root / "hf-a", seed=0), "b": make_tiny_model(root / "hf-b", seed=1),
          "small": make_tiny_model(root / "hf-small", seed=2, num_hidden_layers=2)}
    ckpt = {name: checkpoint_of(path, root / f"ckpt-{name}", tok) for name, path in hf.items()}
    ckpt["a-other-tok"] = checkpoint_of(hf["a"], root / "ckpt-a-other-tok", other_tok)
    gpu_plan = make_plan(resolve_model_info(str(hf["a"])), get_target("rtx4090"), "fp16", workload=WORKLOAD)
    return {
        "root": root, "ckpt-a": ckpt["a"], "ckpt-b": ckpt["b"], "tokenizer": tok,
        "a": cpu_repo(hf["a"], ckpt["a"], root / "a" / "model_repo"),
        "b": cpu_repo(hf["b"], ckpt["b"], root / "b" / "model_repo"),
        "other-model": cpu_repo(hf["small"], ckpt["small"], root / "small" / "model_repo"),
        "other-context": cpu_repo(hf["b"], ckpt["b"], root / "ctx" / "model_repo",
                                  Workload(input_len=64, output_len=32, max_context=128)),
        "other-tokenizer": cpu_repo(hf["a"], ckpt["a-other-tok"], root / "tok" / "model_repo"),
        "engine": deploy_repository(gpu_plan, root / "gpu" / "model_repo", engine=root / "gpu" / "engine",
                                    tokenizer=tok).path,
    }


@pytest.fixture
def repo(world, tmp_path) -> Path:
    """A fresh copy of A's repository beside the others (so the manifest's relative paths resolve)."""
    path = world["root"] / tmp_path.name / "model_repo"
    shutil.copytree(world["a"], path)
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


def cli(*args: str):
    return CliRunner().invoke(main, ["versions", *map(str, args)])


def snapshot(path: Path) -> dict[str, str]:
    """Every file under `path` (and the entries beside it) by its content hash: what "unchanged" means."""
    files = {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    return {**files, "(siblings)": ",".join(sorted(p.name for p in path.parent.iterdir()))}


def trtllm_config(repo: Path):
    return parse_pbtxt((repo / "tensorrt_llm" / "config.pbtxt").read_text())


def without_policy(config):
    stripped = type(config)()
    stripped.CopyFrom(config)
    stripped.ClearField("version_policy")
    return stripped


# ------------------------------------------------------------------------------------------ the repository

def test_a_second_build_becomes_version_2_and_the_config_names_the_served_one(world, repo):
    original = {m: (repo / m / "config.pbtxt").read_bytes() for m in ("ensemble", "preprocessing",
                                                                      "postprocessing", "tensorrt_llm_bls")}
    before = trtllm_config(repo)
    assert not before.HasField("version_policy")   # deploy leaves Triton's default: latest 1

    result = cli("add", repo, world["b"].parent)     # a build directory: its model_repo/ is taken
    assert result.exit_code == 0, result.output
    assert "as version 2" in result.output and "version 1 is still the one served" in result.output
    # pinned to 1: with Triton's default policy the new directory 2 would be served at the next start
    assert list(trtllm_config(repo).version_policy.specific.versions) == [1]
    added, taken = repo / "tensorrt_llm" / "2", world["b"] / "tensorrt_llm" / "1"
    assert snapshot(added) == {**snapshot(taken), "(siblings)": "1,2,config.pbtxt"}   # B's version, file for file

    assert cli("serve", repo, "2").exit_code == 0
    config = trtllm_config(repo)   # parsed back with the real schema
    assert list(config.version_policy.specific.versions) == [2]
    assert without_policy(config) == without_policy(before)   # nothing else of the model-level config moved
    assert {m: (repo / m / "config.pbtxt").read_bytes() for m in original} == original
    steps = {s.model_name: s.model_version for s in parse_pbtxt((repo / "ensemble" / "config.pbtxt").read_text())
             .ensemble_scheduling.step}
    assert steps == {"preprocessing": -1, "tensorrt_llm": -1, "postprocessing": -1}
    assert not [f for f in check_repository(repo).findings if f.severity == "error"]

    manifest = json.loads((repo / "manifest.json").read_text())
    held = manifest["versions"]["held"]
    assert (manifest["versions"]["served"], manifest["versions"]["previous"]) == (2, 1)
    assert held["1"]["deployment"]["model"] == "../hf-a" and held["2"]["deployment"]["model"] == "../hf-b"
    assert (held["1"]["source"], held["2"]["source"]) == ("model_repo", "../b")
    assert manifest["deployment"] == held["2"]["deployment"]      # validate's golden follows the served version
    assert read_deployment(repo).model == str(world["root"] / "hf-b")
    assert str(world["root"]) not in json.dumps(manifest["versions"])   # the records name no directory of this machine
    assert manifest["outputs"]["tensorrt_llm/config.pbtxt"]["sha256"] == hashlib.sha256(
        (repo / "tensorrt_llm" / "config.pbtxt").read_bytes()).hexdigest()


def test_list_rollback_to_previous_and_remove(world, repo):
    assert cli("add", repo, world["b"], "--serve").exit_code == 0
    listed = json.loads(cli("list", repo, "--json").output)
    assert listed["served"] == [2]
    assert [(v["version"], v["served"], v["previous"]) for v in listed["versions"]] == [(1, False, True),
                                                                                         (2, True, False)]
    rolled = json.loads(cli("serve", repo, "previous", "--json").output)
    assert (rolled["served"], rolled["before"], rolled["live"]) == (1, [2], None)
    assert list(trtllm_config(repo).version_policy.specific.versions) == [1]
    assert json.loads(cli("serve", repo, "previous", "--json").output)["served"] == 2   # and forward again
    assert cli("serve", repo, "1").exit_code == 0
    result = cli("remove", repo, "2")
    assert result.exit_code == 0, result.output
    assert not (repo / "tensorrt_llm" / "2").exists()
    assert list(json.loads((repo / "manifest.json").read_text())["versions"]["held"]) == ["1"]
    assert [p.name for p in repo.parent.iterdir()] == ["model_repo"]   # no staging or removed leftovers


# ------------------------------------------------------------------------------------------ refusals

REFUSALS = {
    "engine source": ("add", "{repo}", "{engine}", "gpt_model_path"),
    "engine repository": ("add", "{engine}", "{b}", "--canary-of"),
    "another model": ("add", "{repo}", "{other-model}", "num_hidden_layers: 4 in REPO, 2 in SOURCE"),
    "another tokenizer": ("add", "{repo}", "{other-tokenizer}", "different tokenizers"),
    "a per-model setting": ("add", "{repo}", "{other-context}", "tensorrt_llm parameters['max_seq_len']"),
    "itself": ("add", "{repo}", "{repo}", "SOURCE is REPO itself"),
    "not a repository": ("add", "{repo}", "{root}", "not a model repository written by `trtpipe deploy`"),
    "a version not held": ("serve", "{repo}", "3", "has no version 3"),
    "no previous": ("serve", "{repo}", "previous", "no previously served version"),
    "not a number": ("serve", "{repo}", "two", "VERSION must be a version number"),
    "the served version": ("remove", "{repo}", "1", "is the one"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_work_is_refused_with_one_message_and_nothing_written(case, world, repo):
    *args, message = REFUSALS[case]
    paths = {**{k: str(v) for k, v in world.items()}, "repo": str(repo)}
    before = snapshot(repo)
    engine_before = snapshot(world["engine"])
    result = cli(*(a.format_map(paths) for a in args))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert snapshot(repo) == before and snapshot(world["engine"]) == engine_before


def test_the_per_model_setting_refusal_names_both_values(world, repo):
    result = cli("add", repo, world["other-context"])
    assert "max_seq_len" in result.output and "'256' in REPO, '128' in SOURCE" in result.output


def test_a_failed_copy_leaves_the_repository_as_it_was(world, repo, monkeypatch):
    import pipeline.versions.edit as edit

    def fail_midway(source, dest):
        if Path(source).name == "rank0.safetensors":
            raise OSError("disk full")
        shutil.copy2(source, dest)

    monkeypatch.setattr(edit, "link_or_copy", fail_midway)
    before = snapshot(repo)
    result = cli("add", repo, world["b"])
    assert result.exit_code == 1 and "disk full" in result.output
    assert snapshot(repo) == before


class RefusingTriton(JsonHandler):
    """A server without model control: tensorrt_llm's config as `config`, load answered as tritonserver 2.51
    started with --model-control-mode=none answers it."""

    config: dict = {}

    def do_GET(self):
        self.reply(200, self.config)

    def do_POST(self):
        self.reply(503, {"error": "explicit model load / unload is not allowed if polling is enabled"})


def test_a_server_without_model_control_is_refused_before_anything_is_written(world, repo):
    from google.protobuf import json_format

    assert cli("add", repo, world["b"]).exit_code == 0
    RefusingTriton.config = json_format.MessageToDict(trtllm_config(repo), preserving_proto_field_name=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), RefusingTriton)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        before = snapshot(repo)
        result = cli("serve", repo, "2", "--url", f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert result.exit_code == 2 and "does not allow model control" in result.output, result.output
    assert "--model-control-mode=explicit" in result.output
    assert snapshot(repo) == before


# ------------------------------------------------------------------------------------------ served for real

@pytest.fixture(scope="module")
def explicit_server(world, tmp_path_factory):
    """A two-version repository (B served) in the embedded Triton started with --model-control-mode=explicit."""
    import pipeline.server as server_module

    repo = tmp_path_factory.mktemp("live") / "model_repo"
    shutil.copytree(world["a"], repo)
    result = cli("add", repo, world["b"], "--serve")
    assert result.exit_code == 0, result.output
    with server_module.embedded_server(repo, ready_timeout=600, model_control="explicit") as server:
        yield repo, server


def reference_completion(checkpoint: Path, tokenizer: Path) -> str:
    """Greedy completion of PROMPT straight from the reference runtime (no server)."""
    from transformers import AutoTokenizer

    from pipeline.runtime import ReferenceModel, SamplingConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    out = ReferenceModel.load(checkpoint).generate(
        [tok.encode(PROMPT)], SamplingConfig(max_new_tokens=MAX_TOKENS, end_id=tok.eos_token_id))[0]
    return tok.decode(out, skip_special_tokens=True)


def served_completion(url: str) -> str:
    r = requests.post(f"{url}/v2/models/ensemble/generate", json={"text_input": PROMPT, "max_tokens": MAX_TOKENS},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


def ready(url: str) -> dict[int, bool]:
    return {v: requests.get(f"{url}/v2/models/tensorrt_llm/versions/{v}/ready", timeout=30).status_code == 200
            for v in (1, 2)}


@pytest.mark.slow
def test_a_running_server_serves_version_2_then_rolls_back_to_1(world, explicit_server):
    from pipeline.triton_admin import TritonAdmin

    repo, server = explicit_server
    a = reference_completion(world["ckpt-a"], world["tokenizer"])
    b = reference_completion(world["ckpt-b"], world["tokenizer"])
    assert a != b   # the two seeds generate differently, so the served text says which version answered
    assert ready(server.http_url) == {1: False, 2: True}
    assert served_completion(server.http_url) == b

    # a repository the server does not serve is refused before anything is loaded
    wrong = cli("serve", world["other-context"], "1", "--url", server.http_url)
    assert wrong.exit_code == 2 and "does not serve" in wrong.output, wrong.output

    result = cli("serve", repo, "1", "--url", server.http_url, "--json")
    assert result.exit_code == 0, result.output
    live = json.loads(result.output)["live"]
    assert live["version"] == 1
    assert ready(server.http_url)[1]
    assert served_completion(server.http_url) == a
    assert list(trtllm_config(repo).version_policy.specific.versions) == [1]
    assert json.loads((repo / "manifest.json").read_text())["versions"]["served"] == 1
    assert set(TritonAdmin(server.http_url).states().values()) == {"READY"}   # version 2 is listed UNAVAILABLE now
    if 2 not in live["still_ready"]:
        assert ready(server.http_url) == {1: True, 2: False}
