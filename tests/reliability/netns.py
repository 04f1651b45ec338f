"""Two network namespaces on this machine, as two hosts: a producer host and a consumer host.

Each namespace reaches the root namespace (where Redis listens) over its own control veth pair, and the
two namespaces are joined by a *data* veth pair, the only path between them.  Services pin UCX to the
data link (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=<data veth>``), so NIXL crosses it over TCP while the
control plane stays up when the data link is cut.  Needs root (CAP_NET_ADMIN); everything created is
deleted on exit.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    netns: str
    control_dev: str
    data_dev: str
    control_ip: str  # this namespace's end of the control link
    gateway_ip: str  # the root namespace's end (Redis listens there)
    data_ip: str

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *command]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(*self.argv(*command), check=check)


class Topology:
    """``producer`` and ``consumer`` namespaces, a data link between them, a control link each."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:5]
        net = random.randrange(200, 250)
        sub = random.randrange(0, 60) * 4
        self.producer = Host(f"sfp{tag}", f"sfcp{tag}", f"sfdp{tag}", f"10.{net}.{sub}.2", f"10.{net}.{sub}.1",
                             f"10.{net}.250.1")  # fmt: skip
        self.consumer = Host(f"sfc{tag}", f"sfcc{tag}", f"sfdc{tag}", f"10.{net}.{sub + 1}.2",
                             f"10.{net}.{sub + 1}.1", f"10.{net}.250.2")  # fmt: skip
        self._host_devs = [f"sfhp{tag}", f"sfhc{tag}"]
        self._created: list[str] = []

    def __enter__(self) -> Topology:
        try:
            for host, host_dev in zip((self.producer, self.consumer), self._host_devs, strict=True):
                sh("ip", "netns", "add", host.netns)
                self._created.append(host.netns)
                sh("ip", "link", "add", host_dev, "type", "veth", "peer", "name", host.control_dev)
                sh("ip", "link", "set", host.control_dev, "netns", host.netns)
                sh("ip", "addr", "add", f"{host.gateway_ip}/30", "dev", host_dev)
                sh("ip", "link", "set", host_dev, "up")
                host.run("ip", "addr", "add", f"{host.control_ip}/30", "dev", host.control_dev)
                host.run("ip", "link", "set", host.control_dev, "up")
                host.run("ip", "link", "set", "lo", "up")
            p, c = self.producer, self.consumer
            sh("ip", "link", "add", p.data_dev, "netns", p.netns, "type", "veth", "peer", "name", c.data_dev,
               "netns", c.netns)  # fmt: skip
            for host in (p, c):
                host.run("ip", "addr", "add", f"{host.data_ip}/24", "dev", host.data_dev)
                host.run("ip", "link", "set", host.data_dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for name in self._created:  # deleting a namespace deletes its veths, and so their peers
            sh("ip", "netns", "del", name, check=False)
        for dev in self._host_devs:
            sh("ip", "link", "del", dev, check=False)
        self._created.clear()

    def slow_data_link(self, rate: str) -> None:
        """Shape the producer's side of the data link (payload bytes flow producer → consumer)."""
        self.producer.run("tc", "qdisc", "add", "dev", self.producer.data_dev, "root", "tbf", "rate", rate,
                          "burst", "32kbit", "latency", "400ms")  # fmt: skip

    def cut_data_link(self) -> None:
        self.producer.run("ip", "link", "set", self.producer.data_dev, "down")

    def restore_data_link(self, timeout: float = 20.0) -> None:
        """Bring the link back and return once the consumer reaches the producer over it again: a link
        that is up is not yet forwarding (carrier, neighbour discovery), and a handshake in that gap
        fails with 'destination unreachable' — a different fault from the one under test."""
        self.producer.run("tc", "qdisc", "del", "dev", self.producer.data_dev, "root", check=False)
        self.producer.run("ip", "link", "set", self.producer.data_dev, "up")
        deadline = time.monotonic() + timeout
        while self.consumer.run(sys.executable, "-c", _REACHABLE, self.producer.data_ip, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"the data link did not come back within {timeout:.0f}s")


#: Exit 0 if a TCP SYN to the address (argv[1], a closed port) is answered — reset or accepted — within 1 s.
_REACHABLE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1).close()
except ConnectionRefusedError:
    pass
except OSError:
    sys.exit(1)
"""


def netns_unavailable() -> str | None:
    """Why this machine cannot build the topology (None when it can)."""
    probe = f"sfprobe{uuid.uuid4().hex[:5]}"
    try:
        made = sh("ip", "netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run ip: {exc}"
    if made.returncode != 0:
        return f"network namespaces not permitted here: {made.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None
