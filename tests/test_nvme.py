"""ZeRO-Infinity's NVMe path: the I/O pool and files (zkern/cpu/aio.py, csrc/aio.cpp) and the tile-pipelined Adam
over files (zkern/engine/nvme.py), against zkern's resident ShardAdam, bit for bit."""

import os
import subprocess
import sys

import pytest
import torch

from zkern import ops
from zkern.engine.nvme import NvmeAdam
from zkern.engine.optimizer import Chunk, ShardAdam, ShardGroup

pytestmark = pytest.mark.skipif(not ops.cpu_ext.available(), reason="needs the C++ extension (make setup)")


# -- files ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False])
def test_files_round_trip_aligned_and_unaligned_requests(tmp_path, direct):
    from zkern.cpu.aio import NvmeFile, aligned_empty

    pool = ops.nvme_pool(thread_count=3, block_size=8192, queue_depth=2)  # many blocks per request, a short queue
    f = NvmeFile(str(tmp_path / "a.bin"), 1 << 20, pool, direct=direct)
    data = aligned_empty(1 << 18, torch.float32)
    data.copy_(torch.randn(1 << 18))
    f.write(data)  # aligned: O_DIRECT where the file system takes it
    odd = torch.randn(1001)
    f.write(odd, 4 * 7)  # unaligned buffer, size and offset: the buffered descriptor
    back = aligned_empty(1 << 18, torch.float32)
    f.read(back)
    expect = data.clone()
    expect[7:7 + 1001] = odd
    assert torch.equal(back, expect)
    works = [f.read(torch.empty(100), 4 * i * 100, async_op=True) for i in range(8)]  # several in flight
    for w in works:
        w.wait()
    assert f.io_path in ("O_DIRECT", "buffered") and (direct or f.io_path == "buffered")


def test_bad_paths_and_requests_are_clear_errors(tmp_path):
    from zkern.cpu.aio import NvmeFile

    pool = ops.nvme_pool()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"cannot create .*file/sub/a\.bin"):
        NvmeFile(str(blocker / "sub" / "a.bin"), 4096, pool)  # a missing (not a directory) path
    f = NvmeFile(str(tmp_path / "b.bin"), 4096, pool)
    with pytest.raises(ValueError, match="outside the file's 4096"):
        f.read(torch.empty(2000), 0)
    with pytest.raises(ValueError, match="contiguous host tensor"):
        f.write(torch.empty(10, 2)[:, 0], 0)
    os.truncate(tmp_path / "b.bin", 1000)  # shortened behind zkern's back: a read past the end names the file
    with pytest.raises(OSError, match=r"b\.bin reached the end of the file"):
        f.read(torch.empty(1000), 0)
    with pytest.raises(OSError, match=r"b\.bin changed under zkern \(it holds 1000 bytes of 4096"):
        f.check()
    with pytest.raises(ValueError, match="thread_count"):
        ops.nvme_pool(thread_count=0)


FULL_DISK = """
import resource, signal, sys
from zkern import ops
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    ops.nvme_file(sys.argv[1], 8 << 20, ops.nvme_pool())
except OSError as e:
    print("OSError", e)
"""


def test_a_full_disk_is_an_error_when_the_file_is_made(tmp_path):
    """The whole file is reserved when it is created, so a full disk (here: a 1 MiB file-size limit) fails then,
    naming the path, never inside a step."""
    path = tmp_path / "big.bin"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=60)
    assert "OSError" in out.stdout and "cannot reserve 8388608 bytes for" in out.stdout and str(path) in out.stdout, \
        out.stdout + out.stderr


# -- the tile-pipelined Adam ---------------------------------------------------------------------------------------
def _groups(seed: int, mixed: bool) -> list[ShardGroup]:
    """Two groups of chunks of odd sizes cut into pieces of odd sizes; gradients (bf16 in mixed precision, with a
    bf16 working copy to refresh) and masters as a shard runtime would hand them to the optimizer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for sizes in ([[700, 1400, 901], [517]], [[2500, 3]]):
        pieces, chunks = [], []
        for piece_sizes in sizes:
            n = sum(piece_sizes)
            param = torch.randn(n, generator=g)
            grad = torch.randn(n, generator=g).to(torch.bfloat16 if mixed else torch.float32)
            outp = param.to(torch.bfloat16) if mixed else None
            spans, start = [], 0
            for k in piece_sizes:
                spans.append((len(pieces), start, k))
                pieces.append(param[start:start + k])
                start += k
            chunks.append(Chunk(param=param, grad=grad, out=outp, pieces=spans))
        out.append(ShardGroup(pieces=pieces, chunks=chunks))
    return out


OPTIONS = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw=True),
           dict(lr=3e-3, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.0, adamw=True)]


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("tile, buffers", [(1024, 3), (3072, 5)])
def test_nvme_adam_equals_the_resident_adam_bit_for_bit(tmp_path, mixed, tile, buffers):
    resident, streamed = _groups(1, mixed), _groups(1, mixed)
    adam = ShardAdam(resident, OPTIONS)
    nvme = NvmeAdam(streamed, OPTIONS, str(tmp_path / "rank0"), pool=ops.nvme_pool(thread_count=2), tile=tile,
                    buffer_count=buffers)
    g = torch.Generator().manual_seed(7)
    # step 2: a piece of each group gets no gradient (its state and step count stay), so steps differ after it
    actives = [None, [[True, False, True, True], [True, False]], None, [[False, True, True, True], [True, True]]]
    for active in actives:
        for a, b in zip(resident, streamed):
            for ca, cb in zip(a.chunks, b.chunks):
                grad = torch.randn(ca.grad.numel(), generator=g).to(ca.grad.dtype)
                ca.grad.copy_(grad)
                cb.grad.copy_(grad)
        adam.step(grad_scale=0.5, active=active)
        nvme.step(grad_scale=0.5, active=active)
    assert nvme.steps == adam.steps
    for gi, (a, b) in enumerate(zip(resident, streamed)):
        for ci, (ca, cb) in enumerate(zip(a.chunks, b.chunks)):
            n = ca.param.numel()
            lo = adam._start[gi][ci]
            assert torch.equal(nvme.read_state("master", gi, ci), ca.param), (gi, ci)
            assert torch.equal(nvme.read_state("exp_avg", gi, ci), adam.exp_avg[gi][lo:lo + n]), (gi, ci)
            assert torch.equal(nvme.read_state("exp_avg_sq", gi, ci), adam.exp_avg_sq[gi][lo:lo + n]), (gi, ci)
            if mixed:
                assert torch.equal(cb.out, ca.out), (gi, ci)
    assert not torch.equal(nvme.read_state("master", 0, 0), _groups(1, mixed)[0].chunks[0].param)  # it moved


def test_nvme_adam_refuses_a_step_on_a_changed_file_before_touching_anything(tmp_path):
    groups = _groups(2, False)
    nvme = NvmeAdam(groups, OPTIONS, str(tmp_path / "r"), pool=ops.nvme_pool(), tile=1024, buffer_count=3)
    before = nvme.read_state("master", 0, 0)
    os.truncate(tmp_path / "r" / "exp_avg_sq.bin", 4096)
    with pytest.raises(OSError, match=r"exp_avg_sq\.bin changed under zkern"):
        nvme.step()
    assert torch.equal(nvme.read_state("master", 0, 0), before) and nvme.steps == [[0] * 4, [0] * 2]
    with pytest.raises(ValueError, match="buffer_count must be >= 3"):
        NvmeAdam(groups, OPTIONS, str(tmp_path / "s"), pool=ops.nvme_pool(), tile=1024, buffer_count=2)
