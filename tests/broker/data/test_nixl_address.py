"""The advertised address (``STAGEFERRY_ADVERTISE_ADDRESS``): which interface holds it, UCX pinned to
that interface unless the operator chose, the setting's validation, the agent record carrying it, and
the trace naming both ends of a hop."""

from __future__ import annotations

import os
import socket

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from stageferry.broker.data.nixl.address import interface_of, parse_address, pin_ucx_devices
from stageferry.config import Settings
from stageferry.trace.events import parse_row


def test_the_loopback_interface_holds_127_0_0_1() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("::1") in ("lo", None)  # None where the host has IPv6 off
    assert interface_of("203.0.113.7") is None  # TEST-NET-3: on no interface here


def test_this_hosts_own_address_is_found() -> None:
    names = dict(socket.if_nameindex())
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("127.0.0.2", 9))  # routes over lo: no packet leaves the host
        address = probe.getsockname()[0]
    finally:
        probe.close()
    assert interface_of(address) in names.values()


def test_pin_sets_ucx_net_devices_only_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert pin_ucx_devices(None) is None and "UCX_NET_DEVICES" not in os.environ
    assert pin_ucx_devices("127.0.0.1") == "lo" and os.environ["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1,eth0")  # the operator's choice (RDMA) wins
    assert pin_ucx_devices("127.0.0.1") == "mlx5_0:1,eth0"


def test_an_address_on_no_interface_is_logged_and_left_to_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    with capture_logs() as logs:
        assert pin_ucx_devices("203.0.113.7") is None
    assert "UCX_NET_DEVICES" not in os.environ
    assert [e["event"] for e in logs] == ["nixl.address_not_local"] and logs[0]["address"] == "203.0.113.7"


def test_the_setting_takes_an_ip_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFERRY_ADVERTISE_ADDRESS", " 10.1.2.3 ")
    assert Settings().advertise_address == "10.1.2.3"
    assert parse_address("fd00::0001") == "fd00::1"
    for bad in ("pod-a.example", "10.1.2.300", "$(id)"):
        monkeypatch.setenv("STAGEFERRY_ADVERTISE_ADDRESS", bad)
        with pytest.raises(ValidationError):
            Settings()


def test_the_trace_names_both_ends_of_a_hop() -> None:
    ev = parse_row(
        "1-0",
        {
            "kind": "log",
            "event": '{"event": "payload.get", "transport": "nixl", "source": "10.0.0.5", "destination": "10.0.0.9"}',
        },
    )
    assert ev is not None and ev.detail == "10.0.0.5 -> 10.0.0.9"
