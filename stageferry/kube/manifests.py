"""The per-stage Kubernetes objects, made from the pipeline file and the values (:mod:`.values`).

One :func:`stage_objects` call per stage of the pipeline file: its Deployment (one pod = one stage group,
its ranks the processes ``stageferry serve`` starts in that pod) and its PodDisruptionBudget; the
profiles' patches (:func:`cpu_patch`, :func:`gpu_patch`) size it; :func:`scaled_object` scales it on its
stream's backlog with KEDA.  What is the same for every deployment (Redis, the gateway, the
NetworkPolicy) is written by hand under ``deploy/kubernetes/`` and only referenced here by name.

Every object carries the four recommended labels (:func:`labels`; the base's kustomization sets
``name``, ``instance`` and ``part-of`` again on the hand-written ones and on pod templates).  Selectors
name ``instance`` and ``component``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stageferry.broker.control.keys import Keys
from stageferry.config import PipelineConfig, StageConfig
from stageferry.kube.values import Values, mebibytes, object_name, quantity_bytes, shm_bytes

APP = "stageferry"
#: Names of the hand-written objects the generated ones refer to.
REDIS_SECRET = "stageferry-redis"  #: keys ``users.acl``, ``url``, ``password``, ``scaler-password``
PIPELINE_CONFIGMAP = "stageferry-pipeline"
PIPELINE_PATH = "/etc/stageferry/pipeline.toml"
SCALER_AUTH = "stageferry-redis-scaler"
#: The label every stage pod carries: the NetworkPolicy opens NIXL's ports between such pods only.
ROLE_LABEL = "stageferry.io/role"
#: Grace on top of the longest job: the supervisor's own stop, the ranks' exit, the agent's withdrawal.
DRAIN_SLACK_S = 60
Obj = dict[str, Any]
_DRAIN = "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"


def workload_name(stage: StageConfig) -> str:
    return f"{APP}-{object_name(stage.name)}"


def _selector(stage: StageConfig) -> dict[str, str]:
    return {"app.kubernetes.io/instance": APP, "app.kubernetes.io/component": object_name(stage.name)}


def labels(component: str) -> dict[str, str]:
    """The recommended labels of an object of ``component``."""
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/instance": APP,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": APP,
    }


def _meta(stage: StageConfig, kind_label: bool = True) -> Obj:
    labels_ = labels(object_name(stage.name))
    if kind_label:
        labels_[ROLE_LABEL] = "stage"
    return {"name": workload_name(stage), "labels": labels_}


def _health(stage: StageConfig, *, period: int, failures: int) -> Obj:
    return {
        "exec": {"command": ["stageferry", "health", "--stage", stage.name, "--timeout", "10"]},
        "periodSeconds": period,
        "timeoutSeconds": 30,  # the CLI's imports alone take seconds on a busy node
        "failureThreshold": failures,
    }


def _env(values: Values) -> list[Obj]:
    """What every stage container reads; the pod's own name and IP come from the downward API."""
    return [
        {"name": "STAGEFERRY_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": "url"}}},
        {"name": "STAGEFERRY_PREFIX", "value": values.prefix},
        {"name": "STAGEFERRY_PIPELINE", "value": PIPELINE_PATH},
        {"name": "STAGEFERRY_LOG_FORMAT", "value": "json"},
        {"name": "STAGEFERRY_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "STAGEFERRY_ADVERTISE_ADDRESS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "UCX_TCP_PORT_RANGE", "value": values.ucx_tcp_ports},
        {"name": "NIXL_LOG_LEVEL", "value": "WARN"},
    ]


def deployment(pipeline: PipelineConfig, stage: StageConfig, values: Values) -> Obj:
    """One stage's Deployment: each pod one stage group (``stageferry serve <stage>`` starts its ranks)."""
    v = values.for_stage(stage)
    assert v.job_seconds is not None and v.spread is not None
    container: Obj = {
        "name": "stage",
        "image": "stageferry",
        "imagePullPolicy": "IfNotPresent",
        "command": ["stageferry", "serve", stage.name],
        "env": _env(values),
        "startupProbe": _health(stage, period=10, failures=60),  # up to 10 min to import and build the models
        "readinessProbe": _health(stage, period=15, failures=4),
        # past timeouts.redis_unreachable (the worker exits on its own then): a restart is for a stuck worker
        "livenessProbe": _health(stage, period=30, failures=6),
        "lifecycle": {
            # The drain: SIGTERM to the supervisor (PID 1), which finishes the entry in hand and exits 0; the
            # hook waits for it, so the grace period below is what bounds the job in hand.
            "preStop": {"exec": {"command": ["/bin/sh", "-c", _DRAIN]}}
        },
        "volumeMounts": [
            {"name": "pipeline", "mountPath": PIPELINE_PATH, "subPath": "pipeline.toml", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "outputs", "mountPath": "/app/out"},
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod: Obj = {
        "metadata": {"labels": {**_selector(stage), ROLE_LABEL: "stage"}},
        "spec": {
            "terminationGracePeriodSeconds": v.job_seconds + DRAIN_SLACK_S,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "runAsGroup": 10001,
                "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": v.spread,
                    "labelSelector": {"matchLabels": _selector(stage)},
                }
            ],
            "containers": [container],
            "volumes": [
                {"name": "pipeline", "configMap": {"name": PIPELINE_CONFIGMAP}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": mebibytes(shm_bytes(pipeline, stage))}},
                {"name": "outputs", "emptyDir": {}},
            ],
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(stage),
        "spec": {
            "replicas": v.replicas,
            "selector": {"matchLabels": _selector(stage)},
            # a new pod first, then an old one drains: no capacity lost, no entry dropped
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod,
        },
    }


def disruption_budget(stage: StageConfig) -> Obj:
    """Voluntary evictions (node drains, upgrades) take one replica of the stage at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(stage, kind_label=False),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(stage)}},
    }


def scaled_object(stage: StageConfig, values: Values, intakes: Sequence[str] = ()) -> Obj:
    """KEDA scales the stage's Deployment on its stream: entries its group holds unacked (pending) and
    entries not yet delivered to it (lag); the larger demand wins.  The first stage is also scaled on its
    ``intakes``, the lists clients push submissions onto (:mod:`stageferry.broker.control.intake`): what
    waits there has not reached the stream yet (KEDA's ``redis`` list-length trigger, one per list)."""
    v = values.for_stage(stage)
    stream = Keys(values.prefix).stage_stream(stage.name)
    common = {"stream": stream, "consumerGroup": stage.name}  # the address comes with the credentials
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(stage, kind_label=False),
        "spec": {
            "scaleTargetRef": {"name": workload_name(stage)},
            "minReplicaCount": v.min_replicas,
            "maxReplicaCount": v.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {
                            "stabilizationWindowSeconds": 300,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                        }
                    }
                }
            },
            "triggers": [
                {
                    "type": "redis-streams",
                    "name": "pending",
                    "metadata": {**common, "pendingEntriesCount": str(v.pending_per_replica)},
                    "authenticationRef": {"name": SCALER_AUTH},
                },
                {
                    "type": "redis-streams",
                    "name": "lag",
                    "metadata": {**common, "lagCount": str(v.lag_per_replica)},
                    "authenticationRef": {"name": SCALER_AUTH},
                },
                *(
                    {
                        "type": "redis",
                        "name": f"intake-{i}",
                        "metadata": {"listName": intake, "listLength": str(v.lag_per_replica)},
                        "authenticationRef": {"name": SCALER_AUTH},
                    }
                    for i, intake in enumerate(intakes)
                ),
            ],
        },
    }


def _patch(stage: StageConfig, container: Obj, pod: Obj | None = None) -> Obj:
    spec: Obj = {"containers": [{"name": "stage", **container}]}
    if pod:
        spec.update(pod)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": workload_name(stage)},
        "spec": {"template": {"spec": spec}},
    }


def _memory(per_rank: str | None, pipeline: PipelineConfig, stage: StageConfig) -> str:
    """Per-rank memory times ranks, plus the in-memory ``/dev/shm`` (it counts against the limit)."""
    assert per_rank is not None
    return mebibytes(quantity_bytes(per_rank) * stage.world_size + shm_bytes(pipeline, stage))


def cpu_patch(pipeline: PipelineConfig, stage: StageConfig, values: Values) -> Obj:
    """CPU profile: CPU and memory per rank times the stage's ranks; payloads over UCX's TCP transport."""
    v = values.for_stage(stage)
    assert v.cpu_per_rank is not None
    memory = _memory(v.memory_per_rank, pipeline, stage)
    cpu = _cpu_times(v.cpu_per_rank, stage.world_size)
    return _patch(
        stage,
        {
            "env": [{"name": "UCX_TLS", "value": "tcp"}],
            "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}},
        },
    )


def gpu_patch(pipeline: PipelineConfig, stage: StageConfig, values: Values) -> Obj:
    """GPU profile: one GPU per rank (``nvidia.com/gpu: <world_size>``, the NVIDIA device plugin places
    them); UCX picks RDMA where the node has it, else TCP (with CUDA staging)."""
    v = values.for_stage(stage)
    memory = _memory(v.gpu_memory_per_rank, pipeline, stage)
    gpus = str(stage.world_size)
    return _patch(
        stage,
        {
            "env": [{"name": "UCX_TLS", "value": "rc,ud,tcp,cuda_copy,self"}],
            "resources": {
                "requests": {"cpu": str(2 * stage.world_size), "memory": memory, "nvidia.com/gpu": gpus},
                "limits": {"memory": memory, "nvidia.com/gpu": gpus},
            },
        },
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    )


def _cpu_times(per_rank: str, ranks: int) -> str:
    if per_rank.endswith("m"):
        return f"{int(per_rank[:-1]) * ranks}m"
    total = float(per_rank) * ranks
    return str(int(total)) if total.is_integer() else f"{int(total * 1000)}m"


def nixl_policy(values: Values) -> Obj:
    """NIXL's ports (UCX's TCP listeners, ``UCX_TCP_PORT_RANGE``) open between stage pods, to no one else."""
    low, high = (int(p) for p in values.ucx_tcp_ports.split("-"))
    stage_pods = {"matchLabels": {"app.kubernetes.io/instance": APP, ROLE_LABEL: "stage"}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{APP}-nixl", "labels": labels("data-plane")},
        "spec": {
            "podSelector": stage_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": stage_pods}], "ports": [{"protocol": "TCP", "port": low, "endPort": high}]}
            ],
        },
    }


def gateway_patch(values: Values) -> Obj:
    """The gateway's key prefix, from the values as the stages' is (``base/gateway.yaml`` is written by hand:
    a prefix there drifted from the stages' when ``values.prefix`` changed, and its jobs reached no stage)."""
    env = [{"name": "STAGEFERRY_PREFIX", "value": values.prefix}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "stageferry-gateway"},
        "spec": {"template": {"spec": {"containers": [{"name": "gateway", "env": env}]}}},
    }


def stage_objects(pipeline: PipelineConfig, values: Values) -> list[Obj]:
    """The base's per-stage objects, stage by stage in the pipeline's order, then the NIXL policy."""
    out: list[Obj] = []
    for stage in pipeline.stages:
        out += [deployment(pipeline, stage, values), disruption_budget(stage)]
    return [*out, nixl_policy(values)]
