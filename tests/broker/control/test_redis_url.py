"""Redis URLs (:mod:`stageferry.broker.control.redis_url`): the sentinel form taken apart, durability
options read, and every malformed URL refused before any I/O."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageferry.broker.control.redis_conn import check_url, connect, durability_of
from stageferry.broker.control.redis_url import (
    DEFAULT_FAILOVER_WAIT_S,
    DEFAULT_WAIT_TIMEOUT_MS,
    Durability,
    parse_url,
    shown,
)
from stageferry.errors import ConfigError


def test_a_sentinel_url_names_its_sentinels_service_database_and_the_data_nodes_user() -> None:
    parsed = parse_url("redis+sentinel://svc:p%40ss@10.0.0.1:26379,s2:26380,[::1]:26381/stageferry/3")
    target = parsed.sentinel
    assert target is not None
    assert target.sentinels == (("10.0.0.1", 26379), ("s2", 26380), ("::1", 26381))
    assert (target.service, target.db, target.username, target.password) == ("stageferry", 3, "svc", "p@ss")
    assert not target.ssl and target.sentinel_password is None
    assert parsed.durability == Durability(1, DEFAULT_WAIT_TIMEOUT_MS, DEFAULT_FAILOVER_WAIT_S)  # on by default


def test_tls_and_sentinel_credentials_ride_in_the_query(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-")
    target = parse_url(
        f"redis+sentinel://s1,s2:1/svc?ssl=true&ssl_ca_certs={ca}&sentinel_password=x&socket_timeout=3"
    ).sentinel
    assert target is not None and target.ssl and target.sentinel_password == "x"
    assert target.sentinels == (("s1", 26379), ("s2", 1))  # no port: the sentinel default
    assert target.options == {"ssl_ca_certs": str(ca), "socket_timeout": 3.0}


def test_durability_options_default_off_without_sentinels_and_are_taken_out_for_redis_py() -> None:
    assert parse_url("redis://h:6379/0").durability == Durability(0)
    parsed = parse_url("redis://h:6379/0?wait_replicas=2&wait_timeout_ms=500&failover_wait_s=9&socket_timeout=3")
    assert parsed.durability == Durability(2, 500, 9)
    assert parsed.url == "redis://h:6379/0?socket_timeout=3"
    assert parse_url("redis+sentinel://s:1/svc?wait_replicas=0").durability.replicas == 0


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://s1:26379",  # no service
        "redis+sentinel://s1:26379/svc/0/extra",
        "redis+sentinel://s1:26379/svc/x",  # database not a number
        "redis+sentinel://s1:notaport/svc",
        "redis+sentinel://s1:70000/svc",
        "redis+sentinel://:26379/svc",  # a sentinel without a host
        "redis+sentinel://s1/svc?ssl=maybe",
        "redis+sentinel://s1/svc?ssl_ca_certs=/no/such/ca.crt&ssl=true",
        "redis+sentinel://s1/svc?ssl_ca_certs=ca.crt",  # TLS option without ssl=true
        "redis+sentinel://s1/svc?sentinel_pasword=x",  # unknown option
        "redis://h:1/0?sentinel_password=x",  # a sentinel option on a plain URL
        "redis://h:1/0?wait_replicas=-1",
        "redis://h:1/0?wait_timeout_ms=0",
        "redis://h:1/0?failover_wait_s=soon",
        "rediss+sentinel://s1/svc",
    ],
)
def test_malformed_sentinel_urls_are_config_errors_before_any_io(url: str) -> None:
    with pytest.raises(ConfigError):
        check_url(url)
    with pytest.raises(ConfigError):
        connect(url)  # the factory refuses it too, without connecting


def test_the_factory_records_each_clients_durability() -> None:
    client = connect("redis+sentinel://127.0.0.1:1/svc?wait_replicas=2&wait_timeout_ms=300&failover_wait_s=5")
    assert durability_of(client) == Durability(2, 300, 5)
    assert durability_of(connect("redis://127.0.0.1:1/0")) == Durability(0)


@pytest.mark.parametrize(
    ("url", "as_shown"),
    [
        ("redis://sfclient:s3cret@redis:6379/0", "redis://sfclient:***@redis:6379/0"),
        ("redis://:s3cret@redis/0", "redis://:***@redis/0"),
        ("redis+sentinel://u:p@s1:26379,s2:26379/mymaster/0", "redis+sentinel://u:***@s1:26379,s2:26379/mymaster/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://user@h/0", "redis://user@h/0"),
    ],
)
def test_a_url_in_a_message_shows_no_password(url: str, as_shown: str) -> None:
    assert shown(url) == as_shown
