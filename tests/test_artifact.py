"""`trtpipe package | verify | unpack`: round trip, what artifact.json proves, every tampering case, and that
nothing packaged names the build machine."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml
from support.models import tiny_model_with_tokenizer
from click.testing import CliRunner
from test_compile import pretend_gpu_box

from pipeline.artifact import MANIFEST, ROOT_PLACEHOLDER
from pipeline.artifact_signing import SIGNATURE
from pipeline.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def cpu_build(tiny_llama, tmp_path_factory) -> Path:
    """A tiny fp8 build on the cpu target, validated by the embedded Triton (about 30 s)."""
    root = tmp_path_factory.mktemp("artifact")
    model = tiny_model_with_tokenizer(tiny_llama("gqa"), root / "tiny")
    out = root / "builds" / "tiny-cpu-fp8"
    result = invoke("build", model, "--target", "cpu", "--precision", "fp8", "--samples", "8", "-o", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    """(private, public) Ed25519 PEM files, as `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout`
    write them."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    root = tmp_path_factory.mktemp("keys")
    key = Ed25519PrivateKey.generate()
    (root / "signing.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (root / "signing.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return root / "signing.pem", root / "signing.pub"


@pytest.fixture(scope="module")
def archive(cpu_build, keys, tmp_path_factory) -> Path:
    """The cpu build packaged and signed."""
    path = tmp_path_factory.mktemp("archives") / "tiny.tar"
    result = invoke("package", cpu_build, "-o", path, "--key", keys[0])
    assert result.exit_code == 0, result.output
    assert f"sha256 {sha256(path.read_bytes())} (signed by key" in result.output
    return path


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_round_trip_package_verify_unpack(cpu_build, archive, keys, tmp_path):
    content = members(archive)
    artifact = json.loads(content[MANIFEST])
    assert list(content)[:2] == [MANIFEST, SIGNATURE]
    signature = content.pop(SIGNATURE)
    assert set(artifact["files"]) == set(content) - {MANIFEST}
    assert all(artifact["files"][n] == {"size": len(d), "sha256": sha256(d)} for n, d in content.items()
               if n != MANIFEST)
    assert json.loads(signature)["algorithm"] == "ed25519"
    assert {"build.json", "validation/report.json", "model_repo/manifest.json",
            "model_repo/tensorrt_llm/1/checkpoint/rank0.safetensors"} <= set(content)
    assert not any("__pycache__" in n or n.endswith("server.log") for n in content)
    served = cpu_build / "model_repo" / "tensorrt_llm" / "1" / "checkpoint" / "rank0.safetensors"
    assert content["model_repo/tensorrt_llm/1/checkpoint/rank0.safetensors"] == served.read_bytes()
    assert (artifact["target"], artifact["sm"], artifact["tensorrt_llm_version"]) == ("cpu", None, "1.2.1")
    assert artifact["backend"] == "reference"
    report = json.loads(content["validation/report.json"])
    assert artifact["validation"] == {"passed": True, "checks": len(report["checks"])} and len(report["checks"]) >= 6
    assert artifact["calibration"]["precision"] == "fp8" and artifact["calibration"]["recipe"]["samples"] == 8
    ckpt = cpu_build / "checkpoint"
    expected = hashlib.sha256()
    for name in ("config.json", "rank0.safetensors"):
        expected.update(name.encode() + b"\0" + sha256((ckpt / name).read_bytes()).encode())
    assert artifact["model"]["checkpoint_sha256"] == expected.hexdigest()

    verified = invoke("verify", archive, "--target", "cpu", "--public-key", keys[1])
    assert verified.exit_code == 0 and "verified: every file matches its sha256; origin: signed by key" in \
        verified.output, verified.output
    consistent = invoke("verify", archive)       # no key, no digest: it says what it proved, and what not
    assert consistent.exit_code == 0 and "origin NOT proven" in consistent.output, consistent.output
    refused = invoke("unpack", archive, "-o", tmp_path / "refused")
    assert refused.exit_code == 2 and "--public-key" in refused.output and not (tmp_path / "refused").exists()
    out = tmp_path / "deploy"
    unpacked = invoke("unpack", archive, "-o", out, "--public-key", keys[1])
    assert unpacked.exit_code == 0, unpacked.output
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == set(content)
    assert all((out / n).read_bytes() == d for n, d in content.items())
    check = invoke("check", out / "model_repo")
    assert check.exit_code == 0, check.output
    # the ensemble's empty version directory, which Triton needs to load it, comes back too (issue 25 case 7)
    assert "model_repo/ensemble/1" in artifact["directories"] and (out / "model_repo" / "ensemble" / "1").is_dir()


def test_unpack_extracts_the_bytes_it_verified_even_if_the_file_is_swapped(archive, tmp_path, monkeypatch):
    """unpack verified the archive, then opened the path again to extract: an archive swapped in between was
    extracted unverified, its `../` member outside the target (issue 25 case 9). Now one read does both."""
    import pipeline.artifact as artifact_module

    victim = tmp_path / "incoming.tar"
    victim.write_bytes(archive.read_bytes())
    evil = add_member(archive, tmp_path / "evil.tar", tarfile.TarInfo("model_repo/../../escaped"), b"x")
    real_open, opened = open, []

    def open_then_swap(file, *args, **kwargs):
        handle = real_open(file, *args, **kwargs)
        if Path(file) == victim:
            opened.append(file)
            if len(opened) == 1:
                os.replace(evil, victim)    # the swap, right after the first open
        return handle

    monkeypatch.setattr(artifact_module, "open", open_then_swap, raising=False)
    out = tmp_path / "deploy" / "out"
    result = invoke("unpack", victim, "-o", out, "--sha256", sha256(archive.read_bytes()))
    assert result.exit_code == 0, result.output
    assert len(opened) == 1
    assert not (tmp_path / "deploy" / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == set(members(archive)) - \
        {SIGNATURE}


def test_a_moved_builds_package_names_its_own_repository_not_the_old_path(cpu_build, tmp_path):
    """validate recorded the repository and log by absolute path; after the build moved, package shipped the old
    one (issue 25), which is neither the build directory nor home."""
    moved = tmp_path / "elsewhere" / "build"
    shutil.copytree(cpu_build, moved)
    report = json.loads((moved / "validation" / "report.json").read_text())
    old = "/srv/old-place/tiny-cpu-fp8"
    report["repo"], report["server_log"] = f"{old}/model_repo", f"{old}/validation/server.log"
    (moved / "validation" / "report.json").write_text(json.dumps(report))
    assert invoke("package", moved, "-o", tmp_path / "moved.tar").exit_code == 0
    shipped = json.loads(members(tmp_path / "moved.tar")["validation/report.json"])
    assert (shipped["repo"], shipped["server_log"]) == ("model_repo", "validation/server.log")
    assert not any(old.encode() in data for data in members(tmp_path / "moved.tar").values())


def test_nothing_packaged_names_the_build_directory_or_home(cpu_build, archive):
    needles = [str(cpu_build).encode(), str(cpu_build.parent).encode(), os.path.expanduser("~").encode()]
    found = {n: [x.decode() for x in needles if x in d] for n, d in members(archive).items()}
    assert not {n: f for n, f in found.items() if f}
    # ... while the build directory's own files did name it before these fixes; the manifest still names
    # its inputs (relative to the build directory)
    manifest = json.loads(members(archive)["model_repo/manifest.json"])
    assert "checkpoint-fp8/rank0.safetensors" in manifest["inputs"]


def rewrite(archive: Path, out: Path, change) -> Path:
    """Copy ARCHIVE member by member to OUT, `change(info, data)` returning (info, data) or None to drop."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for info in src:
            changed = change(info, src.extractfile(info).read())
            if changed:
                info, data = changed
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
    return out


def add_member(archive: Path, out: Path, info: tarfile.TarInfo, data: bytes = b"") -> Path:
    out.write_bytes(archive.read_bytes())
    with tarfile.open(out, "a") as tar:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data) if data else None)
    return out


def link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def device(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    return info


@pytest.mark.parametrize("case,make,named", [
    ("altered", lambda a, o: rewrite(a, o, lambda i, d: (i, d.replace(b"tensorrt_llm", b"tensorrt_LLM"))
                                     if i.name == "model_repo/tensorrt_llm/config.pbtxt" else (i, d)),
     "model_repo/tensorrt_llm/config.pbtxt: sha256/size"),
    ("dropped", lambda a, o: rewrite(a, o, lambda i, d: None if i.name == "build.json" else (i, d)),
     "build.json: listed in artifact.json but missing"),
    ("extra", lambda a, o: add_member(a, o, tarfile.TarInfo("model_repo/extra.py"), b"print('hi')"),
     "model_repo/extra.py: not listed"),
    ("absolute", lambda a, o: add_member(a, o, tarfile.TarInfo("/etc/cron.d/x"), b"x"), "absolute path"),
    ("dotdot", lambda a, o: add_member(a, o, tarfile.TarInfo("model_repo/../../x"), b"x"), "path with '..'"),
    ("symlink-out", lambda a, o: add_member(a, o, link("model_repo/evil", "../../etc/passwd")),
     "model_repo/evil: refused, link to ../../etc/passwd outside the archive"),
    ("hardlink-out", lambda a, o: add_member(a, o, link("model_repo/evil", "/etc/passwd", tarfile.LNKTYPE)),
     "link to /etc/passwd outside the archive"),
    ("device", lambda a, o: add_member(a, o, device("model_repo/null")), "model_repo/null: refused, device"),
])
def test_each_tampering_is_caught_and_unpack_extracts_nothing(archive, tmp_path, case, make, named):
    bad = make(archive, tmp_path / f"{case}.tar")
    result = invoke("verify", bad)
    assert result.exit_code == 1, result.output
    assert named in result.output and "NOT verified" in result.output, result.output
    out = tmp_path / "out"
    assert invoke("unpack", bad, "-o", out, "--trust-unsigned").exit_code == 1
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_truncated_archive_names_the_file_cut(archive, tmp_path):
    data = archive.read_bytes()
    offsets = {}
    with tarfile.open(archive) as tar:
        offsets = {m.name: m.offset_data for m in tar}
    cut = offsets["model_repo/tensorrt_llm/1/checkpoint/rank0.safetensors"] + 100
    bad = tmp_path / "cut.tar"
    bad.write_bytes(data[:cut])
    result = invoke("verify", bad)
    assert result.exit_code == 1 and "rank0.safetensors" in result.output, result.output


def test_artifact_for_another_sm_is_refused(archive):
    result = invoke("verify", archive, "--target", "rtx4090")
    assert result.exit_code == 1 and "built for sm None (cpu), but rtx4090 is sm 89" in result.output


def test_trtllm_version_mismatch_is_refused(archive, tmp_path):
    def bump(info, data):
        if info.name == MANIFEST:
            data = data.replace(b'"tensorrt_llm_version": "1.2.1"', b'"tensorrt_llm_version": "1.3.0"')
        return info, data

    result = invoke("verify", rewrite(archive, tmp_path / "v.tar", bump), "--target", "cpu")
    assert result.exit_code == 1 and "built with TensorRT-LLM 1.3.0" in result.output, result.output


@pytest.mark.parametrize("args,message", [
    (["verify", "{tmp}/missing.tar"], "does not exist"),
    (["verify", "{archive}", "--target", "h900"], "unknown target 'h900'"),
    (["package", "{tmp}", "-o", "{tmp}/x.tar"], "not a trtpipe build directory"),
    (["unpack", "{archive}", "-o", "{tmp}", "--trust-unsigned"], "already exists"),
    (["verify", "{archive}", "--sha256", "abc"], "--sha256 must be the archive's 64 hex digits"),
    (["verify", "{archive}", "--public-key", "{tmp}/none.pub"], "cannot read the public key"),
    (["package", "{tmp}", "-o", "{tmp}/x.tar", "--key", "{archive}"], "is not a PEM private key"),
])
def test_user_mistakes_exit_2(archive, tmp_path, args, message):
    result = invoke(*[a.format(tmp=tmp_path, archive=archive) for a in args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "x.tar").exists()


def test_gpu_build_packages_its_engine_and_unpack_points_triton_at_it(tmp_path, tiny_llama, monkeypatch):
    """A GPU build with the fake trtllm-build (test_compile): the repository names the engine by absolute path;
    the archive holds the placeholder instead, and unpack writes the directory it extracted to."""
    pretend_gpu_box(monkeypatch, tmp_path / "bin")
    model = tiny_model_with_tokenizer(tiny_llama("gqa"), tmp_path / "tiny")
    build = tmp_path / "gpu-build"
    assert invoke("build", model, "--target", "rtx4090", "--precision", "fp16", "-o", build).exit_code == 0
    assert str(build / "engine") in (build / "model_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert invoke("package", build, "-o", tmp_path / "x.tar").exit_code == 2     # not validated yet
    (build / "validation").mkdir()
    (build / "validation" / "report.json").write_text(json.dumps(
        {"repo": str(build / "model_repo"), "passed": True, "checks": [{"name": "models_ready", "passed": True}]}))
    packaged = invoke("package", build, "-o", tmp_path / "gpu.tar")
    assert packaged.exit_code == 0, packaged.output
    content = members(tmp_path / "gpu.tar")
    artifact = json.loads(content[MANIFEST])
    assert artifact["sm"] == 89 and artifact["backend"] == "engine" and "engine/rank0.engine" in content
    assert "model_repo/tensorrt_llm/config.pbtxt" in artifact["relocate"]
    assert not any(str(tmp_path).encode() in d for d in content.values())   # nor the model's directory
    assert artifact["model"]["spec"] == json.loads(content["build.json"])["options"]["model"] == "tiny"
    assert json.loads(content["validation/report.json"])["repo"] == "model_repo"
    assert invoke("verify", tmp_path / "gpu.tar", "--target", "l40s").exit_code == 0     # also sm 89
    assert invoke("verify", tmp_path / "gpu.tar", "--target", "h100").exit_code == 1     # sm 90
    out = tmp_path / "unpacked"
    assert invoke("unpack", tmp_path / "gpu.tar", "-o", out, "--target", "rtx4090", "--trust-unsigned").exit_code == 0
    config = (out / "model_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert str(out / "engine") in config and ROOT_PLACEHOLDER not in config


# ------------------------------------------------------------------------------------ the pytorch backend

@pytest.fixture(scope="module")
def pytorch_build(tiny_llama, tmp_path_factory) -> Path:
    """A tiny fp8 build for the rtx4090 with --backend pytorch (no engine: the served Hugging Face FP8 model
    in model_repo/tensorrt_llm/1/model/), not validated: nothing can serve it here."""
    root = tmp_path_factory.mktemp("pytorch-artifact")
    model = tiny_model_with_tokenizer(tiny_llama("gqa"), root / "tiny")
    out = root / "builds" / "tiny-rtx4090-fp8-pytorch"
    result = invoke("build", model, "--target", "rtx4090", "--precision", "fp8", "--backend", "pytorch",
                    "--samples", "4", "--checkpoints-on-cpu", "-o", out)
    assert result.exit_code == 0, result.output
    assert not (out / "engine").exists()
    return out


@pytest.fixture(scope="module")
def pytorch_archive(pytorch_build, tmp_path_factory) -> Path:
    """The pytorch build packaged once `trtpipe validate --url` would have written its report (faked, as for the
    GPU build above); before that, package refuses it as any unvalidated build."""
    path = tmp_path_factory.mktemp("pytorch-archives") / "tiny-pytorch.tar"
    refused = invoke("package", pytorch_build, "-o", path)
    assert refused.exit_code == 2 and "has no validation report (validation/report.json)" in refused.output
    assert not path.exists()
    (pytorch_build / "validation").mkdir()
    (pytorch_build / "validation" / "report.json").write_text(json.dumps(
        {"repo": str(pytorch_build / "model_repo"), "passed": True,
         "checks": [{"name": "models_ready", "passed": True}, {"name": "golden", "passed": True}]}))
    packaged = invoke("package", pytorch_build, "-o", path)
    assert packaged.exit_code == 0, packaged.output
    assert "pytorch backend" in packaged.output
    return path


def test_pytorch_build_packages_its_repository_and_the_served_weights(pytorch_build, pytorch_archive,
                                                                      tmp_path_factory):
    content = members(pytorch_archive)
    artifact = json.loads(content[MANIFEST])
    assert (artifact["backend"], artifact["target"], artifact["sm"]) == ("pytorch", "rtx4090", 89)
    assert set(artifact["files"]) == set(content) - {MANIFEST}
    assert not any(n.startswith("engine/") for n in content)
    served = "model_repo/tensorrt_llm/1/model/"
    assert {served + f for f in ("config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json")} \
        <= set(content)
    assert content[served + "model.safetensors"] == \
        (pytorch_build / "checkpoint-fp8" / "hf" / "model.safetensors").read_bytes()
    assert artifact["relocate"] == [] and ROOT_PLACEHOLDER.encode() not in b"".join(content.values())
    assert artifact["validation"] == {"passed": True, "checks": 2}
    assert artifact["calibration"]["precision"] == "fp8" and artifact["calibration"]["recipe"]["samples"] == 4
    expected = hashlib.sha256()   # the float checkpoint the served model was calibrated from
    for name in ("config.json", "rank0.safetensors"):
        expected.update(name.encode() + b"\0" + sha256((pytorch_build / "checkpoint" / name).read_bytes()).encode())
    assert artifact["model"]["checkpoint_sha256"] == expected.hexdigest()
    assert str(tmp_path_factory.getbasetemp()) in str(pytorch_build)
    machine = [str(tmp_path_factory.getbasetemp()).encode(), os.path.expanduser("~").encode()]
    assert not [n for n, d in content.items() if any(m in d for m in machine)]


@pytest.mark.parametrize("target", ["rtx4090", "l40s", "h100", "h200"])
def test_pytorch_archive_verifies_on_any_fp8_gpu(pytorch_archive, target):
    result = invoke("verify", pytorch_archive, "--target", target, "--sha256", sha256(pytorch_archive.read_bytes()))
    assert result.exit_code == 0 and "verified: every file matches its sha256; origin: the pinned sha256" in \
        result.output, result.output


FP8_NEEDS = "FP8 weights or KV cache need compute capability 8.9 or newer (Ada, Hopper)"


@pytest.mark.parametrize("target,message", [
    ("a100-80g", f"but a100-80g (sm 80) cannot run it: {FP8_NEEDS}"),
    ("rtx3090", f"but rtx3090 (sm 86) cannot run it: {FP8_NEEDS}"),
    ("cpu", "a pytorch artifact runs on gpu targets; cpu is a cpu target"),
])
def test_pytorch_archive_is_refused_where_it_cannot_run(pytorch_archive, target, message):
    result = invoke("verify", pytorch_archive, "--target", target)
    assert result.exit_code == 1, result.output
    failed = [line for line in result.output.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and message in failed[0], result.output
    if target != "cpu":   # the capability table's rule, with its source
        assert "rule fp8-sm89: TensorRT-LLM 1.2.1 docs/source/reference/support-matrix.md" in failed[0]


def edit_manifest(archive: Path, out: Path, edit) -> Path:
    def change(info, data):
        return (info, (json.dumps(edit(json.loads(data))) + "\n").encode()) if info.name == MANIFEST else (info, data)

    return rewrite(archive, out, change)


@pytest.mark.parametrize("edit,target,code,message", [
    (lambda a: {**a, "precision": "fp16"}, "a100-80g", 0, None),                 # FP8 is what needs sm 89
    (lambda a: {**a, "precision": "fp16", "kv_cache": "fp8"}, "a100-80g", 1, "and KV cache fp8, but a100-80g"),
    (lambda a: {k: v for k, v in a.items() if k != "backend"}, "h100", 1,       # older archive: an engine
     "built for sm 89 (rtx4090), but h100 is sm 90"),
    (lambda a: {**a, "tensorrt_llm_version": "1.3.0"}, "rtx4090", 1, "built with TensorRT-LLM 1.3.0"),
])
def test_pytorch_archive_target_rule_reads_the_manifest(pytorch_archive, tmp_path, edit, target, code, message):
    result = invoke("verify", edit_manifest(pytorch_archive, tmp_path / "edited.tar", edit), "--target", target)
    assert result.exit_code == code, result.output
    if message:
        assert message in result.output, result.output


def test_pytorch_archive_unpacks_to_a_repository_that_serves_its_own_model(pytorch_archive, tmp_path):
    out = tmp_path / "deploy"
    unpacked = invoke("unpack", pytorch_archive, "-o", out, "--target", "h100", "--trust-unsigned")
    assert unpacked.exit_code == 0, unpacked.output
    content = members(pytorch_archive)
    assert all((out / n).read_bytes() == d for n, d in content.items() if n != MANIFEST)
    version = out / "model_repo" / "tensorrt_llm" / "1"
    model_yaml = yaml.safe_load((version / "model.yaml").read_text())
    assert model_yaml["model"] == "model" and model_yaml["backend"] == "pytorch"
    assert (version / model_yaml["model"] / "config.json").is_file()
    assert (version / model_yaml["model"] / "model.safetensors").is_file()
    script = (out / "model_repo" / "trtllm-serve.sh").read_text()
    assert "exec trtllm-serve tensorrt_llm/1/model " in script
    assert (out / "model_repo" / "tensorrt_llm" / "1" / "model" / "tokenizer.json").is_file()
    assert not [p for p in out.rglob("*") if p.is_file() and str(tmp_path).encode() in p.read_bytes()]
    check = invoke("check", out / "model_repo")
    assert check.exit_code == 0, check.output


# ------------------------------------------------------------------------------------------ origin (case 10)

def forged(archive: Path, out: Path) -> Path:
    """ARCHIVE with a changed model.py and an artifact.json rewritten to match it: consistent, but not the
    signer's (issue 25 case 10: such an archive verified and unpacked with exit 0)."""
    content = members(archive)
    artifact = json.loads(content[MANIFEST])
    name = "model_repo/tensorrt_llm/1/model.py"
    content[name] += b"\nimport os  # forged\n"
    artifact["files"][name] = {"size": len(content[name]), "sha256": sha256(content[name])}
    content[MANIFEST] = (json.dumps(artifact, indent=2) + "\n").encode()
    with tarfile.open(out, "w") as tar:
        for member, data in content.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_a_forged_archive_is_consistent_but_its_origin_is_refused(archive, keys, tmp_path):
    fake = forged(archive, tmp_path / "forged.tar")
    consistent = invoke("verify", fake)
    assert consistent.exit_code == 0 and "origin NOT proven" in consistent.output
    signed = invoke("verify", fake, "--public-key", keys[1])
    assert signed.exit_code == 1 and "does not verify with the key given" in signed.output, signed.output
    pinned = invoke("unpack", fake, "-o", tmp_path / "out", "--sha256", sha256(archive.read_bytes()))
    assert pinned.exit_code == 1 and "is not the pinned" in pinned.output and not (tmp_path / "out").exists()
    stripped = rewrite(archive, tmp_path / "unsigned.tar", lambda info, data: None if info.name == SIGNATURE
                       else (info, data))
    unsigned = invoke("unpack", stripped, "-o", tmp_path / "out", "--public-key", keys[1])
    assert unsigned.exit_code == 1 and "not signed" in unsigned.output and not (tmp_path / "out").exists()
