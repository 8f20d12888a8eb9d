"""The Kubernetes objects of one deployment, as Python data (dumped once with PyYAML by `write_k8s`).

Sizes come from the plan (`PodSizing.from_plan`); every figure that is an assumption rather than a plan
value is a named constant below with its reason, and docs/kubernetes.md explains each choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..backends import backend_for
from ..backends.names import INFLIGHT_BATCHER, PORTS
from ..openai_front.protocol import DEFAULT_OPENAI_PORT
from ..plan import Plan
from ..tritonconfig import to_pbtxt
from .source import VOLUME_ROOT, DeploymentSource, Replicas, RepoSource

GIB = 1 << 30
HTTP, GRPC, METRICS = PORTS["http"], PORTS["grpc"], PORTS["metrics"]
#: The OpenAI-compatible API's port (Triton's OpenAI frontend's default, `openai_front.protocol`).
OPENAI = DEFAULT_OPENAI_PORT
#: The openai container's share of the pod: an aiohttp loop relaying JSON and the tokenizer's chat template (no
#: model); one CPU and 1 GiB hold transformers' import and the tokenizer with room to spare (measured here: about
#: 450 MB resident for SmolLM2's).
OPENAI_CPU, OPENAI_MEMORY = "1", "1Gi"
#: GPU-feature-discovery's `nvidia.com/gpu.product` label for each GPU target: NVML's product name with
#: spaces as '-' (the tutorial's chart matches `Tesla-T4` the same way). Not checked on a cluster here.
GPU_PRODUCTS = {
    "rtx4090": ["NVIDIA-GeForce-RTX-4090"],
    "rtx3090": ["NVIDIA-GeForce-RTX-3090"],
    "l40s": ["NVIDIA-L40S"],
    "a100-40g": ["NVIDIA-A100-SXM4-40GB"],
    "a100-80g": ["NVIDIA-A100-SXM4-80GB"],
    "h100": ["NVIDIA-H100-80GB-HBM3"],
    "h200": ["NVIDIA-H200"],
}
#: /dev/shm per rank: NVIDIA's `docker run --shm-size=2g` for the tensorrtllm backend (its README); the
#: Python backend's tensors and, with tp x pp > 1, NCCL's intra-node buffers live there.
SHM_PER_RANK = 2 * GIB
#: Host memory per requested CPU for a GPU pod, and the CPUs it asks for at least (the tutorial's chart).
MEMORY_PER_CPU = 8 * GIB
MIN_CPUS = 4
#: Host memory beyond the engine while it is read and handed to the GPUs (Triton, Python, MPI).
HOST_HEADROOM = 4 * GIB
#: Startup: a fixed part (container start, CUDA and backend initialisation) plus reading the weights at
#: a rate a network volume sustains. An assumption to adjust, not a measurement.
STARTUP_FIXED_S = 120
LOAD_BYTES_PER_S = 100e6
PROBE_PERIOD_S = 10
#: the liveness probe (`trtpipe probe`): every 30 s, 20 s for its answer (a slower one passes: busy, not dead)
LIVENESS_PERIOD_S, LIVENESS_TIMEOUT_S = 30, 20
#: Seconds the pod keeps serving after it is told to stop, while the Service stops sending it requests.
PRESTOP_S = 10
#: Who the pods run as: not root. NVIDIA's Triton images create the unprivileged user triton-server (uid 1000) for
#: this; fsGroup makes the repository volume the init container fills writable by that group.
RUN_AS = 1000
#: What the short-lived helper containers (the artifact fetcher, the loader) may use.
HELPER_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
#: The shortest drain Triton is given (its own --exit-timeout-secs default).
MIN_DRAIN_S = 30


@dataclass(frozen=True)
class PodSizing:
    """Resources and timings of one Triton pod, from the plan."""

    gpus: int
    cpus: int
    memory_bytes: int
    shm_bytes: int
    startup_s: int        # how long engine/checkpoint loading may take before liveness counts
    drain_s: int          # Triton's --exit-timeout-secs: the longest request, estimated
    grace_s: int          # terminationGracePeriodSeconds: preStop + drain + margin

    @classmethod
    def from_plan(cls, plan: Plan) -> PodSizing:
        ranks = plan.tp_size * plan.pp_size
        gpu = plan.target.is_gpu
        shm = SHM_PER_RANK * ranks
        cpus = max(MIN_CPUS, ranks)
        if gpu:   # the engine passes through host memory on its way to the GPUs
            host = max(cpus * MEMORY_PER_CPU, plan.weights_bytes + HOST_HEADROOM)
        else:     # the reference runtime holds weights and KV cache in host memory
            m = plan.memory
            host = m.weights_bytes_per_rank + m.activation_bytes + m.runtime_reserve_bytes + m.kv_cache_bytes
        startup = STARTUP_FIXED_S + plan.weights_bytes / LOAD_BYTES_PER_S
        # the longest request: every token of the longest sequence at the planned batch's decode step
        # (prompt tokens counted as decode steps: an overestimate, which is the safe side here)
        drain = max(MIN_DRAIN_S, math.ceil(plan.max_seq_len * plan.decode_step_s))
        return cls(gpus=ranks if gpu else 0, cpus=cpus, memory_bytes=_gib_ceil(host + shm), shm_bytes=shm,
                   startup_s=math.ceil(startup / PROBE_PERIOD_S) * PROBE_PERIOD_S, drain_s=drain,
                   grace_s=PRESTOP_S + drain + PROBE_PERIOD_S)


def _gib_ceil(n: float) -> int:
    return math.ceil(n / GIB) * GIB


def quantity(n_bytes: int) -> str:
    return f"{math.ceil(n_bytes / GIB)}Gi"


def labels(name: str) -> dict:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "server",
            "app.kubernetes.io/part-of": "trtpipe"}


def selector(name: str) -> dict:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "server"}


def metadata(name: str) -> dict:
    return {"name": name, "labels": labels(name)}


# ----------------------------------------------------------------------------------------------
# The Triton container


def server_command(plan: Plan, sizing: PodSizing) -> list[str]:
    """The backend's own serve command (leader-mode mpirun for tp x pp > 1), draining for the pod's grace."""
    return backend_for(plan.backend).serve_command(plan, f"{VOLUME_ROOT}/model_repo",
                                                   (f"--exit-timeout-secs={sizing.drain_s}",))


def pod_security() -> dict:
    """The pod's securityContext: non-root, the runtime's default seccomp profile (Pod Security "restricted")."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict:
    """Every container: no privilege escalation, no capabilities, the root filesystem read-only (writable paths
    are volumes: /tmp, /dev/shm and the repository)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True}


def probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}


def liveness_probe() -> dict:
    """`trtpipe probe`: one token through the ensemble. Triton's /v2/health/live stays 200 when a Python model's
    process died (the pre/postprocessing stubs, the cpu model) while every request fails, and it is not
    restarted; a busy or shedding server passes (docs/upstream-facts.md)."""
    return {"exec": {"command": ["trtpipe", "probe", "--url", f"http://127.0.0.1:{HTTP}",
                                 "--timeout", str(LIVENESS_TIMEOUT_S)]},
            "periodSeconds": LIVENESS_PERIOD_S, "timeoutSeconds": LIVENESS_TIMEOUT_S + 5, "failureThreshold": 3}


def container(src: DeploymentSource, image: str, sizing: PodSizing) -> dict:
    resources = {"cpu": str(sizing.cpus), "memory": quantity(sizing.memory_bytes)}
    if sizing.gpus:
        resources["nvidia.com/gpu"] = str(sizing.gpus)
    mounts = [{"name": "model-repo", "mountPath": VOLUME_ROOT, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
    if src.engine_config is not None:
        mounts.append({"name": "engine-config", "mountPath": f"{VOLUME_ROOT}/model_repo/tensorrt_llm/config.pbtxt",
                       "subPath": "config.pbtxt", "readOnly": True})
    return {
        "name": "triton",
        "image": image,
        "command": server_command(src.plan, sizing),
        "workingDir": f"{VOLUME_ROOT}/model_repo",   # NVIDIA's models resolve tokenizer_dir against it (deploy)
        "ports": [{"name": "http", "containerPort": HTTP}, {"name": "grpc", "containerPort": GRPC},
                  {"name": "metrics", "containerPort": METRICS}],
        "startupProbe": probe("/v2/health/ready", PROBE_PERIOD_S, sizing.startup_s // PROBE_PERIOD_S),
        "livenessProbe": liveness_probe(),
        "readinessProbe": probe("/v2/health/ready", 5, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
        "resources": {"requests": resources, "limits": dict(resources)},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }


def speaks_openai_here(src: DeploymentSource) -> bool:
    """Whether the pod carries trtpipe's OpenAI front: repositories of the ensemble contract (the
    inflight_batcher_llm layout). An llmapi repository's OpenAI endpoint is trtllm-serve's."""
    return backend_for(src.plan.backend).layout == INFLIGHT_BATCHER


def openai_container(src: DeploymentSource, image: str, sizing: PodSizing) -> dict:
    """`trtpipe serve --openai --url`: the OpenAI-compatible API over the pod's Triton, with the repository's
    tokenizer and chat template; it waits for Triton as long as Triton's startup probe does."""
    resources = {"cpu": OPENAI_CPU, "memory": OPENAI_MEMORY}
    return {
        "name": "openai",
        "image": image,
        "command": ["trtpipe", "serve", f"{VOLUME_ROOT}/model_repo", "--openai", "--openai-port", str(OPENAI),
                    "--host", "0.0.0.0", "--url", f"http://127.0.0.1:{HTTP}", "--timeout", str(sizing.startup_s)],
        "ports": [{"name": "openai", "containerPort": OPENAI}],
        "readinessProbe": {"httpGet": {"path": "/health/ready", "port": "openai"}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
        "resources": {"requests": resources, "limits": dict(resources)},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "model-repo", "mountPath": VOLUME_ROOT, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def gpu_scheduling(target: str) -> dict:
    """Node affinity on the target's GPU product and the toleration of NVIDIA's GPU-node taint."""
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu", "operator": "Exists"},
                                  {"key": "nvidia.com/gpu.product", "operator": "In",
                                   "values": GPU_PRODUCTS[target]}]}]}}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }


def volumes(src: DeploymentSource, source: RepoSource, sizing: PodSizing) -> list[dict]:
    repo = ({"name": "model-repo", "emptyDir": {"sizeLimit": quantity(volume_size(src))}} if source.artifact_url
            else {"name": "model-repo", "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}})
    found = [repo, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(sizing.shm_bytes)}},
             # /tmp: the read-only root's scratch space, and where the init container downloads the archive
             {"name": "tmp", "emptyDir": {"sizeLimit": quantity(volume_size(src)) if source.artifact_url else "1Gi"}}]
    if src.engine_config is not None:
        found.append({"name": "engine-config", "configMap": {"name": f"{src.name}-engine-config"}})
    return found


def deployment(src: DeploymentSource, image: str, replicas: Replicas, source: RepoSource,
               sizing: PodSizing) -> dict:
    pod_spec = {
        "terminationGracePeriodSeconds": sizing.grace_s,
        "securityContext": pod_security(),
        **({"initContainers": [artifact_fetcher(src, image, source)]} if source.artifact_url else {}),
        "containers": [container(src, image, sizing),
                       *([openai_container(src, image, sizing)] if speaks_openai_here(src) else [])],
        "volumes": volumes(src, source, sizing),
        **(gpu_scheduling(src.plan.target.name) if sizing.gpus else {}),
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(src.name),
        "spec": {"replicas": replicas.minimum, "selector": {"matchLabels": selector(src.name)},
                 "template": {"metadata": {"labels": labels(src.name)}, "spec": pod_spec}},
    }


# ----------------------------------------------------------------------------------------------
# The other objects


def service(name: str, openai: bool) -> dict:
    named = (("http", HTTP), ("grpc", GRPC), ("metrics", METRICS), *((("openai", OPENAI),) if openai else ()))
    ports = [{"name": n, "port": p, "targetPort": n} for n, p in named]
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name),
            "spec": {"selector": selector(name), "ports": ports}}


def autoscaler(name: str, replicas: Replicas, metric: str, target_ratio: float) -> dict:
    """autoscaling/v2 on the per-pod queue:compute ratio (served to the HPA by prometheus-adapter)."""
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": metadata(name),
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                 "minReplicas": replicas.minimum, "maxReplicas": replicas.maximum,
                 "metrics": [{"type": "Pods", "pods": {
                     "metric": {"name": metric},
                     "target": {"type": "AverageValue", "averageValue": f"{round(target_ratio * 1000)}m"}}}]},
    }


def disruption_budget(name: str) -> dict:
    """One pod at a time may be evicted: never blocks a node drain (minAvailable 1 with one replica would)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata(name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}}}


def artifact_fetcher(src: DeploymentSource, image: str, source: RepoSource) -> dict:
    """An init container that downloads the archive, has `trtpipe unpack` verify every file and the pinned digest
    (and refuse an artifact built for another GPU architecture or TensorRT-LLM version than the target's) and
    moves model_repo/ and engine/ to where Triton reads them. A failed check fails the pod before Triton starts."""
    staging = f"{VOLUME_ROOT}/.unpack"
    script = ('python3 -c \'import os, urllib.request; urllib.request.urlretrieve(os.environ["ARTIFACT_URL"], '
              '"/tmp/artifact.tar")\' && '
              f'trtpipe unpack /tmp/artifact.tar --target {src.plan.target.name} --sha256 {source.artifact_sha256} '
              f'-o {staging} && '
              f'mv {staging}/* {VOLUME_ROOT}/ && rm -rf {staging} /tmp/artifact.tar')
    return {"name": "fetch-artifact", "image": image, "command": ["sh", "-c", script],
            "env": [{"name": "ARTIFACT_URL", "value": source.artifact_url}], "resources": HELPER_RESOURCES,
            "securityContext": container_security(),
            "volumeMounts": [{"name": "model-repo", "mountPath": VOLUME_ROOT}, {"name": "tmp", "mountPath": "/tmp"}]}


def volume_size(src: DeploymentSource) -> int:
    """What the repository volume is sized to: the repository (and engine), a quarter over, at least 1 GiB."""
    return max(GIB, round(src.volume_bytes * 1.25))


def volume_claim(src: DeploymentSource, source: RepoSource) -> dict:
    """ReadWriteMany: every replica mounts it (read-only) on whichever node it lands, and the loader fills it."""
    size = quantity(volume_size(src))
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata(source.claim),
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}}


def loader_pod(name: str, source: RepoSource) -> dict:
    """A pod that mounts the claim writable so `kubectl cp` can fill it (applied by hand, then deleted)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-loader", "labels": labels(name)},
            "spec": {"restartPolicy": "Never", "securityContext": pod_security(),
                     "containers": [{"name": "loader", "image": "busybox:1.36", "command": ["sleep", "86400"],
                                     "resources": HELPER_RESOURCES, "securityContext": container_security(),
                                     "volumeMounts": [{"name": "model-repo", "mountPath": VOLUME_ROOT}]}],
                     "volumes": [{"name": "model-repo", "persistentVolumeClaim": {"claimName": source.claim}}]}}


def engine_config_map(src: DeploymentSource) -> dict:
    """tensorrt_llm/config.pbtxt with gpt_model_path at the engine's place on the volume.

    deploy writes the engine's absolute path on the build machine; the pod finds the engine at
    /trtpipe/engine, so this copy is mounted over the repository's file.
    """
    config = type(src.engine_config)()
    config.CopyFrom(src.engine_config)
    config.parameters["gpt_model_path"].string_value = f"{VOLUME_ROOT}/engine"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(f"{src.name}-engine-config"),
            "data": {"config.pbtxt": to_pbtxt(config)}}
