"""Where a consumer process's first get goes, step by step, against its later gets (issue 39, item 1).

    python benchmarks/first_get_steps.py                      # CPU pools, 5 fresh processes
    python benchmarks/first_get_steps.py --device cuda        # a CUDA pool too (the same-GPU plan)

Each process is fresh, as a stage's is before its first request: it builds the stage's pools (the real
:class:`~stageferry.broker.data.pool.PoolSet`), runs the connector's start-up rehearsal
(:meth:`~stageferry.broker.data.nixl.ready.ReadySlots.rehearse`'s steps on
:func:`~stageferry.broker.data.nixl.ready.rehearsal_payload`: slots, views, the checks), then runs a get's
local steps — the checks
(:func:`validate_manifest`, :func:`validate_remote_regions`, :func:`lease_seal`), the slots
(``acquire_regions``) and the views (:func:`unpack`) — for ``--gets`` payloads of the reference encoder's
structure, each a fresh manifest as a stage receives one, as a get without a payload made ready runs
them.  No NIXL and no Redis: only the host work a get does around its bytes.  Printed: each step's µs in
the first get and the median of the later ones, per process and as medians over processes; with
``--profile``, the first get's steps under cProfile in the first process (what its first run pays for).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = ("validate", "regions", "seal", "slots", "views", "release")


def encoder_payload(device: Any, tokens: int, frames: int) -> dict[str, Any]:
    """The reference encoder's payload structure (``stageferry/stages/reference/encoder.py``): bf16 text
    states and fp32 latents on ``device``, the int64 layout on the host (as the encoder keeps it)."""
    import torch

    return {
        "task": "fl2va" if frames else "t2va",
        "text": {
            "hidden_states": torch.zeros(tokens, 5120, dtype=torch.bfloat16, device=device),
            "role_ids": torch.zeros(tokens, dtype=torch.int64, device=device),
        },
        "visual_latents": torch.zeros(frames, 16, 1, 96, 168, device=device),
        "audio_latents": torch.zeros(1, 64, 0, device=device),
        "audio_style": torch.zeros(1, 64, device=device),
        "layout": torch.zeros(11 + frames, dtype=torch.int64),
        "meta": {"prompt": "a cat", "fps": 24, "width": 1344, "height": 768},
        "seed": 1,
    }


def child(args: argparse.Namespace) -> None:
    import anyio
    import torch

    from stageferry.broker.data.nixl.ready import rehearsal_payload
    from stageferry.broker.data.payload_codec import plan_payload, unpack, validate_manifest, validate_remote_regions
    from stageferry.broker.data.payload_validation import checked_key
    from stageferry.broker.data.pool import MemoryPool, PoolSet
    from stageferry.schemas import DeviceKind, MemKind, RemoteRegion
    from stageferry.schemas.nixl import lease_seal

    device = torch.device(args.device)
    pools = {DeviceKind.CPU: MemoryPool(DeviceKind.CPU, 64 << 20, device=torch.device("cpu"), registrar=None)}
    devices = {DeviceKind.CPU: torch.device("cpu")}
    if device.type == "cuda":
        pools[DeviceKind.CUDA] = MemoryPool(DeviceKind.CUDA, 256 << 20, device=device, registrar=None)
        devices[DeviceKind.CUDA] = device
    poolset = PoolSet(pools)
    # the connector's rehearsal (ReadySlots.rehearse): slots taken, structure key, views, slots back
    rehearsal = plan_payload(rehearsal_payload(devices)).manifest
    slots = poolset.take_regions_now(rehearsal)
    assert slots is not None and checked_key(rehearsal) is not None
    unpack(rehearsal, {k: s.span for k, s in slots.items()}, copy=False)
    own = [slots[r.device].remote_region() for r in rehearsal.regions]
    validate_manifest(rehearsal, max_payload_bytes=1 << 30)
    validate_remote_regions(rehearsal, own, poolset.arenas())
    lease_seal(b"rehearsal", "rehearsal", "rehearsal", own)
    poolset.release_all(slots)
    key = b"k" * 32
    arenas = [
        RemoteRegion(address=1 << 30, length=1 << 30, device_id=0, mem_kind=MemKind.DRAM),
        RemoteRegion(address=1 << 40, length=1 << 30, device_id=0, mem_kind=MemKind.VRAM),
    ]

    async def one_get(n: int, profile: cProfile.Profile | None) -> dict[str, float]:
        manifest = plan_payload(encoder_payload(device, args.tokens + n, args.frames)).manifest
        manifest = type(manifest).model_validate_json(manifest.model_dump_json())  # as received
        regions = [
            RemoteRegion(
                address=(arenas[r.device is DeviceKind.CUDA].address + 4096 * n),
                length=r.nbytes,
                device_id=0,
                mem_kind=MemKind.VRAM if r.device is DeviceKind.CUDA else MemKind.DRAM,
            )
            for r in manifest.regions
        ]
        token = f"tok{n:08d}"
        seal = lease_seal(key, "encoder-x", token, regions)
        t: dict[str, float] = {}
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        validate_manifest(manifest, max_payload_bytes=1 << 30)
        t1 = time.perf_counter()
        validate_remote_regions(manifest, regions, arenas)
        t2 = time.perf_counter()
        assert lease_seal(key, "encoder-x", token, regions) == seal
        t3 = time.perf_counter()
        slots = await poolset.acquire_regions(manifest, timeout=1.0)
        t4 = time.perf_counter()
        unpack(manifest, {k: s.span for k, s in slots.items()}, copy=False)
        t5 = time.perf_counter()
        poolset.release_all(slots)
        t6 = time.perf_counter()
        if profile is not None:
            profile.disable()
        for name, (a, b) in zip(STEPS, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6)], strict=True):
            t[name] = (b - a) * 1e6
        return t

    async def main() -> None:
        profile = cProfile.Profile() if args.profile else None
        gets = []
        for n in range(args.gets):
            await anyio.sleep(args.idle)
            gets.append(await one_get(n, profile if n == 0 else None))  # a stage idles between requests
        out: dict[str, Any] = {"gets": gets}
        if profile is not None:
            stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:20]
            out["profile"] = "\n".join(
                f"{tt * 1e6:9.1f} {ct * 1e6:9.1f} {nc:>5}  {Path(f).name}:{line}({fn})"
                for (f, line, fn), (_cc, nc, tt, ct, _callers) in rows
            )
        print(json.dumps(out))

    anyio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--gets", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=35, help="text tokens (35: the T2VA reference payload)")
    parser.add_argument("--frames", type=int, default=0, help="keyframe latents (2: FL2VA)")
    parser.add_argument("--idle", type=float, default=0.05, help="seconds idle before each get")
    parser.add_argument("--profile", action="store_true", help="cProfile the first process's first get")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"$ python {' '.join(sys.argv)}\n")
    firsts: dict[str, list[float]] = {s: [] for s in STEPS}
    laters: dict[str, list[float]] = {s: [] for s in STEPS}
    print("process  " + "  ".join(f"{s:>16}" for s in STEPS) + "   (first / later median, µs)")
    for p in range(args.processes):
        cmd = [sys.executable, __file__, "--child", "--device", args.device, "--gets", str(args.gets),
               "--tokens", str(args.tokens), "--frames", str(args.frames), "--idle", str(args.idle)]  # fmt: skip
        if args.profile and p == 0:
            cmd.append("--profile")
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        gets = out["gets"]
        cells = []
        for s in STEPS:
            first, later = gets[0][s], statistics.median(g[s] for g in gets[1:])
            firsts[s].append(first)
            laters[s].append(later)
            cells.append(f"{first:7.1f} / {later:6.1f}")
        print(f"{p:>7}  " + "  ".join(f"{c:>16}" for c in cells))
        if "profile" in out:
            profile_text = out["profile"]
    print("\nmedians over processes (µs): first get / later gets")
    total_first = total_later = 0.0
    for s in STEPS:
        f, later = statistics.median(firsts[s]), statistics.median(laters[s])
        total_first, total_later = total_first + f, total_later + later
        print(f"  {s:<9} {f:8.1f} / {later:7.1f}  ({f / later:.1f}×)" if later else f"  {s:<9} {f:8.1f} / {later:7.1f}")
    print(f"  {'all':<9} {total_first:8.1f} / {total_later:7.1f}  ({total_first / total_later:.1f}×)")
    if args.profile:
        print("\nthe first process's first get under cProfile (µs, own and with callees; calls):\n" + profile_text)


if __name__ == "__main__":
    main()
