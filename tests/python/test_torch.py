"""Page pools as torch tensors through DLPack (no numpy in between): the tensor's memory is the
pool's (a write through it is what C++ reads, and the reverse), a tensor outlives its manager,
views are refused past the pool's end, the per-format engine tensors are the bytes the codecs
write, and the codecs take torch tensors (bf16 and float32) in and give them back."""

import gc

import numpy as np
import pytest
import torch

import sparsekv

BLOCK = 64


def manager(precision="fp8", preset="deepseek-v3.2-exp", capacity=8, **kw):
    return sparsekv.CacheManager(sparsekv.model_preset(preset, precision), capacity_blocks=capacity,
                                 block_tokens=kw.pop("block_tokens", BLOCK), **kw)


def test_a_pool_tensor_is_the_pools_memory_both_ways():
    m = manager()
    for pool in range(m.num_pools):
        info = m.pool_info(pool)
        t = m.pool_tensor(pool)
        assert t.dtype == torch.uint8 and t.device.type == "cpu"
        assert tuple(t.shape) == (info["capacity"], info["block_stride"])
        assert t.data_ptr() == m.pool_array(pool).ctypes.data  # the same memory as the array
        t[3, :] = 0x3C + pool  # torch writes, C++ reads
        assert m._m._page_bytes(pool, 3) == bytes([0x3C + pool]) * info["block_stride"]
        m._m._fill_page(pool, 5, 0x71)  # C++ writes, torch reads
        assert bool((t[5] == 0x71).all())
        # An in-place torch op on a slice lands in the page too.
        t[6, 10:20].fill_(9)
        assert m._m._page_bytes(pool, 6)[10:20] == bytes([9]) * 10


def test_a_tensor_outlives_its_manager_and_its_producer():
    m = manager()
    t = m.pool_tensor(1)
    view = m.engine_tensors(0)["rope"]
    t[0, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    view[2, 0, 0, :] = 1.5
    del m
    gc.collect()
    assert t[0, :4].tolist() == [1, 2, 3, 4]  # the pool is still there
    t[1, :] = 7
    assert bool((t[1] == 7).all())
    assert bool((view[2, 0, 0] == 1.5).all())


def test_dlpack_producers_work_with_numpy_too_and_a_capsule_no_one_takes_is_freed():
    m = manager()
    region = m.pool_dlpack(0)
    assert region.__dlpack_device__() == (1, 0)  # kDLCPU
    a = np.from_dlpack(region)
    assert a.ctypes.data == m.pool_array(0).ctypes.data
    for _ in range(1000):  # capsules dropped unconsumed: each frees its reference (no leak, no crash)
        region.__dlpack__()
    with pytest.raises(ValueError):
        region.__dlpack__(stream=1)


def test_views_past_the_pool_or_with_bad_strides_are_refused():
    m = manager()
    info = m.pool_info(0)
    pages, stride = info["capacity"], info["block_stride"]
    with pytest.raises(sparsekv.OutOfRange):
        m._m.region(0, 1, "uint8", [pages, stride], [stride, 1])  # one byte past the end
    with pytest.raises(sparsekv.OutOfRange):
        m._m.region(0, 0, "float32", [pages, stride // 4 + 1], [stride, 4])
    with pytest.raises(sparsekv.InvalidArgument):
        m._m.region(0, 0, "float32", [2, 3], [stride, 2])  # a stride not a multiple of 4
    with pytest.raises(sparsekv.InvalidArgument):
        m._m.region(0, 0, "complex64", [1], [8])
    with pytest.raises(sparsekv.InvalidArgument):
        m._m.region(0, 0, "uint8", [2, 3], [-1, 1])
    with pytest.raises(sparsekv.OutOfRange):  # a span that overflows 64 bits wraps to nothing small
        m._m.region(0, 0, "uint8", [2, 1 << 62], [1 << 62, 1])
    with pytest.raises(sparsekv.OutOfRange):
        m._m.region(0, pages * stride + 1, "uint8", [0], [1])  # empty, but starting past the end
    last = m._m.region(0, pages * stride - 4, "float32", [1], [4])  # the last 4 bytes are fine
    assert torch.from_dlpack(last).shape == (1,)


@pytest.mark.parametrize("preset,precision", [("deepseek-v3.2-exp", "fp8"), ("deepseek-v3.2-exp", "c8"),
                                              ("deepseek-v3.2-exp", "bf16"), ("deepseek-v4-flash", "fp8")])
def test_engine_tensors_are_the_engine_views_in_torch(preset, precision):
    m = manager(precision, preset, capacity=4, block_tokens=128, window_capacity_blocks=4, state_capacity_blocks=4)
    rng = np.random.default_rng(7)
    for pool in range(m.num_pools):
        arr = m.pool_array(pool)
        arr[:] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
        views, tensors = m.engine_view(pool), m.engine_tensors(pool)
        assert views.keys() == tensors.keys()
        for name, v in views.items():
            t = tensors[name]
            assert tuple(t.shape) == v.shape, name
            assert [s * t.element_size() for s in t.stride()] == list(v.strides), name
            # Compared as bits (random bytes hold NaNs); numpy holds bf16 as its bits.
            bits = {torch.bfloat16: (torch.int16, np.int16), torch.float32: (torch.int32, np.int32)}
            if t.dtype in bits:
                tt, nt = bits[t.dtype]
                assert np.array_equal(t.view(tt).numpy(), v.view(nt)), name
            else:
                assert np.array_equal(t.numpy(), v), name


def test_codecs_take_and_give_torch_tensors_in_the_pools_memory():
    m = manager("fp8")
    info = m.pool_info(0)  # fp8_ds_mla latent
    codec = sparsekv.Codec(info["format"], info["dims"], info["entries_per_block"])
    page = m.pool_tensor(0)[2, 0:codec.page_bytes]  # layer slot 0 of page 2, a view
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(5, info["dims"], generator=g)
    codec.write(page, 7, rows.to(torch.bfloat16))  # bf16 in
    back = codec.read_tensor(page, 7, 5, "bfloat16")
    assert back.dtype == torch.bfloat16 and tuple(back.shape) == (5, info["dims"])
    # fp8 keeps the rope part exactly (bf16) and the rest within e4m3's precision per tile.
    ref = rows.to(torch.bfloat16).float()
    got = back.float()
    assert torch.equal(got[:, 512:], ref[:, 512:])
    assert float((got[:, :512] - ref[:, :512]).abs().max()) <= 0.07 * float(ref[:, :512].abs().max())
    # The bytes are in the pool, at the slot's place in FlashMLA's layout.
    nope = m.engine_tensors(0)["nope"][2, 0, 7:12]
    assert torch.equal(nope, page[7 * 656:7 * 656 + 5 * 656].view(5, 656)[:, :512])
    # float32 in, float32 out, through a numpy page as well.
    codec.write(m.pool_array(0)[3, 0:codec.page_bytes], 0, rows)
    f = codec.read_tensor(m.pool_tensor(0)[3, 0:codec.page_bytes], 0, 5)
    assert f.dtype == torch.float32
    assert torch.equal(f[:, 512:], rows[:, 512:].to(torch.bfloat16).float())
    with pytest.raises(TypeError):
        codec.write(page, 0, rows.to(torch.float64))
