"""The commands that ship a build: k8s, versions, matrix, ci, package, verify, unpack."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .versions import versions
from ..errors import UserError
from .base import DEFAULT_IMAGE, echo_result, json_option, main, price_option, report_verification


@main.command()
@click.argument("build_or_repo", metavar="BUILD_OR_REPO", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Directory for the manifests (kustomization.yaml, ...), the alerts and the dashboard.")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True,
              help="The trtpipe image (the Dockerfile's: Triton 26.07 with TensorRT-LLM 1.2.1), pushed where the "
                   "cluster pulls from.")
@click.option("--replicas", default="1:4", show_default=True, metavar="MIN:MAX", help="Autoscaling bounds.")
@click.option("--namespace", default="default", show_default=True, help="Namespace of every object.")
@click.option("--repo-source", default=None, metavar="pvc|pvc:CLAIM|artifact:URL#sha256=HEX",
              help="Where pods find the model repository: pvc (default) writes a new PersistentVolumeClaim to fill "
                   "with the loader pod; pvc:CLAIM uses an existing, already filled claim; artifact:URL#sha256=HEX "
                   "has every pod fetch a `trtpipe package` archive and `trtpipe unpack --target --sha256` it (the "
                   "digest `trtpipe package` printed) before Triton starts.")
@click.option("--scale-ratio", type=click.FloatRange(min=0, min_open=True), default=None,
              help="queue:compute ratio the autoscaler holds (default: from the plan's --p99-latency, else 1.0).")
@click.option("--name", default=None, help="Name of every object (default: <model>-<target>).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--canary-of", type=click.Path(path_type=Path), default=None, metavar="A",
              help="Write this build as the canary of A (deployed already with `trtpipe k8s`): a Gateway API "
                   "HTTPRoute splitting requests between the two Services, and CANARY.md with the commands. A is A's "
                   "manifests directory (the -o of `trtpipe k8s BUILD_A`, which names A's Service) or BUILD_A (its "
                   "k8s/ when present, else the default name).")
@click.option("--weight", type=int, default=10, show_default=True,
              help="With --canary-of: % of requests to this build.")
@click.option("--gateway", default="trtpipe", show_default=True, metavar="[NAMESPACE/]NAME",
              help="With --canary-of: the Gateway the HTTPRoute attaches to.")
@price_option("What an hour of one pod (its GPUs) costs, in US dollars: the dashboard then shows the cost per "
              "million output tokens.")
@json_option("what was written")
def k8s(build_or_repo, out, image, replicas, namespace, repo_source, scale_ratio, name, force, canary_of, weight,
        gateway, price_per_hour, as_json):
    """Kubernetes manifests for a built model repository: Triton, autoscaling, alerts, a Grafana dashboard.

    \b
    BUILD_OR_REPO is a `trtpipe build` directory or a `trtpipe deploy` repository; its plan sizes the pods
    (GPUs = tp x pp, memory, /dev/shm, startup and drain times). Writes kustomization.yaml with the
    Deployment, Service, HorizontalPodAutoscaler (on triton:queue_compute:ratio), PodDisruptionBudget,
    PodMonitor, PrometheusRule and the model-repository volume; model-repo-loader.yaml and
    grafana-dashboard.json beside them. Nothing is built in the cluster (docs/kubernetes.md).
    Examples:
      trtpipe k8s out/smollm2 -o out/smollm2/k8s
      trtpipe k8s out/llama3 -o k8s/llama3 --image registry.example.com/trtpipe:0.1.0 --replicas 2:8 --namespace llm
      kubectl apply -k out/smollm2/k8s
      trtpipe k8s out/fp8 -o k8s/fp8 --canary-of out/fp16 --weight 10 --name smollm2-135m-cpu-fp8
    """
    from ..k8s import K8sOptions, write_k8s

    options = K8sOptions(image=image, replicas=replicas, namespace=namespace, repo_source=repo_source,
                         scale_ratio=scale_ratio, name=name, force=force, canary_of=canary_of, weight=weight,
                         gateway=gateway, price_per_hour=price_per_hour)
    echo_result(write_k8s(build_or_repo, out, options), as_json)


main.add_command(versions)   # trtpipe versions list|add|serve|remove


@main.command(name="matrix")
@click.argument("matrix_file", type=click.Path(path_type=Path), default="trtpipe.toml")
@click.option("--json", "as_json", is_flag=True, help='Print {"include": [build...]}, the shape of a CI matrix.')
def matrix_(matrix_file, as_json):
    """The builds of MATRIX_FILE (trtpipe.toml, or pyproject.toml's [tool.trtpipe]); docs/usage.md shows one to
    start from (no checkout ships one).

    \b
    Examples:
      trtpipe matrix                        # ./trtpipe.toml
      trtpipe matrix pyproject.toml --json  # its [tool.trtpipe] table
    """
    from ..matrix import entry_for_ci, load_matrix

    matrix = load_matrix(matrix_file)
    if as_json:
        click.echo(json.dumps(matrix.to_dict(), indent=2))
        return
    for row in map(entry_for_ci, matrix.entries):
        click.echo(f"{row['name']:<24} {row['model']} -> {row['target']} (sm {row['sm']}) {row['precision']}, "
                   f"kv {row['kv_cache']}, tp {row['tp']} pp {row['pp']}, "
                   f"calibration {row['calibration'] or 'default'}")


@main.group()
def ci():
    """CI workflows that build, validate, package and upload the build matrix."""


@ci.command()
@click.option("--matrix", "matrix_path", type=click.Path(path_type=Path), default=None,
              help="Build matrix (default: trtpipe.toml when it exists; without one, only the SmolLM2 job).")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path),
              default=Path(".github/workflows/trtpipe.yml"), show_default=True, help="The workflow file to write.")
@json_option("what was written")
def github(matrix_path, out, as_json):
    """Write the GitHub Actions workflow: SmolLM2 end to end on a hosted runner, the matrix's builds.

    \b
    GPU builds run on self-hosted runners labelled [self-hosted, linux, x64, gpu, TARGET] inside NVIDIA's
    TensorRT-LLM Triton container; see docs/ci.md. Run it from the repository root.
    Examples:
      trtpipe ci github
      trtpipe ci github --matrix trtpipe.toml -o .github/workflows/trtpipe.yml
    """
    from ..ci import github_workflow, workflow_matrix_path, write_workflow
    from ..matrix import load_matrix

    if matrix_path is None and Path("trtpipe.toml").is_file():
        matrix_path = Path("trtpipe.toml")
    matrix = load_matrix(matrix_path) if matrix_path else None
    write_workflow(github_workflow(matrix, workflow_matrix_path(matrix_path) if matrix else None), out)
    jobs = 1 + (len(matrix.entries) if matrix else 0)
    if as_json:
        click.echo(json.dumps({"out": str(out), "builds": jobs, "matrix": str(matrix_path) if matrix else None}))
        return
    click.echo(f"wrote {out}: {jobs} build(s) (SmolLM2 on the cpu target{' and the matrix' if matrix else ''})")


@main.command()
@click.argument("build_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="The .tar to write.")
@click.option("--key", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Sign the archive with this Ed25519 private key (PEM; `openssl genpkey -algorithm ed25519 -out "
                   "signing.pem`): verify and unpack then prove its origin with the public key.")
@json_option("the archive's record (files, bytes, sha256, artifact.json)")
def package(build_dir, out, key, as_json):
    """Pack BUILD_DIR (the model repository with the served checkpoint or Hugging Face model, the engine for the
    engine backend, build.json, the validation report) into one archive with artifact.json: every file's sha256,
    the model's fingerprint, versions, target, SM and backend.

    \b
    Examples:
      trtpipe package out/smollm2-cpu-fp8 -o smollm2-cpu-fp8.tar --key signing.pem
      trtpipe package out/smollm2-cpu-fp8 -o smollm2-cpu-fp8.tar
    """
    from ..artifact import package_build

    echo_result(package_build(build_dir, out, key), as_json)


def origin_options(command):
    """--public-key and --sha256: what proves where an archive comes from (pipeline/artifact_signing.py)."""
    command = click.option("--sha256", default=None, metavar="HEX",
                           help="Refuse any archive but the one with this sha256 (as `trtpipe package` prints it).")(
        command)
    return click.option("--public-key", type=click.Path(path_type=Path, dir_okay=False), default=None,
                        help="Refuse an archive not signed by this Ed25519 public key (PEM; `openssl pkey -in "
                             "signing.pem -pubout -out signing.pub`).")(command)


@main.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("--target", default=None, help="Refuse an artifact this target cannot run (an engine built for "
              "another SM; a pytorch build with FP8 weights or KV cache on a GPU without FP8) or one built with "
              "another TensorRT-LLM version.")
@click.option("--json", "as_json", is_flag=True, help="Print what was found as JSON.")
@origin_options
def verify(archive, target, as_json, public_key, sha256):
    """Check every file of ARCHIVE against its artifact.json, and with --public-key or --sha256 where it comes
    from (exit 1 when anything does not match). Without them it proves consistency only, and says so.

    \b
    Examples:
      trtpipe verify smollm2-cpu-fp8.tar --public-key signing.pub
      trtpipe verify llama-3-8b-rtx4090-fp8.tar --target rtx4090 --sha256 3f1c...
    """
    from ..artifact import verify_archive
    from ..artifact_signing import origin_from_options

    report_verification(verify_archive(archive, target, origin=origin_from_options(public_key, sha256)), as_json)


@main.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="New directory to extract into.")
@click.option("--target", default=None, help="As for verify: refuse an artifact this target cannot run or one "
              "built with another TensorRT-LLM version.")
@click.option("--json", "as_json", is_flag=True, help="Print what was found as JSON.")
@origin_options
@click.option("--trust-unsigned", is_flag=True,
              help="Extract without proving the archive's origin (its hashes prove only that it is consistent).")
def unpack(archive, out, target, as_json, public_key, sha256, trust_unsigned):
    """Verify ARCHIVE and its origin (--public-key or --sha256), then extract it into OUT (nothing is extracted
    from an archive that fails).

    \b
    Examples:
      trtpipe unpack smollm2-cpu-fp8.tar -o deploy/smollm2 --public-key signing.pub
      trtpipe unpack smollm2-cpu-fp8.tar -o deploy/smollm2 --sha256 3f1c...
    """
    from ..artifact import unpack_archive
    from ..artifact_signing import origin_from_options

    origin = origin_from_options(public_key, sha256)
    if not origin.asked and not trust_unsigned:
        raise UserError("unpack extracts a deployment: prove where the archive comes from with --public-key "
                        "(the signer's Ed25519 key) or --sha256 (the digest `trtpipe package` printed), or pass "
                        "--trust-unsigned to extract it on its hashes alone")
    result = unpack_archive(archive, out, target, origin)
    report_verification(result, as_json)
    click.echo(f"extracted into {out}")
