"""The CUDA runtime's copy calls (issue 39's same-GPU copy): found where torch mapped it, checked on every call.

Finding it runs here (a maps file); the calls need CUDA and run on the device machine
(``benchmarks/issue39_device.sh gpu_tests``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stageferry.broker.data.nixl.cuda_runtime import CudaRuntime, EventPool, RuntimeCopy, _mapped_cudart

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")

MAPS = """\
55d4c0a00000-55d4c0a28000 r--p 00000000 08:01 1312 /usr/bin/python3.11
7f1c2a000000-7f1c2a021000 rw-p 00000000 00:00 0
7f1c2b000000-7f1c2b0a0000 r-xp 00000000 08:01 2231 {lib}
7ffd1e5a1000-7ffd1e5c2000 rw-p 00000000 00:00 0                          [stack]
"""


def test_the_runtime_is_the_library_mapped_into_this_process(tmp_path: Path) -> None:
    lib = "/opt/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    (tmp_path / "maps").write_text(MAPS.format(lib=lib))
    assert _mapped_cudart(str(tmp_path / "maps")) == lib
    (tmp_path / "plain").write_text(MAPS.format(lib="/usr/lib/libm.so.6"))
    assert _mapped_cudart(str(tmp_path / "plain")) is None
    assert _mapped_cudart(str(tmp_path / "absent")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a box without CUDA")
def test_without_cuda_there_is_no_runtime_and_the_copy_keeps_torchs_path() -> None:
    assert CudaRuntime.loaded() is None


@CUDA
def test_a_copy_queued_on_the_runtime_lands_exactly_and_its_event_is_reused() -> None:
    torch.cuda.init()
    rt = CudaRuntime.loaded()
    assert rt is not None, "torch's CUDA runtime was not found in /proc/self/maps"
    src = torch.randint(0, 255, (11_158_136,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    rt.set_device(0)
    stream, pool = rt.stream(), EventPool(rt)
    for _ in range(2):
        dst.zero_()
        torch.cuda.synchronize()
        rt.copy(dst.data_ptr(), src.data_ptr(), src.numel(), stream)
        event = pool.take()
        rt.record(event, stream)
        done = RuntimeCopy(event, pool)
        done.synchronize()
        assert done.query()  # seen done: its event is back in the pool
        assert torch.equal(dst, src)
    assert len(pool._free) == 1  # the second copy reused the first one's event


@CUDA
def test_a_failing_call_names_the_call_and_the_runtimes_message() -> None:
    torch.cuda.init()
    rt = CudaRuntime.loaded()
    assert rt is not None
    with pytest.raises(RuntimeError, match=r"cudaSetDevice failed: .*\(cudaError \d+\)"):
        rt.set_device(torch.cuda.device_count() + 7)
    rt.set_device(0)
    # the failure is not left as the runtime's last error for torch to raise after its next kernel
    assert torch.arange(3, device="cuda:0").sum().item() == 3


@CUDA
def test_synchronizing_the_stream_waits_for_a_copy_queued_without_an_event() -> None:
    """What same_gpu.launch relies on when recording the event fails after a copy was queued."""
    torch.cuda.init()
    rt = CudaRuntime.loaded()
    assert rt is not None
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    rt.set_device(0)
    stream = rt.stream()
    rt.copy(dst.data_ptr(), src.data_ptr(), src.numel(), stream)
    rt.synchronize_stream(stream)
    assert torch.equal(dst, src)
