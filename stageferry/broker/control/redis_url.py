"""Redis URLs: what one ``STAGEFERRY_REDIS_URL`` may say, checked before any I/O.

Three forms, each with ``user:password@`` for an ACL user (percent-encoded where needed)::

    redis://[user:pass@]host:port[/db]          one server
    rediss://[user:pass@]host:port[/db]         one server, TLS (options below)
    redis+sentinel://[user:pass@]host:port[,host:port...]/<service>[/db]
                                                the master of ``service``, found through these sentinels

A sentinel URL's credentials are the data nodes' (the ACL user the master and its replicas know);
sentinels that want a password of their own get ``sentinel_username``/``sentinel_password``.  With
``ssl=true`` every connection — to the sentinels and to the master — is TLS, with the same
``ssl_ca_certs``/``ssl_certfile``/... options as a ``rediss://`` URL.

Durability rides in the URL too, so every process of a deployment agrees on it:
``wait_replicas=N`` (default 1 on a sentinel URL, 0 — off — on the others) is how many replicas a
submission and a stage's hand-off, result and terminal status must reach before they count
(``WAIT N wait_timeout_ms``, default :data:`DEFAULT_WAIT_TIMEOUT_MS`); see :mod:`.replication`.
``failover_wait_s`` (default :data:`DEFAULT_FAILOVER_WAIT_S` on a sentinel URL, 0 on the others: no
change to how a single server's outage is reported) is how long a client's submission rides through a
failover before its error is shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit, urlunsplit

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

from stageferry.errors import ConfigError

#: TLS options that redis-py takes from a ``rediss://`` URL's query (certificate files are checked).
TLS_QUERY_FILES = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
TLS_QUERY_OPTIONS = TLS_QUERY_FILES | {"ssl_cert_reqs", "ssl_ca_path", "ssl_check_hostname", "ssl_min_version"}
SENTINEL_SCHEME = "redis+sentinel"
_SCHEMES = frozenset({"redis", "rediss", "unix", SENTINEL_SCHEME})
#: Options that are ours, not redis-py's (taken out of the URL before redis-py sees it).
WAIT_OPTIONS = frozenset({"wait_replicas", "wait_timeout_ms", "failover_wait_s"})
_SENTINEL_OPTIONS = frozenset({"ssl", "sentinel_username", "sentinel_password"})
#: How long a durable write waits for its replicas by default (``WAIT``'s timeout).
DEFAULT_WAIT_TIMEOUT_MS = 2000
#: How long a submission behind Sentinel rides through a failover by default.
DEFAULT_FAILOVER_WAIT_S = 30
_TRUE, _FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"})


@dataclass(frozen=True, slots=True)
class Durability:
    """How many replicas a durable write must reach (``WAIT replicas timeout_ms``; 0: not waited for),
    and how long a submission rides through a failover (``failover_s``; 0: it fails as redis-py does)."""

    replicas: int = 0
    timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS
    failover_s: int = 0

    @property
    def on(self) -> bool:
        return self.replicas > 0


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """Where a sentinel URL points: the sentinels, the service, and how to talk to its data nodes."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    #: redis-py connection options from the query (TLS options, socket timeouts, ...), parsed.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RedisUrl:
    """A checked URL: for redis-py as is (``url``: our own options taken out), or a sentinel target."""

    url: str
    durability: Durability
    sentinel: SentinelTarget | None = None


def parse_url(url: str) -> RedisUrl:
    """Check ``url`` and take it apart; :class:`ConfigError` for anything redis-py would only choke on
    later, or mis-handle silently (an unknown option, a TLS option without TLS, a missing certificate
    file, a sentinel URL without a service)."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        got = f"got {parts.scheme[:20]!r}" if parts.scheme else "got none; a host and port: redis://HOST:PORT/0"
        raise ConfigError(f"redis URL must start with redis://, rediss://, unix:// or redis+sentinel:// ({got})")
    query = {name: values[-1] for name, values in parse_qs(parts.query, keep_blank_values=True).items()}
    sentinel = parts.scheme == SENTINEL_SCHEME
    tls = parts.scheme == "rediss" or (sentinel and _flag(query.get("ssl", "false"), "ssl"))
    for name, value in query.items():
        if name in TLS_QUERY_OPTIONS:
            if not tls:
                raise ConfigError(
                    f"redis URL option {name} needs TLS (a rediss:// URL, or ssl=true on a sentinel URL)",
                    option=name,
                )
            if name in TLS_QUERY_FILES and not Path(value).is_file():
                raise ConfigError(f"redis URL option {name}: no such file {value!r}", option=name)
        elif name in _SENTINEL_OPTIONS and not sentinel:
            raise ConfigError(f"redis URL option {name} is for redis+sentinel:// URLs", option=name)
        elif name not in URL_QUERY_ARGUMENT_PARSERS and name not in WAIT_OPTIONS | _SENTINEL_OPTIONS:
            raise ConfigError(f"unknown redis URL option {name!r}", option=name)
    durability = Durability(
        replicas=_count(query.get("wait_replicas", "1" if sentinel else "0"), "wait_replicas", low=0),
        timeout_ms=_count(query.get("wait_timeout_ms", str(DEFAULT_WAIT_TIMEOUT_MS)), "wait_timeout_ms", low=1),
        failover_s=_count(
            query.get("failover_wait_s", str(DEFAULT_FAILOVER_WAIT_S if sentinel else 0)), "failover_wait_s", low=0
        ),
    )
    ours = {name: value for name, value in query.items() if name not in WAIT_OPTIONS}
    plain = urlunsplit(parts._replace(query=urlencode(ours)))
    if not sentinel:
        return RedisUrl(plain, durability)
    return RedisUrl(plain, durability, _sentinel_target(parts.netloc, parts.path, ours, tls=tls))


def shown(url: str) -> str:
    """``url`` as a message may show it: a password (``user:password@``) replaced by ``***``."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{hosts}").geturl()


def check_url(url: str) -> None:
    """Refuse (:class:`ConfigError`) a URL that redis-py would only choke on later (see :func:`parse_url`)."""
    parse_url(url)


def _sentinel_target(netloc: str, path: str, query: dict[str, str], *, tls: bool) -> SentinelTarget:
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    sentinels = tuple(_host_port(item) for item in hosts.split(","))
    names = [unquote(p) for p in path.split("/") if p]
    if not names or len(names) > 2:
        raise ConfigError("a redis+sentinel:// URL names its service, and at most a database: /<service>[/db]")
    db = _count(names[1], "database", low=0) if len(names) == 2 else 0
    options: dict[str, Any] = {}
    for name, value in query.items():
        if name in _SENTINEL_OPTIONS:
            continue
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        try:
            options[name] = parser(value) if parser is not None else value
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"redis URL option {name}: invalid value {value!r}", option=name) from exc
    return SentinelTarget(
        sentinels=sentinels,
        service=names[0],
        db=db,
        username=username,
        password=password,
        ssl=tls,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
        options=options,
    )


def _host_port(item: str) -> tuple[str, int]:
    host, colon, port = item.strip().rpartition(":")
    if not colon:
        host, port = port, "26379"
    host = host.strip("[]")  # an IPv6 address: [::1]:26379
    if not host:
        raise ConfigError(f"redis+sentinel:// URL: a sentinel without a host ({item!r})")
    return host, _count(port, f"sentinel port of {host}", low=1, high=65535)


def _count(text: str, what: str, *, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise ConfigError(f"redis URL: {what} must be an integer (got {text!r})", option=what) from exc
    if value < low or (high is not None and value > high):
        raise ConfigError(f"redis URL: {what} out of range (got {value})", option=what)
    return value


def _flag(text: str, what: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ConfigError(f"redis URL option {what} must be true or false (got {text!r})", option=what)


__all__ = ["Durability", "RedisUrl", "SentinelTarget", "check_url", "parse_url"]
