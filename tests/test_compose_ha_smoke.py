"""compose/ha_smoke.sh (the compose `ha` profile through a failover under load in real containers, too slow
for the suite: its output is in benchmarks/results/issue36/) against the files it runs: the services it
starts, kills and asks are docker-compose.yml's, the sentinels and the service name it asks for are the
ones ha.env's URL names, the variables it sets are ones the compose file reads, and its pipeline is the
committed one with every stage at TP1."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from stageferry.broker.control.redis_url import parse_url
from stageferry.config import PipelineConfig

COMPOSE_DIR = Path(__file__).resolve().parent.parent / "compose"
SCRIPT = (COMPOSE_DIR / "ha_smoke.sh").read_text()
COMPOSE_TEXT = (COMPOSE_DIR / "docker-compose.yml").read_text()
SERVICES = yaml.safe_load(COMPOSE_TEXT)["services"]
HA_ENV = dict(
    line.split("=", 1) for line in (COMPOSE_DIR / "ha.env").read_text().splitlines() if "=" in line
    and not line.startswith("#")
)  # fmt: skip


def _array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\(([^)]*)\)$", SCRIPT, re.M)
    assert match is not None, name
    return match[1].split()


def test_it_runs_the_ha_env_over_the_compose_file_and_shares_the_load_with_the_kube_smoke() -> None:
    assert 'dc() { "${compose[@]}" --env-file ha.env -f docker-compose.yml -f docker-compose.ha.yml "$@"; }' in SCRIPT
    assert HA_ENV["COMPOSE_FILE"] == "docker-compose.yml:docker-compose.ha.yml"  # `up` with ha.env alone: the same
    assert 'source "$root/deploy/ha_load.sh"' in SCRIPT and "load_and_kill\naudit_jobs\n" in SCRIPT
    kube = (COMPOSE_DIR.parent / "deploy" / "kubernetes" / "ha_smoke.sh").read_text()
    assert 'source "$here/../ha_load.sh"' in kube and "load_and_kill\naudit_jobs\n" in kube


def test_the_services_it_starts_are_the_ha_profiles() -> None:
    nodes, sentinels, stages = _array("data_nodes"), _array("sentinels"), _array("stages")
    assert nodes[0] == "redis" and "profiles" not in SERVICES["redis"]  # the first primary, in every profile
    profiles = set(HA_ENV["COMPOSE_PROFILES"].split(","))
    for name in nodes[1:] + sentinels + stages:
        assert set(SERVICES[name]["profiles"]) & profiles, name
    assert len(nodes) == 3 and len(sentinels) == 3  # the 1 primary, 2 replicas, 3 sentinels
    assert {n for n in SERVICES if n.startswith("redis")} == set(nodes)
    assert {n for n in SERVICES if n.startswith("sentinel")} == set(sentinels)
    # each data node announces its service name, or with ha.env its fixed IP: what the sentinels name,
    # what the script maps back to the service (node_at) and awaits the old primary to replicate
    assert 'announced() { echo "${addr_of[$1]}"; }' in SCRIPT and 'then node_at "$m"; return 0; fi' in SCRIPT
    for name in nodes:
        command = SERVICES[name]["command"]
        var = "REDIS_ANNOUNCE" if name == "redis" else f"REDIS_REPLICA_{name[-1]}_ANNOUNCE"
        assert command[command.index("--replica-announce-ip") + 1] == "${" + var + ":-" + name + "}"
    for name in nodes[1:]:
        command = SERVICES[name]["command"]
        at = command.index("--replicaof")
        assert command[at + 1 : at + 3] == ["${REDIS_PRIMARY_HOST:-redis}", "6379"]
    assert SERVICES["gateway"]["ports"] == ["${GATEWAY_PUBLISH:-127.0.0.1:8091}:8091"]
    assert SERVICES["gateway"]["command"][-2:] == ["--port", "8091"] and 'gw="http://$GATEWAY_PUBLISH"' in SCRIPT


def test_it_asks_the_sentinels_the_url_names() -> None:
    url = parse_url(HA_ENV["STAGEFERRY_REDIS_URL"])
    assert url.sentinel is not None
    assert [host for host, _ in url.sentinel.sentinels] == _array("sentinels")
    (port,) = {port for _, port in url.sentinel.sentinels}
    service = url.sentinel.service
    monitor = SERVICES["sentinel-1"]["command"][0]
    assert f'"port {port}"' in monitor and f'"sentinel monitor {service} $${{PRIMARY_HOST}} 6379 2"' in monitor
    assert SERVICES["sentinel-1"]["environment"]["PRIMARY_HOST"] == "${REDIS_PRIMARY_HOST:-redis}"
    assert f"-p {port} --raw sentinel get-master-addr-by-name {service}" in SCRIPT
    assert f"-p {port} sentinel master {service}" in SCRIPT


def test_the_variables_it_sets_are_the_compose_files() -> None:
    exported = re.findall(r"^export ([A-Z_]+)=", SCRIPT, re.M)
    assert {"STAGEFERRY_IMAGE", "REDIS_IMAGE", "GATEWAY_PUBLISH", "STAGEFERRY_PIPELINE_FILE"} <= set(exported)
    for name in exported:
        if name != "COMPOSE_PROJECT_NAME":
            assert "${" + name + ":-" in COMPOSE_TEXT, name


def test_its_pipeline_is_the_committed_one_at_tp1(tmp_path: Path) -> None:
    (edit,) = re.findall(r"sed -e '([^']+)' pipeline.toml >\"\$work/pipeline.toml\"", SCRIPT)
    edited = tmp_path / "pipeline.toml"
    edited.write_text(subprocess.run(["sed", "-e", edit, str(COMPOSE_DIR / "pipeline.toml")], check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    ours, committed = PipelineConfig.load(edited), PipelineConfig.load(COMPOSE_DIR / "pipeline.toml")
    assert [s.name for s in ours.stages] == [s.name for s in committed.stages] == _array("stages")
    assert all(s.tp == 1 for s in ours.stages) and any(s.tp > 1 for s in committed.stages)
    for stage in _array("stages"):
        assert SERVICES[stage]["command"] == ["stageferry", "serve", stage]


HA_OVERLAY = yaml.safe_load((COMPOSE_DIR / "docker-compose.ha.yml").read_text())


def _expand(value: str) -> str:  # ${NAME:-default} with ha.env's values, as compose substitutes it
    match = re.fullmatch(r"\$\{([A-Z0-9_]+):-([^}]*)\}", value)
    return value if match is None else HA_ENV.get(match[1], match[2])


def test_with_ha_env_no_redis_or_sentinel_resolves_a_name() -> None:
    """The failover that did not happen (benchmarks/results/issue36/compose_ha_podman_run_aborted.txt): a
    replica re-resolves its master's name on its main thread each second while the master is gone, podman's
    DNS stalled that 5-10 s, the sentinels marked both replicas down and had none to promote.  With ha.env
    every data node and sentinel sits at a fixed IP of HA_SUBNET that the others replicate, monitor and
    announce it by, the sentinels resolve nothing, and the overlay's addresses are the ones announced."""
    import ipaddress

    subnet = ipaddress.ip_network(_expand(HA_OVERLAY["networks"]["default"]["ipam"]["config"][0]["subnet"]))
    assert str(subnet) == HA_ENV["HA_SUBNET"]
    assert HA_ENV["SENTINEL_RESOLVE_HOSTNAMES"] == "no"
    assert SERVICES["sentinel-1"]["environment"]["RESOLVE_HOSTNAMES"] == "${SENTINEL_RESOLVE_HOSTNAMES:-yes}"
    monitor = SERVICES["sentinel-1"]["command"][0]
    assert '"sentinel resolve-hostnames $${RESOLVE_HOSTNAMES}"' in monitor
    addresses = {}
    for name in _array("data_nodes"):
        command = SERVICES[name]["command"]
        addresses[name] = _expand(command[command.index("--replica-announce-ip") + 1])
    for name in _array("sentinels"):
        addresses[name] = _expand(SERVICES[name]["environment"]["HOSTNAME_ANNOUNCE"])
    assert len(set(addresses.values())) == 6
    for name, address in addresses.items():
        assert ipaddress.ip_address(address) in subnet, name
        assert _expand(HA_OVERLAY["services"][name]["networks"]["default"]["ipv4_address"]) == address, name
    assert set(HA_OVERLAY["services"]) == set(addresses)  # only the data nodes and sentinels are pinned
    assert HA_ENV["REDIS_PRIMARY_HOST"] == addresses["redis"]
    for name in _array("data_nodes")[1:]:
        command = SERVICES[name]["command"]
        assert _expand(command[command.index("--replicaof") + 1]) == addresses["redis"]
    assert _expand(SERVICES["sentinel-1"]["environment"]["PRIMARY_HOST"]) == addresses["redis"]
    # without ha.env (the file alone) the names stay: the single-Redis profiles are unchanged
    assert "ipv4_address" not in COMPOSE_TEXT and "ipam" not in COMPOSE_TEXT


def test_a_data_node_greets_its_peers_and_asks_the_sentinels_before_it_serves() -> None:
    """At its fixed IP a restarted container has a new MAC (podman's Docker API ignores mac_address) that
    its peers' ARP tables do not know for 30 s or more: one PING to each peer first (its ARP requests update
    their entries).  Reachable again at once, a primary restarted 1 s after its kill was back before the
    sentinels' down-after and they never failed over (+reboot master: its AOF may lack the last second,
    which the replicas hold): so it asks the sentinels first and, named the master with an AOF, waits for a
    promotion, then replicates the new master, as the Kubernetes data nodes do."""
    nodes, sentinels = _array("data_nodes"), _array("sentinels")
    addresses = [HA_ENV[v] for v in ("REDIS_ANNOUNCE", "REDIS_REPLICA_1_ANNOUNCE", "REDIS_REPLICA_2_ANNOUNCE")]
    sentinel_ips = [HA_ENV[f"SENTINEL_{n}_ANNOUNCE"] for n in (1, 2, 3)]
    assert HA_ENV["HA_PEERS"].split() == [f"{a}:6379" for a in addresses] + [f"{a}:26379" for a in sentinel_ips]
    assert HA_ENV["HA_SENTINELS"].split() == sentinel_ips
    for name, address in zip(nodes, addresses, strict=True):
        service = HA_OVERLAY["services"][name]
        assert HA_ENV[service["environment"]["HA_SELF"][2:-1]] == address, name
        assert service["environment"]["HA_PEERS"] == "${HA_PEERS:-}"
        assert service["environment"]["HA_SENTINELS"] == "${HA_SENTINELS:-}"
        shell, flag, script, argv0 = service["entrypoint"]
        assert (shell, flag, argv0) == ("sh", "-c", "redis-node")
        assert "for p in $$HA_PEERS" in script and "sentinel get-master-addr-by-name stageferry" in script
        assert '[ "$$master" = "$$HA_SELF" ] && [ -e /data/appendonlydir ]' in script
        assert 'exec "$$@" --replicaof "$$master" 6379' in script and script.rstrip().endswith('exec "$$@"')
        assert SERVICES[name]["command"][0] == "redis-server"  # the compose file's command runs as "$@"
    for name in sentinels:
        assert "entrypoint" not in HA_OVERLAY["services"][name]
