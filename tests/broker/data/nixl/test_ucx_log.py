"""The UCX log reader: protocol tables and lane summaries condensed into one line each."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from stageferry.broker.data.nixl import ucx_log
from stageferry.broker.data.nixl.ucx_log import (
    UcxLogTail,
    configure_environment,
    own_tables,
    parse_ucx_log,
    route_matches,
    transport_names,
)


def test_parse_ucx_proto_info() -> None:
    log: list[Any] = [
        "[1.1] [h:1 :0]   +--------+-------------+------------+",
        "[1.1] [h:1 :0]   | c intra-node cfg#1                |",
        "[1.1] [h:1 :0]   | active message by ucp_am_send* from host memory |",
        "[1.1] [h:1 :0]   | Range  | Description | Config     |",
        "[1.1] [h:1 :0]   | 0..inf | zero-copy   | tcp/lo     |",
        "[1.2] [h:1 :0]   +--------+-------------+------------+",
        "[1.2] [h:1 :0]   | c intra-node cfg#1                |",
        "[1.2] [h:1 :0]   | remote memory read by ucp_get* from cuda/GPU0 |",
        "[1.2] [h:1 :0]   +--------+-------------+------------+",
        "[1.2] [h:1 :0]   | Range  | Description | Config     |",
        "[1.2] [h:1 :0]   +--------+-------------+------------+",
        "[1.2] [h:1 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda |",
        "[1.2] [h:1 :0]   +--------+-------------+------------+",
    ]
    assert parse_ucx_log("\n".join(log)) == [
        "c intra-node cfg#1 remote memory read by ucp_get* from cuda/GPU0: 0..inf zero-copy cuda_ipc/cuda"
    ]
    lanes = (
        "[1.3] [h:1 :0]  ucp_worker.c:1997 UCX  INFO    c self cfg#0 rma_am(tcp/lo)  am(tcp/lo)\n"
        "[1.3] [h:1 :0]  ucp_worker.c:1997 UCX  INFO    c intra-node cfg#1 rma_am(tcp/lo)  am(tcp/lo cma/memory)"
    )
    assert parse_ucx_log(lanes) == ["c intra-node cfg#1 rma_am(tcp/lo) am(tcp/lo cma/memory)"]


def test_the_tail_reads_only_what_was_appended(tmp_path: Path) -> None:
    path = tmp_path / "ucx.log"
    tail = UcxLogTail(path)
    assert tail.read_new() is None  # not written yet
    path.write_text("first\n")
    assert tail.read_new() == "first\n"
    assert tail.read_new() == ""
    with path.open("a") as f:
        f.write("second\n")
    assert tail.read_new() == "second\n"


def test_our_own_log_file_is_unlinked_once_open_and_still_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file configure_environment chose is unlinked by the first tail, which reads on through its
    descriptor as UCX writes through its own; a second tail in the process reads the same file."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / f"stageferry-ucx-{os.getpid()}.log"
    assert path == ucx_log._own_log_path()
    with path.open("a") as ucx:  # UCX opens it when its library loads
        ucx.write("first\n")
        ucx.flush()
        tail = UcxLogTail(path)
        assert not path.exists(), "unlinked once open: nothing left in $TMP"
        assert tail.read_new() == "first\n"
        ucx.write("second\n")
        ucx.flush()
        assert tail.read_new() == "second\n"
        assert UcxLogTail(path).read_new() == "first\nsecond\n", "another agent's tail: the same file"
    other = tmp_path / "operator.log"  # an operator's UCX_LOG_FILE stays where it is
    other.write_text("x\n")
    assert UcxLogTail(other).read_new() == "x\n" and other.exists()


def test_transport_names_from_proto_info() -> None:
    """The short names a hop's route shows: the transport of each range, in order, without repeats."""
    gpu = (
        "c intra-node cfg#2 remote memory read by ucp_get*(multi) into cuda/GPU1 from cuda/dev[2]: "
        "0..inf zero-copy cuda_ipc/cuda"
    )
    cpu = (
        "c intra-node cfg#1 remote memory read by ucp_get* from host: "
        "0..8K copy-in sm/memory, 8K..inf zero-copy cma/memory"
    )
    assert transport_names(gpu) == ["cuda_ipc"]
    assert transport_names(f"{cpu}; {gpu}") == ["sm", "cma", "cuda_ipc"]
    assert transport_names(gpu + " (shared)") == ["cuda_ipc"]
    assert transport_names("c intra-node cfg#1 rma_am(tcp/lo) am(tcp/lo cma/memory)") == []
    assert transport_names(None) == []


def test_a_route_takes_only_the_ucx_tables_of_its_memory_kinds() -> None:
    """A payload's VRAM and DRAM READs run at once: each route is told the transport of its own memory."""
    gpu = (
        "c intra-node cfg#2 remote memory read by ucp_get*(multi) into cuda/GPU1 from cuda/dev[2]: "
        "0..inf zero-copy cuda_ipc/cuda"
    )
    cpu = (
        "c intra-node cfg#1 remote memory read by ucp_get* from host: "
        "0..8K copy-in sm/memory, 8K..inf zero-copy cma/memory"
    )
    assert route_matches(gpu, "VRAM<-VRAM") and not route_matches(gpu, "DRAM<-DRAM")
    assert route_matches(cpu, "DRAM<-DRAM") and not route_matches(cpu, "VRAM<-VRAM")
    assert route_matches("rma(cma/memory) am(sm/memory)", "VRAM<-VRAM"), "a lane summary names no memory"


def test_an_agent_takes_only_the_ucx_tables_its_own_worker_printed() -> None:
    """One process's UCX log holds every agent's tables (seen on 2 x H200: a closed agent's ``tcp`` table
    beside this one's ``cuda_ipc``): an agent keeps its own, or all when none names it."""
    mine = "diffusion-a intra-node cfg#2 remote memory read by ucp_get* into cuda/GPU1: 0..inf zero-copy cuda_ipc/cuda"
    other = (
        "diffusion-b intra-node cfg#2 remote memory read by ucp_get* into cuda/GPU1: 0..inf software emulation tcp/lo"
    )
    assert own_tables([other, mine], "diffusion-a") == [mine]
    assert own_tables([other], "diffusion-a") == [other], "no table names this agent: nothing to tell them apart"


def test_the_environment_turns_cuda_ipc_reads_on_unless_the_operator_said_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """UCX's ``auto`` turns cuda_ipc GETs off without NVLink: a same-GPU READ would go over TCP."""
    for name in ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "UCX_RCACHE_MAX_UNRELEASED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UCX_PROTO_INFO", "n")
    configure_environment(cuda=False)
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ, "no GPU: UCX would warn that it is unused"
    assert os.environ["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
    configure_environment(cuda=True)
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto")
    configure_environment(cuda=True)
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto", "the operator's choice is kept"
