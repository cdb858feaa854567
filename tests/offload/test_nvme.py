"""ZeRO-Infinity's NVMe path: the I/O pool and files (zkern/cpu/aio.py, csrc/aio.cpp) and the tile-pipelined Adam
over files (zkern/offload/nvme.py), against zkern's resident ShardAdam, bit for bit."""

import os
import subprocess
import sys

import pytest
import torch

from zkern import ops
from zkern.offload.nvme import NvmeAdam, NvmeShard
from zkern.optim.shard_adam import Chunk, ShardAdam, ShardGroup

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
SIZES = ([[700, 1400, 901], [517]], [[2500, 3]])  # per group, per chunk: piece sizes (odd, crossing tiles)


def _groups(seed: int, mixed: bool, shard: NvmeShard | None = None) -> list[ShardGroup]:
    """Two groups of chunks of odd sizes cut into pieces of odd sizes; gradients (bf16 in mixed precision, with a
    bf16 working copy to refresh) and masters as a shard runtime would hand them to the optimizer. With a shard,
    each group's master is a region of its files (a stage 1-2 runtime's layout: one region per group), chunks
    back to back with a gap of 100 elements between them (stage 3's frozen or other-group elements)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for sizes in SIZES:
        region = shard.add_region(sum(sum(p) + 100 for p in sizes)) if shard is not None else None
        at = 0
        pieces, chunks = [], []
        for piece_sizes in sizes:
            n = sum(piece_sizes)
            param = torch.randn(n, generator=g)
            grad = torch.randn(n, generator=g).to(torch.bfloat16 if mixed else torch.float32)
            outp = param.to(torch.bfloat16) if mixed else None
            if region is not None:
                shard.write("master", region[at:at + n], param)
                param = region[at:at + n]
                at += n + 100
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


def _nvme(tmp_path, seed, mixed, tile=1024, buffers=3, name="rank0"):
    shard = NvmeShard(str(tmp_path / name), ops.nvme_pool(thread_count=2), sub_group_size=tile,
                      buffer_count=buffers)
    groups = _groups(seed, mixed, shard)
    return shard, groups, NvmeAdam(groups, OPTIONS, shard)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("tile, buffers", [(1024, 3), (3072, 5)])
def test_nvme_adam_equals_the_resident_adam_bit_for_bit(tmp_path, mixed, tile, buffers):
    resident = _groups(1, mixed)
    adam = ShardAdam(resident, OPTIONS)
    shard, streamed, nvme = _nvme(tmp_path, 1, mixed, tile, buffers)
    g = torch.Generator().manual_seed(7)
    # step 2: a piece of each group gets no gradient (its state and step count stay), so steps differ after it
    actives = [None, [[True, False, True, True], [True, False]], None, [[False, True, True, True], [True, True]]]
    calls = []
    for active in actives:
        for a, b in zip(resident, streamed):
            for ca, cb in zip(a.chunks, b.chunks):
                grad = torch.randn(ca.grad.numel(), generator=g).to(ca.grad.dtype)
                ca.grad.copy_(grad)
                cb.grad.copy_(grad)
        adam.step(grad_scale=0.5, active=active)
        calls.clear()
        nvme.step(grad_scale=0.5, active=active, before_chunk=lambda gi, ci: calls.append(("before", gi, ci)),
                  after_chunk=lambda gi, ci: calls.append(("after", gi, ci)))
        # every chunk once each side, its gradient waited for before it steps, its parameters sent after
        assert sorted(calls) == sorted([(w, gi, ci) for w in ("before", "after") for gi, s in enumerate(SIZES)
                                        for ci in range(len(s))])
        for gi, s in enumerate(SIZES):
            for ci in range(len(s)):
                assert calls.index(("before", gi, ci)) < calls.index(("after", gi, ci))
    assert nvme.steps == adam.steps
    for gi, (a, b) in enumerate(zip(resident, streamed)):
        for ci, (ca, cb) in enumerate(zip(a.chunks, b.chunks)):
            n = ca.param.numel()
            lo = adam._start[gi][ci]
            assert torch.equal(shard.read("master", cb.param), ca.param), (gi, ci)
            assert torch.equal(shard.read("exp_avg", cb.param), adam.exp_avg[gi][lo:lo + n]), (gi, ci)
            assert torch.equal(shard.read("exp_avg_sq", cb.param), adam.exp_avg_sq[gi][lo:lo + n]), (gi, ci)
            if mixed:
                assert torch.equal(cb.out, ca.out), (gi, ci)
    assert not torch.equal(shard.read("master", streamed[0].chunks[0].param), _groups(1, mixed)[0].chunks[0].param)
    # the optimizer's state_dict reads the same states back (torch's format), and loads into another shard
    state = nvme.state_dict()
    for gi, g_ in enumerate(resident):
        for i in range(len(g_.pieces)):
            mine = adam.piece_state(gi, i)
            theirs = state["state"][state["param_groups"][gi]["params"][i]]
            assert torch.equal(theirs["exp_avg"].reshape(-1), mine["exp_avg"].reshape(-1))
            assert int(theirs["step"]) == mine["step"]
    _, _, other = _nvme(tmp_path, 1, mixed, tile, buffers, name="other")
    other.load_state_dict(state)
    assert other.steps == nvme.steps
    assert torch.equal(other.shard.read("exp_avg_sq", other.shard_groups[1].pieces[0]),
                       shard.read("exp_avg_sq", streamed[1].pieces[0]))


def test_element_ranges_read_and_write_across_blocks(tmp_path):
    shard = NvmeShard(str(tmp_path / "r"), ops.nvme_pool(), sub_group_size=2048, buffer_count=3)
    region = shard.add_region(5000)
    values = torch.randn(5000)
    shard.write("master", region, values)
    part = torch.randn(1500)
    shard.write("master", region[1000:2500], part)  # starts and ends inside 4 KiB blocks
    values[1000:2500] = part
    assert torch.equal(shard.read("master", region), values)
    assert torch.equal(shard.read("master", region[4090:5000].view(10, 91)), values[4090:].view(10, 91))
    assert torch.equal(shard.read("exp_avg", region[3:7]), torch.zeros(4))  # the moments start at zero
    with pytest.raises(ValueError, match="not a slice of this shard"):
        shard.read("master", torch.empty(4, device="meta"))


def test_nvme_adam_refuses_a_step_on_a_changed_file_before_touching_anything(tmp_path):
    shard, groups, nvme = _nvme(tmp_path, 2, False, name="r")
    before = shard.read("master", groups[0].chunks[0].param)
    os.truncate(tmp_path / "r" / "exp_avg_sq-1.bin", 4096)
    with pytest.raises(OSError, match=r"exp_avg_sq-1\.bin changed under zkern"):
        nvme.step()
    assert torch.equal(shard.read("master", groups[0].chunks[0].param), before) and nvme.steps == [[0] * 4, [0] * 2]
    with pytest.raises(ValueError, match="buffer_count must be >= 3"):
        NvmeShard(str(tmp_path / "s"), ops.nvme_pool(), sub_group_size=1024, buffer_count=2)
