"""The Kubernetes deployment behind Redis Sentinel (``components/redis-ha``, ``components/keda-sentinel``,
``overlays/cpu-ha``, ``overlays/gpu-ha``; docs/high-availability.md).

The hand-written component runs three Redis data pods (StatefulSet ``stageferry-redis``) and three
sentinels (StatefulSet ``stageferry-sentinel``), each under a headless Service of its name, so every pod
has a stable DNS name ``<statefulset>-<i>.<service>`` in its namespace and ``<statefulset>-<i>.<service>.
<namespace>.svc`` from any.  The pods announce the long one (``POD_NAMESPACE``, from the downward API):
the master's address the sentinels hand out is dialled by KEDA's operator too, from its own namespace.
This module holds those names once, for what is generated from them: the services' URL
(:func:`sentinel_url`, for ``stageferry kube secret --sentinel``), the sentinels' addresses KEDA's
triggers take from that Secret (:func:`sentinel_addresses`) and the triggers themselves
(:func:`sentinel_scaled_object_patch`, written by ``stageferry kube generate`` into
``components/keda-sentinel/scaledobjects.yaml``).
"""

from __future__ import annotations

from typing import Any

#: The Sentinel service (``sentinel monitor <name>``) the component's sentinels watch.
SERVICE = "stageferry"
SENTINEL_SET = "stageferry-sentinel"
DATA_SET = "stageferry-redis"
SENTINELS = 3
DATA_NODES = 3
SENTINEL_PORT = 26379
#: What a durable write waits for: every replica (the soak's 0-lost setting, docs/high-availability.md).
WAIT_REPLICAS = DATA_NODES - 1
#: Trigger types behind Sentinel, by the single Redis's type (KEDA >= 2.11).
_SENTINEL_TRIGGERS = {"redis-streams": "redis-sentinel-streams", "redis": "redis-sentinel"}
Obj = dict[str, Any]


def pod_dns(statefulset: str, index: int, namespace: str | None = None) -> str:
    """A StatefulSet pod's stable name under its headless Service (named like the StatefulSet); with its
    ``namespace``, the name any namespace resolves."""
    name = f"{statefulset}-{index}.{statefulset}"
    return f"{name}.{namespace}.svc" if namespace else name


def sentinel_addresses(namespace: str | None = None) -> str:
    """``host:port,...`` of the sentinels: the URL's hosts (their own namespace's names) or, with the
    ``namespace``, KEDA's ``addresses`` (the Secret's ``sentinel-addresses``, dialled from ``keda``)."""
    return ",".join(f"{pod_dns(SENTINEL_SET, i, namespace)}:{SENTINEL_PORT}" for i in range(SENTINELS))


def sentinel_url(user: str, password: str, *, db: int = 0) -> str:
    """The services' ``redis+sentinel://`` URL: the data nodes' user, every sentinel, every replica waited for."""
    return f"redis+sentinel://{user}:{password}@{sentinel_addresses()}/{SERVICE}/{db}?wait_replicas={WAIT_REPLICAS}"


def sentinel_trigger(trigger: Obj) -> Obj:
    """One of :func:`~stageferry.kube.manifests.scaled_object`'s triggers, asking the sentinels instead
    (their ``addresses`` come from the TriggerAuthentication: the Secret's, which names the namespace)."""
    kind = trigger["type"]
    if kind not in _SENTINEL_TRIGGERS:
        raise ValueError(f"no Sentinel variant of KEDA trigger type {kind!r}")
    metadata = {"sentinelMaster": SERVICE, **trigger["metadata"]}
    return {**trigger, "type": _SENTINEL_TRIGGERS[kind], "metadata": metadata}


def sentinel_scaled_object_patch(scaled_object: Obj) -> Obj:
    """The patch of ``components/keda-sentinel``: the ScaledObject's triggers, all through the sentinels
    (a custom resource's list is replaced whole by a strategic-merge patch)."""
    return {
        "apiVersion": scaled_object["apiVersion"],
        "kind": scaled_object["kind"],
        "metadata": {"name": scaled_object["metadata"]["name"]},
        "spec": {"triggers": [sentinel_trigger(t) for t in scaled_object["spec"]["triggers"]]},
    }
