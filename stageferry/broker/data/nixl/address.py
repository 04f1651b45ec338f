"""Where NIXL peers reach this process: the advertised address (``STAGEFERRY_ADVERTISE_ADDRESS``).

NIXL exchanges UCX worker addresses through Redis (the agent record), and a UCX worker address lists
every network device UCX opened.  A pod has one address its peers can reach, its pod IP, which
Kubernetes hands to the container through the downward API (``status.podIP``).  With that setting
:func:`pin_ucx_devices` limits UCX to the interface holding the address (``UCX_NET_DEVICES``, unless the
operator set it, e.g. to add an RDMA device), before the agent is made, and the address travels in the
agent record (:class:`~stageferry.schemas.nixl.AgentRecord`), so that a consumer's ``payload.get``
event names both ends of the hop: ``source`` (the producer's address) and ``destination`` (its own).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

import structlog

log = structlog.get_logger(__name__)

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def parse_address(value: str) -> str:
    """An IP address, normalised (``ValueError`` otherwise): what the setting accepts."""
    return str(ipaddress.ip_address(value.strip()))


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds ``address`` (IPv4 by ioctl, IPv6 from /proc); None if
    no interface here has it."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as f:
                rows = [line.split() for line in f]
        except OSError:
            return None
        return next((r[5] for r in rows if len(r) >= 6 and ipaddress.ip_address(_v6(r[0])) == ip), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # down, or no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def _v6(hex32: str) -> str:
    return ":".join(hex32[i : i + 4] for i in range(0, 32, 4))


def pin_ucx_devices(address: str | None) -> str | None:
    """Point ``UCX_NET_DEVICES`` at the interface of ``address`` unless it is set; returns the devices UCX
    will use (None: UCX's own choice).  Must run before the first NIXL agent of the process."""
    given = os.environ.get("UCX_NET_DEVICES")
    if address is None or given:
        return given
    name = interface_of(address)
    if name is None:
        log.warning("nixl.address_not_local", address=address, net_devices="UCX's own choice")
        return None
    os.environ["UCX_NET_DEVICES"] = name
    return name
