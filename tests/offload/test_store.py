"""ShardStore: a shard's range reads back what was written to it in every home, stand-ins hold no memory, and a
stand-in with no file behind it is an error, not a silent zero.

    python -m pytest tests/offload/test_store.py -q
"""

from __future__ import annotations

import pytest
import torch

from zkern import ops
from zkern.offload.nvme import NvmeShard
from zkern.offload.store import ShardStore


@pytest.fixture
def nvme_store(tmp_path):
    shard = NvmeShard(str(tmp_path / "files"), ops.nvme_pool(thread_count=1, block_size=1 << 20, queue_depth=4),
                      sub_group_size=4096, remove=True)
    yield ShardStore(torch.device("cpu"), nvme=shard)
    shard.close()


@pytest.mark.parametrize("home", ["device", "host"])
def test_a_resident_shard_is_itself(home):
    store = ShardStore(torch.device("cpu"))
    t = store.allocate(1000, torch.bfloat16, home)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and not store.in_files(t)
    assert torch.count_nonzero(t) == 0
    values = torch.randn(17).to(torch.bfloat16)
    store.write(t[100:117], values)
    assert store.read(t[100:117]).data_ptr() == t[100:117].data_ptr()  # no copy for memory
    assert torch.equal(t[100:117], values) and torch.count_nonzero(t[:100]) == 0
    assert store.resident_bytes(t) == 2000


def test_an_nvme_shard_reads_back_what_was_written_range_by_range(nvme_store):
    numel = 10_007  # not a multiple of the 4 KiB blocks the files are padded to
    master = nvme_store.allocate(numel, torch.float32, "nvme")
    assert nvme_store.in_files(master) and nvme_store.resident_bytes(master) == 0
    expect = torch.zeros(numel)
    torch.testing.assert_close(nvme_store.read(master), expect, rtol=0, atol=0)  # zero-filled
    gen = torch.Generator().manual_seed(0)
    for lo, hi in [(0, 1), (5, 4100), (4095, 4097), (9000, numel)]:
        values = torch.randn(hi - lo, generator=gen)
        nvme_store.write(master[lo:hi], values)
        expect[lo:hi] = values
    torch.testing.assert_close(nvme_store.read(master), expect, rtol=0, atol=0)
    torch.testing.assert_close(nvme_store.read(master[4095:4200]), expect[4095:4200], rtol=0, atol=0)
    # the moments are other files laid out alike: writing one state leaves the others alone
    nvme_store.write(master[:10], torch.ones(10), state="exp_avg")
    torch.testing.assert_close(nvme_store.read(master[:10], state="exp_avg"), torch.ones(10), rtol=0, atol=0)
    torch.testing.assert_close(nvme_store.read(master[:10]), expect[:10], rtol=0, atol=0)


def test_bad_requests_name_what_is_wrong(nvme_store):
    store = ShardStore(torch.device("cpu"))
    with pytest.raises(ValueError, match="optimizer's files"):
        store.allocate(8, torch.float32, "nvme")
    with pytest.raises(ValueError, match=r"master dtype \(torch.float32\), got torch.float16"):
        nvme_store.allocate(8, torch.float16, "nvme")
    with pytest.raises(ValueError, match="home must be one of"):
        store.allocate(8, torch.float32, "disk")
    orphan = torch.empty(8, device="meta")
    with pytest.raises(RuntimeError, match="no file behind it"):
        store.read(orphan)
    with pytest.raises(RuntimeError, match="no file behind it"):
        store.write(orphan, torch.zeros(8))
