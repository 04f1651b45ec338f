"""Redis ACL users for a deployment: the services' user, and least-privilege client users (per tenant).

Clients are untrusted, so a client user gets, for its own request ids only, exactly the pairs of
command and key it needs — each pair in its own ACL *selector* (Redis >= 7.0), because a user's
commands and key patterns otherwise combine freely (``+set`` for cancels plus write access to the
stream key would let ``SET`` replace the stream).  Read (``%R~``) and write (``%W~``) are separate:

* read ``<p>:req:ID`` and ``<p>:req-submitted:ID`` (``HGET HGETALL EXISTS``): status, "submitted" marker;
* read ``<p>:req-events:ID`` (``XREAD XRANGE XLEN``): wait, trace;
* read ``<p>:req-result:ID`` (``GET STRLEN GETRANGE``): the result bytes;
* write ``<p>:req-cancel:ID``, ``<p>:upload:ID:*``, ``<p>:req-submitted:ID`` (``SET``): cancel, media, marker;
* push onto its intake list (``RPUSH``) and read its length (``LLEN``, back-pressure): submit;
* read ``<p>:refused:<ticket>`` (``HGETALL``): why a submission was refused;

where ``ID`` is ``*`` for the single-tenant client and ``<tenant>.*`` for a tenant's; plus ``HELLO AUTH
PING MULTI EXEC DISCARD WAIT`` (``WAIT``: a submission counts once replicas have it, see
``docs/high-availability.md``), and ``SELECT`` of the deployment's database only (none at all for
database 0: a client cannot write its patterns in another database).  Nothing else: no scripts (``EVAL``/
``EVALSHA``/``FUNCTION``/``SCRIPT``: a slow script answers ``BUSY`` to everyone, and a Redis Function
would run with the caller's rights anyway), no ``DEL``/``EXPIRE``, no writes to statuses, events or
results (only stages write those), no stream writes at all (``XADD`` takes the entry id and ``MAXLEN``
from its caller: one client could stop or trim everyone's queue), no pops or trims of the intake, no
push to any wake list (a stage pops those whole), no read of anything a prompt sits in, no
``KEYS``/``SCAN``.  The intake is ``<p>:stage:<first>:submit`` for a single-tenant deployment and
``<p>:stage:<first>:submit:<tenant>`` for a tenant (see :class:`~stageferry.config.Security` and
:mod:`stageferry.broker.control.intake`).  Behind Sentinel every data node loads the same file, and two
more users let the group run itself: the replicas' (:func:`replica_user`: replication only) and the
sentinels' (:func:`sentinel_user`: exactly what Sentinel sends to monitor and fail over).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_url import SENTINEL_SCHEME, parse_url
from stageferry.errors import ConfigError
from stageferry.schemas.job import TENANT_SEPARATOR, is_tenant

#: Every command the stage services send, directly or from their Lua scripts (taken from MONITOR during
#: full pipeline runs and from reading ``broker/``; ``tests/security/test_stage_acl.py`` holds every Lua
#: script in the package to this list and runs the control plane's scripts as this user).
STAGE_COMMANDS = (
    "hello", "auth", "ping", "select", "multi", "exec", "discard", "evalsha", "script|load", "fcall", "function|load",
    "exists", "get", "getrange", "set", "strlen", "del", "expire", "pexpire", "pttl", "scan", "hget", "hmget", "hset",
    "hdel", "hgetall", "rpush", "lpush", "lpop", "ltrim", "llen", "blpop", "xadd", "xack", "xdel", "xtrim", "xclaim",
    "xautoclaim", "xgroup|create", "xgroup|delconsumer", "xinfo|consumers", "xlen", "xpending", "xrange",
    "xrevrange", "xread", "xreadgroup", "wait",
)  # fmt: skip
_CONNECTION = "+hello +auth +ping +select +multi +exec +discard +wait"
_CLIENT_CONNECTION = "+hello +auth +ping +multi +exec +discard +wait"
#: What a replica sends its master (``masteruser``), and what Sentinel sends the data nodes
#: (``sentinel auth-user``), from the Redis manual's ACL guidance for each.
REPLICA_COMMANDS = ("psync", "replconf", "ping")
SENTINEL_COMMANDS = (
    "multi", "exec", "slaveof", "replicaof", "ping", "subscribe", "publish", "config|rewrite", "role", "info",
    "client|setname", "client|kill", "script|kill",
)  # fmt: skip
#: A single-tenant client's refusal records: ``<p>:refused:`` and a ticket of exactly 32 characters (a
#: tenant's are ``<p>:refused:<tenant>.<ticket>``, longer: out of reach).
_SINGLE_TICKET = "?" * 32


def redis_db(url: str) -> int:
    """The database a Redis URL names (``/N`` or ``?db=N``; 0 when it names none); a sentinel URL's is the
    one after its service (``redis+sentinel://…/<service>/N``)."""
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        target = parse_url(url).sentinel
        return 0 if target is None else target.db
    parts = urllib.parse.urlsplit(url)
    raw = urllib.parse.parse_qs(parts.query).get("db", [parts.path.strip("/")])[0]
    try:
        return int(raw) if raw else 0
    except ValueError as exc:
        raise ConfigError(f"the Redis URL names no valid database: {raw[:40]!r}") from exc


def _pinned_db(db: int) -> str:
    """``SELECT`` of database ``db`` alone; none for 0, where every connection starts (Redis logs a
    deprecation warning for a first-argument rule, which still holds on 7.x)."""
    if not 0 <= db <= 15_999:
        raise ConfigError(f"invalid Redis database {db}")
    return "" if db == 0 else f" -select +select|{db}"


def stage_user(prefix: str, *, name: str = "stageferry", password: str = ">CHANGE-ME") -> str:
    """The services' user (stages, gateway, trusted tools): every key under ``prefix``, our commands only."""
    commands = " ".join(f"+{c}" for c in STAGE_COMMANDS)
    return f"user {name} on {password} resetkeys ~{prefix}:* resetchannels -@all {commands}"


def replica_user(*, name: str = "sfreplica", password: str = ">CHANGE-ME") -> str:
    """The replicas' user on every data node (their ``masteruser``): replication, nothing else."""
    return f"user {name} on {password} resetkeys resetchannels -@all " + " ".join(f"+{c}" for c in REPLICA_COMMANDS)


def sentinel_user(*, name: str = "sfsentinel", password: str = ">CHANGE-ME") -> str:
    """The sentinels' user on every data node (``sentinel auth-user``): monitor, reconfigure, fail over."""
    commands = " ".join(f"+{c}" for c in SENTINEL_COMMANDS)
    return f"user {name} on {password} resetkeys allchannels -@all {commands}"


def client_user(
    prefix: str,
    first_stage: str,
    *,
    tenant: str | None = None,
    name: str | None = None,
    password: str = ">CHANGE-ME",
    db: int = 0,
) -> str:
    """A client's user: its own requests only (all untenanted ids, or ``tenant``'s ``<tenant>.*``), in
    database ``db`` only."""
    if tenant is not None and not is_tenant(tenant):
        raise ConfigError(f"invalid tenant name {tenant!r}")
    keys = Keys(prefix)
    ids = "*" if tenant is None else f"{tenant}{TENANT_SEPARATOR}*"
    intake = keys.intake(first_stage, tenant)
    refused = keys.refused(_SINGLE_TICKET) if tenant is None else keys.refused("*", tenant)
    selectors = [
        f"%R~{keys.request(ids)} %R~{keys.submitted(ids)} +hget +hgetall +exists",
        f"%R~{keys.events(ids)} +xread +xrange +xlen",
        f"%R~{keys.result(ids)} +get +strlen +getrange",
        f"%W~{keys.cancel(ids)} %W~{keys.upload(ids, '*')} %W~{keys.submitted(ids)} +set",
        f"%W~{intake} +rpush",
        f"%R~{intake} +llen",
        f"%R~{refused} +hgetall",
    ]
    user = name or ("sfclient" if tenant is None else f"sfclient-{tenant}")
    body = " ".join(f"({s})" for s in selectors)
    return f"user {user} on {password} resetkeys resetchannels -@all {_CLIENT_CONNECTION}{_pinned_db(db)} {body}"


#: Jobs whose worst-case uploads and entries the default ``maxmemory`` makes room for at once.
MEMORY_JOBS = 8
#: Media inputs a job may upload (``MediaInputs``: first/last frame, reference video/audio).
_MEDIA_PER_JOB = 4
#: Room for everything else: records, traces, queues, dead letters, NIXL records.
_MEMORY_BASE = 256 << 20


def default_maxmemory(*, max_upload_bytes: int, max_entry_bytes: int) -> int:
    """The ``maxmemory`` the generated config sets: :data:`MEMORY_JOBS` jobs each with every upload at
    ``limits.max_upload_bytes`` and an entry at ``limits.max_entry_bytes``, plus 256 MiB (2.5 GiB for the
    default limits)."""
    return MEMORY_JOBS * (_MEDIA_PER_JOB * max_upload_bytes + max_entry_bytes) + _MEMORY_BASE


def memory_config(maxmemory: int) -> str:
    """Redis config lines that bound its memory: ``maxmemory`` and ``noeviction`` (a full Redis refuses
    writes, with an error every writer handles; it never evicts a queued job, a record or a result)."""
    return f"maxmemory {maxmemory}\nmaxmemory-policy noeviction\n"


def scaler_user(prefix: str, *, name: str = "sfscaler", password: str = ">CHANGE-ME") -> str:
    """An autoscaler's user (KEDA's ``redis-streams`` and ``redis`` triggers): it reads the stage streams'
    backlog (``XPENDING`` for pending entries, ``XINFO GROUPS`` for the group's lag, ``XLEN``) and the
    intake lists' lengths (``LLEN``) only, no entry's or submission's body."""
    keys = Keys(prefix)
    streams = f"(%R~{keys.stage_stream('*')} +xpending +xinfo|groups +xinfo|stream +xlen)"
    intakes = f"(%R~{keys.intake('*')} %R~{keys.intake('*', '*')} +llen)"
    return f"user {name} on {password} resetkeys resetchannels -@all {_CONNECTION} {streams} {intakes}"


def acl_file(
    prefix: str,
    first_stage: str,
    *,
    tenants: Sequence[str] = (),
    passwords: dict[str, str] | None = None,
    db: int = 0,
    maxmemory: int | None = None,
    scaler: bool = False,
    sentinel: bool = False,
) -> str:
    """A whole ACL file: the default user off, the services' user, and one client user per tenant (or the
    single-tenant client user when there are none), clients held to database ``db``; with ``scaler`` also
    :func:`scaler_user`; with ``sentinel``, the replicas' and the sentinels' users too; with ``maxmemory``,
    the memory bound first (:func:`memory_config`).  ``passwords`` maps user → ``>password``/``#sha256``."""
    pw = passwords or {}
    lines = [
        *([memory_config(maxmemory).rstrip()] if maxmemory is not None else []),
        "user default off",
        stage_user(prefix, password=pw.get("stageferry", ">CHANGE-ME")),
    ]
    if scaler:
        lines.append(scaler_user(prefix, password=pw.get("sfscaler", ">CHANGE-ME")))
    if sentinel:
        lines.append(replica_user(password=pw.get("sfreplica", ">CHANGE-ME")))
        lines.append(sentinel_user(password=pw.get("sfsentinel", ">CHANGE-ME")))
    if not tenants:
        lines.append(client_user(prefix, first_stage, password=pw.get("sfclient", ">CHANGE-ME"), db=db))
    for tenant in tenants:
        name = f"sfclient-{tenant}"
        lines.append(client_user(prefix, first_stage, tenant=tenant, password=pw.get(name, ">CHANGE-ME"), db=db))
    return "\n".join(lines) + "\n"


__all__ = [
    "MEMORY_JOBS",
    "REPLICA_COMMANDS",
    "SENTINEL_COMMANDS",
    "STAGE_COMMANDS",
    "acl_file",
    "client_user",
    "default_maxmemory",
    "memory_config",
    "redis_db",
    "replica_user",
    "scaler_user",
    "sentinel_user",
    "stage_user",
]
