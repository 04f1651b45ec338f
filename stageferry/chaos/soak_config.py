"""What a chaos soak runs: its settings, the mix of jobs it submits and the deployment it starts.

:class:`SoakConfig` is read by :func:`stageferry.chaos.soak.run_soak`; :func:`pipeline_toml` is the
deployment (short visibility and leases, so faults resolve within the run) and :func:`job_for` one job of
the mix (:data:`MIX`, with a share of streamed jobs: :func:`mix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stageferry.chaos.faults import FaultKind

SAMPLES = Path(__file__).resolve().parent.parent / "samples"

#: The mix of submitted jobs: (kind, weight).  ``fail`` must end failed, ``invalid`` rejected.
MIX = (("t2va", 55), ("fl2va", 25), ("ref2va", 12), ("fail", 4), ("invalid", 4))
#: A streamed job (T2VA; the encoder streams chunks into the diffusion stage, :mod:`stageferry.chaos.model`).
STREAM = "stream"


def mix(streamed: float) -> tuple[tuple[str, float], ...]:
    """:data:`MIX` with a ``streamed`` share of streamed jobs (the rest keep their proportions); at 0,
    :data:`MIX` itself, so a seed draws the same jobs as before there were streamed ones."""
    if not streamed:
        return MIX
    return (*((k, w * (1 - streamed)) for k, w in MIX), (STREAM, 100 * streamed))


#: The faults of a soak behind Sentinel unless told otherwise: six failovers, two of each kind.
FAILOVER_FAULTS = {FaultKind.PRIMARY_KILL: 2, FaultKind.SENTINEL_FAILOVER: 2, FaultKind.PRIMARY_CUT: 2}


@dataclass
class SoakConfig:
    requests: int = 200
    seed: int | None = None
    replicas: int = 2
    enc_tp: int = 2
    dif_tp: int = 4
    #: Seconds over which requests are submitted (and faults injected); default 0.6 s per request.
    window_s: float | None = None
    faults: dict[FaultKind, int] = field(
        default_factory=lambda: {
            FaultKind.LEADER_KILL: 2,
            FaultKind.FOLLOWER_KILL: 2,
            FaultKind.PRODUCER_AFTER_PUBLISH: 2,
            FaultKind.CONSUMER_MID_READ: 2,
            FaultKind.REDIS_RESTART: 2,
            FaultKind.EMPTY_RESTART: 1,
            FaultKind.STALL: 2,
            FaultKind.HOSTILE_CLIENT: 2,
        }
    )
    visibility_s: float = 5.0
    #: How long a fault may wait for its target: a failpoint to be reached, a group to be up again.
    fault_wait_s: float = 150.0
    stage_seconds: float = 0.05
    steps: int = 4
    drain_s: float = 300.0
    work_dir: Path | None = None
    keep_work_dir: bool = False
    #: Redis as a Sentinel group (failover faults); else one AOF server.
    sentinel: bool = False
    #: Replicas a durable write waits for behind Sentinel (the URL's ``wait_replicas``; None: its default, 1).
    wait_replicas: int | None = None
    #: The share of jobs (0..1) whose encoder streams its output into the diffusion stage in chunks.
    streamed: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.streamed < 1.0:
            raise ValueError(f"streamed is a share of the jobs, 0 <= streamed < 1, not {self.streamed}")

    @property
    def window(self) -> float:
        return self.window_s if self.window_s is not None else 0.6 * self.requests


def pipeline_toml(cfg: SoakConfig) -> str:
    """The soak's deployment: short visibility and leases, so faults resolve within the run; a streamed
    job's chunk deadlines long enough to ride out a producer's kill, reclaim and recompute (or a stall)."""
    v = cfg.visibility_s
    return f"""
output_dir = "out"

[[stages]]
name = "encoder"
model = "stageferry.chaos.model:factory"
tp = {cfg.enc_tp}
device = "cpu"

[[stages]]
name = "diffusion"
model = "stageferry.chaos.model:factory"
tp = {cfg.dif_tp}
device = "cpu"

[data_plane]
connector = "nixl"
cpu_pool_bytes = {200 << 20}
gpu_pool_bytes = 0
agent_heartbeat_s = 0.5
agent_ttl_s = 3.0

[timeouts]
visibility = {v}
claim_renew_every = {max(0.5, v / 5)}
handshake = 5.0
claim = 8.0
transfer = 10.0
lease = 15.0
pool_wait = 10.0
resend = 3.0
redis_unreachable = 90.0

[limits]
max_deliveries = 6
max_recomputes = 4
media_roots = ["{SAMPLES}"]

[streaming]
max_chunks_in_flight = 2
chunk_timeout_s = 90.0
producer_wait_s = 90.0
"""


def job_for(kind: str, i: int, steps: int) -> dict[str, Any]:
    """A job of ``kind`` (media as paths to the bundled samples, which the encoder checks)."""
    base: dict[str, Any] = {
        "prompt": f"soak job {i}",
        "width": 320,
        "height": 192,
        "seed": i,
        "num_inference_steps": steps,
    }
    if kind == "fl2va":
        base.update(task="fl2va", media={"first_frame": {"path": str(SAMPLES / "first_frame.png")},
                                         "last_frame": {"path": str(SAMPLES / "last_frame.png")}})  # fmt: skip
    elif kind == "ref2va":
        base.update(task="ref2va", media={"reference_audio": {"path": str(SAMPLES / "reference_audio.wav")}})
    elif kind == "fail":
        base.update(prompt=f"fail job {i}")
    elif kind == STREAM:
        base.update(prompt=f"stream job {i}")
    return base
