"""Rendered manifests -> what `podman kube play` runs: one Pod per replica, as a cluster's controllers would.

podman 4.3's `kube play` runs Pods and Deployments but not StatefulSets, Secrets, the downward API's
status.podIP, Services, PodDisruptionBudgets, NetworkPolicies or KEDA's objects.  This script does the
controllers' part and nothing else, so that the pods podman runs are the rendered pod templates:

* each Deployment and StatefulSet becomes `replicas` Pods named `<workload>-<i>` (a StatefulSet of one
  replica behind a Service of the same name is named after the Service instead, which is how the other
  pods find it: podman resolves pod names, not Services);
* `secretKeyRef` and `configMapKeyRef` env values are filled in from the rendered Secret and ConfigMaps;
  `fieldRef` metadata.name, metadata.namespace and status.podIP from the pod's name, --namespace and the
  IP this script gives it (podman assigns it with --ip, the kubelet would report it);
* a StatefulSet pod's stable DNS names under its headless Service (`<pod>.<serviceName>` and, from any
  namespace, `<pod>.<serviceName>.<namespace>.svc`, which the sentinels and the data nodes of
  components/redis-ha announce) become `hostAliases` entries of every pod: podman's DNS knows pod names
  only;
* container ports are not published (podman would bind them on the host); probes' named ports become numbers;
* configMap and secret volumes become read-only files under OUTDIR/files (hostPath), volumeClaimTemplates
  PersistentVolumeClaims (podman volumes), emptyDirs a directory per pod (podman 4.3 would share one named
  volume between all pods), an in-memory one (`medium: Memory`, /dev/shm) a tmpfs of its sizeLimit that
  the caller mounts (OUTDIR/tmpfs.txt: `<path> <size>` per line) before playing the pod;
* the objects a cluster's control plane acts on (Service, PodDisruptionBudget, NetworkPolicy,
  ScaledObject, TriggerAuthentication) are listed, not played; the suite checks them
  (tests/kube/test_render.py).

  python podplay.py RENDERED.yaml [SECRET.yaml ...] --out DIR --subnet 10.89.42 [--namespace stageferry] \
      [--replicas stageferry-diffusion=2 ...] [--extra stageferry-diffusion:2]

writes DIR/<pod>.yaml per pod and prints one line per pod: `<pod> <ip> <workload>`.  --extra W:I writes
only pod I of workload W (a replacement), at host address 100+I.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import os
import sys
from pathlib import Path
from typing import Any

import yaml

NOT_PLAYED = {"Service", "PodDisruptionBudget", "NetworkPolicy", "ScaledObject", "TriggerAuthentication"}
Obj = dict[str, Any]


def load(paths: list[str]) -> list[Obj]:
    docs: list[Obj] = []
    for path in paths:
        docs += [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    return docs


def _data(obj: Obj) -> dict[str, str]:
    """A ConfigMap's or Secret's keys as text."""
    out = dict(obj.get("stringData") or {})
    for k, v in (obj.get("data") or {}).items():
        out[k] = base64.b64decode(v).decode() if obj["kind"] == "Secret" else v
    return out


class Cluster:
    def __init__(self, docs: list[Obj], out: Path, namespace: str = "stageferry") -> None:
        self.out = out
        self.namespace = namespace
        self.stores = {
            (d["kind"], d["metadata"]["name"]): _data(d) for d in docs if d["kind"] in ("Secret", "ConfigMap")
        }
        self.workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        self.skipped = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs if d["kind"] in NOT_PLAYED)

    def pod_name(self, workload: Obj, index: int) -> str:
        name = workload["metadata"]["name"]
        single = workload["kind"] == "StatefulSet" and (workload["spec"].get("replicas") or 1) == 1
        return name if single and name in self.services else f"{name}-{index}"

    def lookup(self, kind: str, name: str, key: str) -> str:
        try:
            return self.stores[(kind, name)][key]
        except KeyError:
            raise SystemExit(f"podplay: no {kind} {name} with key {key}") from None

    def stable_names(self, workload: Obj, index: int) -> list[str]:
        """A StatefulSet pod's DNS names under its headless Service, as a cluster's DNS serves them: in its
        namespace and from any."""
        service = workload["spec"].get("serviceName")
        if workload["kind"] != "StatefulSet" or service not in self.services:
            return []
        if self.services[service]["spec"].get("clusterIP") != "None":
            return []  # pods have DNS names under a headless Service only
        name = f"{self.pod_name(workload, index)}.{service}"
        return [name, f"{name}.{self.namespace}.svc"]

    def pod(
        self, workload: Obj, index: int, ip: str, files: Path, aliases: dict[str, list[str]] | None = None
    ) -> list[Obj]:
        """The Pod (and its PersistentVolumeClaims) of replica ``index``; ``aliases``: IP -> DNS names."""
        name = self.pod_name(workload, index)
        template = copy.deepcopy(workload["spec"]["template"])
        spec = template["spec"]
        if aliases:
            spec["hostAliases"] = [{"ip": a, "hostnames": names} for a, names in sorted(aliases.items())]
        docs: list[Obj] = []
        for container in spec.get("containers", []):
            for env in container.get("env", []):
                ref = env.pop("valueFrom", None)
                if ref is None:
                    continue
                if "secretKeyRef" in ref or "configMapKeyRef" in ref:
                    kind, r = (
                        ("Secret", ref["secretKeyRef"])
                        if "secretKeyRef" in ref
                        else ("ConfigMap", ref["configMapKeyRef"])
                    )
                    if r.get("optional") and (kind, r["name"]) not in self.stores:
                        env["value"] = None  # an optional Secret that does not exist: no variable
                        continue
                    env["value"] = self.lookup(kind, r["name"], r["key"])
                elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                    env["value"] = name
                elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                    env["value"] = self.namespace
                elif ref.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    env["value"] = ip
                else:
                    raise SystemExit(f"podplay: cannot fill env {env['name']} from {ref}")
            container["env"] = [e for e in container.get("env", []) if e.get("value") is not None]
            # podman 4.3 publishes every containerPort on the host (the cluster does not): only the
            # probes' named ports are resolved to numbers, then the list goes
            named = {p["name"]: p["containerPort"] for p in container.pop("ports", []) if "name" in p}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                check = container.get(probe, {}).get("tcpSocket") or container.get(probe, {}).get("httpGet")
                if check is not None and isinstance(check.get("port"), str):
                    check["port"] = named[check["port"]]
        volumes = []
        mounts_by_volume: dict[str, str] = {}
        for vol in spec.get("volumes", []):
            if "configMap" in vol or "secret" in vol:
                kind, ref_name = (
                    ("ConfigMap", vol["configMap"]["name"])
                    if "configMap" in vol
                    else ("Secret", vol["secret"]["secretName"])
                )
                items = (vol.get("configMap") or vol.get("secret") or {}).get("items")
                keys = (
                    [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in self.stores[(kind, ref_name)]]
                )
                where = files / name / vol["name"]
                where.mkdir(parents=True, exist_ok=True)
                for key, path in keys:
                    (where / path).write_text(self.lookup(kind, ref_name, key))
                    (where / path).chmod(0o644)
                volumes.append({"name": vol["name"], "hostPath": {"path": str(where), "type": "Directory"}})
                mounts_by_volume[vol["name"]] = str(where)
            elif "emptyDir" in vol:  # podman 4.3 makes a named volume of it, shared by every pod: one per pod here
                where = files / name / vol["name"]
                where.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(PermissionError):  # as root (smoke.sh): the pod's user owns it
                    os.chown(where, 10001, 10001)
                if vol["emptyDir"].get("medium") == "Memory":  # a tmpfs of its sizeLimit, mounted by the caller
                    size = vol["emptyDir"].get("sizeLimit", "64Mi").replace("Mi", "m").replace("Gi", "g")
                    with (self.out / "tmpfs.txt").open("a") as f:
                        f.write(f"{where} {size}\n")
                volumes.append({"name": vol["name"], "hostPath": {"path": str(where), "type": "Directory"}})
            else:
                volumes.append(vol)
        for claim in workload["spec"].get("volumeClaimTemplates", []):
            claim_name = f"{claim['metadata']['name']}-{name}"
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": {"name": claim_name},
                    "spec": claim["spec"],
                }
            )
            volumes.append({"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}})
        spec["volumes"] = volumes
        for container in spec.get("containers", []):
            for n, mount in enumerate(container.get("volumeMounts", [])):
                sub = mount.pop("subPath", None)
                if sub is not None:  # one file of a directory volume: that file as a volume of its own
                    source = f"{mounts_by_volume[mount['name']]}/{sub}"
                    mount["name"] = f"{mount['name']}-file{n}"
                    volumes.append({"name": mount["name"], "hostPath": {"path": source, "type": "File"}})
        spec.setdefault("restartPolicy", "Always")
        spec["hostname"] = name
        labels = dict(template.get("metadata", {}).get("labels", {}))
        docs.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec})
        return docs


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifests", nargs="+")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--subnet", required=True, help="the first three octets of the pods' /24, e.g. 10.89.42")
    ap.add_argument("--namespace", default="stageferry", help="the pods' namespace (`stageferry kube secret`'s)")
    ap.add_argument("--replicas", action="append", default=[], help="WORKLOAD=N instead of its own replicas")
    ap.add_argument("--extra", help="WORKLOAD:INDEX: only this one more pod (a replacement)")
    args = ap.parse_args(argv)
    cluster = Cluster(load(args.manifests), args.out, args.namespace)
    counts = {k: int(v) for k, v in (r.split("=", 1) for r in args.replicas)}
    files = args.out / "files"
    args.out.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[Obj, int, str]] = []
    host = 10
    order = sorted(cluster.workloads.values(), key=lambda w: w["kind"] != "StatefulSet")  # Redis first
    for workload in order:
        for i in range(counts.get(workload["metadata"]["name"], workload["spec"].get("replicas", 1))):
            plan.append((workload, i, f"{args.subnet}.{host}"))
            host += 1
    aliases = {ip: names for w, i, ip in plan if (names := cluster.stable_names(w, i))}
    if args.extra:
        wname, index = args.extra.split(":")
        plan = [(cluster.workloads[wname], int(index), f"{args.subnet}.{100 + int(index)}")]
    else:
        print("# not played (a cluster's control plane acts on these): " + ", ".join(cluster.skipped), file=sys.stderr)
    for workload, index, ip in plan:
        docs = cluster.pod(workload, index, ip, files, aliases)
        name = docs[-1]["metadata"]["name"]
        (args.out / f"{name}.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
        print(name, ip, workload["metadata"]["name"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
