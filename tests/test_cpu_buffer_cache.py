"""ops.gather_buffer on the CPU: released fused-gather buffers are reused, within a limit."""

import pytest
import torch

from compiled import compiled_ops_or_skip
from zero_lifetime import ops

CPU = torch.device("cpu")
MIB = 1 << 20


@pytest.fixture
def cache():
    """An empty cache with the default limit; the process's state restored afterwards."""
    compiled_ops_or_skip()
    ops.empty_cpu_buffer_cache()
    limit = ops.set_cpu_buffer_cache_limit(256 * MIB)
    yield ops
    ops.set_cpu_buffer_cache_limit(limit)
    ops.empty_cpu_buffer_cache()


def _delta(before, after):
    return {k: after[k] - before[k] for k in ("hits", "misses")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_buffer_is_a_plain_exact_size_tensor(cache, dtype):
    buf = cache.gather_buffer(1000003, dtype, CPU)
    assert buf.shape == (1000003,) and buf.dtype == dtype and buf.device == CPU and buf.is_contiguous()
    assert buf.untyped_storage().nbytes() == 1000003 * buf.element_size()
    assert buf.data_ptr() % 64 == 0  # c10's CPU alignment, which vectorized kernels expect
    buf.fill_(2.5)
    torch.testing.assert_close(buf.sum(dtype=torch.float64).item(), 2.5 * 1000003)


def test_released_buffer_is_reused_by_a_request_of_about_its_size(cache):
    before = cache.cpu_buffer_cache_info()
    buf = cache.gather_buffer(MIB, torch.float32, CPU)
    address, nbytes = buf.data_ptr(), buf.untyped_storage().nbytes()
    del buf
    info = cache.cpu_buffer_cache_info()
    assert info["cached_blocks"] == 1 and nbytes <= info["cached_bytes"] < nbytes + 64 * 1024
    again = cache.gather_buffer(MIB - 1000, torch.float32, CPU)
    assert again.data_ptr() == address
    assert again.untyped_storage().nbytes() == (MIB - 1000) * 4
    after = cache.cpu_buffer_cache_info()
    assert _delta(before, after) == {"hits": 1, "misses": 1} and after["cached_blocks"] == 0


def test_a_view_keeps_its_buffer_out_of_the_cache(cache):
    buf = cache.gather_buffer(MIB, torch.float32, CPU)
    view = buf.narrow(0, 10, 100).view(10, 10)  # how a gathered param holds the buffer
    del buf
    assert cache.cpu_buffer_cache_info()["cached_blocks"] == 0
    del view
    assert cache.cpu_buffer_cache_info()["cached_blocks"] == 1


def test_a_much_smaller_request_does_not_take_a_large_block(cache):
    big = cache.gather_buffer(4 * MIB, torch.uint8, CPU)
    address = big.data_ptr()
    del big
    small = cache.gather_buffer(1 * MIB, torch.uint8, CPU)
    assert small.data_ptr() != address and cache.cpu_buffer_cache_info()["cached_blocks"] == 1
    close = cache.gather_buffer(7 * MIB // 2, torch.uint8, CPU)  # wastes an eighth: taken
    assert close.data_ptr() == address


def test_the_limit_drops_the_oldest_blocks(cache):
    cache.set_cpu_buffer_cache_limit(3 * MIB)
    bufs = [cache.gather_buffer(MIB, torch.uint8, CPU) for _ in range(4)]
    addresses = [b.data_ptr() for b in bufs]
    for i in range(4):  # released oldest first
        bufs[i] = None
    info = cache.cpu_buffer_cache_info()
    assert info["cached_blocks"] == 3 and info["cached_bytes"] == 3 * MIB
    before = cache.cpu_buffer_cache_info()
    reused = [cache.gather_buffer(MIB, torch.uint8, CPU) for _ in range(3)]
    assert sorted(b.data_ptr() for b in reused) == sorted(addresses[1:])
    assert _delta(before, cache.cpu_buffer_cache_info()) == {"hits": 3, "misses": 0}


def test_a_block_over_the_limit_is_freed_not_cached(cache):
    cache.set_cpu_buffer_cache_limit(MIB)
    buf = cache.gather_buffer(2 * MIB, torch.uint8, CPU)
    del buf
    assert cache.cpu_buffer_cache_info()["cached_bytes"] == 0


def test_limit_zero_frees_everything_and_disables(cache):
    held = [cache.gather_buffer(MIB, torch.uint8, CPU) for _ in range(2)]
    del held
    assert cache.cpu_buffer_cache_info()["cached_blocks"] == 2
    assert cache.set_cpu_buffer_cache_limit(0) == 256 * MIB
    assert cache.cpu_buffer_cache_info()["cached_bytes"] == 0
    buf = cache.gather_buffer(MIB, torch.uint8, CPU)
    del buf
    assert cache.cpu_buffer_cache_info()["cached_bytes"] == 0


def test_empty_frees_cached_blocks_only(cache):
    in_use = cache.gather_buffer(MIB, torch.float32, CPU).fill_(7.0)
    released = cache.gather_buffer(MIB, torch.float32, CPU)
    del released
    cache.empty_cpu_buffer_cache()
    assert cache.cpu_buffer_cache_info()["cached_blocks"] == 0
    assert torch.all(in_use == 7.0)
    del in_use
    assert cache.cpu_buffer_cache_info()["cached_blocks"] == 1


def test_bad_arguments_are_rejected(cache):
    with pytest.raises(RuntimeError, match="must be >= 0 bytes"):
        cache.set_cpu_buffer_cache_limit(-1)
    assert cache.cpu_buffer_cache_info()["limit_bytes"] == 256 * MIB
    with pytest.raises(RuntimeError, match="numel must be >= 0"):
        cache.gather_buffer(-1, torch.float32, CPU)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.gather_buffer(2**62, torch.float32, CPU)
    before = cache.cpu_buffer_cache_info()
    empty = cache.gather_buffer(0, torch.float32, CPU)
    assert empty.shape == (0,) and _delta(before, cache.cpu_buffer_cache_info()) == {"hits": 0, "misses": 0}


def test_live_buffers_never_share_memory(cache):
    # Many sizes, released in a shuffled order: every live buffer keeps what was written to it.
    gen = torch.Generator().manual_seed(0)
    live = {}
    for step in range(300):
        if live and torch.rand(1, generator=gen).item() < 0.45:
            key = list(live)[int(torch.randint(len(live), (1,), generator=gen))]
            buf, value = live.pop(key)
            assert torch.all(buf == value), f"buffer {key} was overwritten"
        numel = int(torch.randint(1, 3 * MIB, (1,), generator=gen))
        live[step] = (cache.gather_buffer(numel, torch.float32, CPU).fill_(float(step)), float(step))
    for key, (buf, value) in live.items():
        assert torch.all(buf == value), f"buffer {key} was overwritten"
    assert cache.cpu_buffer_cache_info()["hits"] > 0  # the reuse path ran, not only fresh blocks


def test_without_the_compiled_ops_buffers_are_plain_and_the_cache_api_says_why(monkeypatch):
    monkeypatch.setenv("ZERO_LIFETIME_FORCE_PYTHON", "1")
    buf = ops.gather_buffer(10, torch.bfloat16, CPU)
    assert buf.shape == (10,) and buf.dtype == torch.bfloat16
    for call in (ops.cpu_buffer_cache_info, ops.empty_cpu_buffer_cache,
                 lambda: ops.set_cpu_buffer_cache_limit(0)):
        with pytest.raises(RuntimeError, match="compiled ops are not loaded"):
            call()
