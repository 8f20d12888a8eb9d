"""The canary: B deployed beside the stable A, and a Gateway API HTTPRoute that sends WEIGHT% of the
requests to B's Service and the rest to A's (weighted backendRefs, the standard Kubernetes traffic split;
no proxy of trtpipe's).

The route is written apart from the kustomization (httproute.yaml), so `kubectl delete -k` of the canary
removes B and leaves the route, by then sending everything to A. CANARY.md holds the commands to apply,
shift the weight, promote and roll back.

A's Service name is read from what `trtpipe k8s` wrote for A (`stable_name`): `--canary-of` takes A's
manifests directory (the -o of `trtpipe k8s BUILD_A`), or a build whose k8s/ holds them (`trtpipe build
--k8s`); for a build or repository without them it is the name `trtpipe k8s` gives by default, and CANARY.md
says it was assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import UserError
from .manifests import HTTP, labels
from .source import check_name, read_source

ROUTE_FILE = "httproute.yaml"
COMMANDS_FILE = "CANARY.md"
#: What `trtpipe k8s` writes that names A's Service (write_k8s: KUSTOMIZATION and service.yaml).
WRITTEN_MARK, SERVICE_FILE = "kustomization.yaml", "service.yaml"


@dataclass(frozen=True)
class StableName:
    """A's Service name and whether it was read from A's manifests (False: the default name, assumed)."""

    name: str
    read: bool


def stable_name(path: Path) -> StableName:
    """A's Service name: from service.yaml of the manifests `trtpipe k8s` wrote for A (PATH itself, or PATH/k8s of
    a build), else the default name of `trtpipe k8s` for the build or repository at PATH."""
    path = Path(path)
    for directory in (path, path / "k8s"):
        if (directory / WRITTEN_MARK).is_file() and (directory / SERVICE_FILE).is_file():
            return StableName(service_name(directory / SERVICE_FILE), True)
    if not (path / "plan.json").is_file() and not (path / "manifest.json").is_file():
        raise UserError(f"--canary-of {path} is neither A's manifests directory (kustomization.yaml and service.yaml, "
                        "written by `trtpipe k8s BUILD_A -o DIR`) nor a build directory or model repository")
    return StableName(read_source(path, None).name, False)


def service_name(service_file: Path) -> str:
    try:
        service = yaml.safe_load(service_file.read_text())
        name = service["metadata"]["name"] if service.get("kind") == "Service" else None
    except (yaml.YAMLError, AttributeError, KeyError, TypeError):
        name = None
    if not isinstance(name, str):
        raise UserError(f"{service_file} is not the Service `trtpipe k8s` writes (kind Service, metadata.name); "
                        "pass A's manifests directory as --canary-of")
    return check_name(name, f"the Service name in {service_file}")


@dataclass(frozen=True)
class Canary:
    stable: str          # A's Deployment/Service name (deployed with `trtpipe k8s BUILD_A`)
    canary: str          # B's
    weight: int          # % of requests to B
    gateway: str         # the Gateway the route attaches to: NAME or NAMESPACE/NAME
    stable_read: bool = True   # A's name was read from A's manifests (False: the default name, assumed)

    @property
    def route(self) -> str:
        return f"{self.stable}-ab"


def check_canary(stable: str, canary: str, weight: int, gateway: str, stable_read: bool = True) -> Canary:
    if not 0 <= weight <= 100:
        raise UserError(f"--weight is the percentage of requests sent to the canary, 0 to 100 (got {weight})")
    if stable == canary:
        raise UserError(f"the canary and the stable deployment are both named {stable!r}; pass --name for the "
                        "canary (e.g. its precision: --name <model>-<target>-fp8)")
    namespace, _, name = gateway.rpartition("/")
    check_name(name, "--gateway")
    if namespace:
        check_name(namespace, "--gateway namespace")
    return Canary(stable, canary, weight, gateway, stable_read)


def http_route(c: Canary) -> dict:
    """gateway.networking.k8s.io/v1 HTTPRoute: every path to A's and B's Services, weighted."""
    namespace, _, gateway = c.gateway.rpartition("/")
    parent = {"name": gateway, **({"namespace": namespace} if namespace else {})}
    backends = [{"kind": "Service", "name": name, "port": HTTP, "weight": weight}
                for name, weight in ((c.stable, 100 - c.weight), (c.canary, c.weight))]
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": c.route, "labels": {**labels(c.stable), "app.kubernetes.io/component": "route"}},
            "spec": {"parentRefs": [parent],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                "backendRefs": backends}]}}


def shift_command(c: Canary, namespace: str, weight: int) -> str:
    """kubectl patch of the two weights (backendRefs 0 is A, 1 is B)."""
    patch = (f'[{{"op":"replace","path":"/spec/rules/0/backendRefs/0/weight","value":{100 - weight}}},'
             f'{{"op":"replace","path":"/spec/rules/0/backendRefs/1/weight","value":{weight}}}]')
    return f"kubectl -n {namespace} patch httproute {c.route} --type=json -p '{patch}'"


def stable_note(c: Canary) -> str:
    if c.stable_read:
        return f"A's Service name, {c.stable}, was read from the manifests `trtpipe k8s` wrote for A."
    return (f"A's Service name, {c.stable}, is the name `trtpipe k8s BUILD_A` gives by default (assumed: no manifests "
            "of A were found). If A was deployed with --name, write this again with --canary-of A's manifests "
            "directory (the -o of `trtpipe k8s BUILD_A`).")


def commands(c: Canary, namespace: str, out: str) -> str:
    return "\n".join([
        f"# Canary: {c.weight}% of requests to {c.canary} (B), {100 - c.weight}% to {c.stable} (A)", "",
        f"A must be running already (`trtpipe k8s BUILD_A`, Service {c.stable}), and a Gateway "
        f"{c.gateway!r} of a Gateway API implementation must exist.", "", stable_note(c), "",
        "Deploy B (fill its model-repository volume first, see docs/kubernetes.md), then the route:", "",
        "```", f"kubectl apply -k {out}", f"kubectl -n {namespace} rollout status deployment/{c.canary}",
        f"kubectl apply -n {namespace} -f {out}/{ROUTE_FILE}", "```", "",
        "Shift the weight (here to 50%), watching B's latency and errors on the dashboard:", "",
        "```", shift_command(c, namespace, 50), "```", "",
        "Promote B (every request to B; retire A afterwards):", "", "```", shift_command(c, namespace, 100), "```", "",
        "Roll back (every request to A at once, then remove B; the route stays, pointing at A):", "",
        "```", shift_command(c, namespace, 0), f"kubectl delete -k {out}", "```", ""])
