"""sparsekv.Codec on numpy: every format's rows into a pool's page in place and back, what a
lossless format keeps exactly, how close a quantizing one stays (also on a second pass), and
errors."""

import numpy as np
import pytest

import sparsekv


def layer_page(m, pool, page, layer_slot, page_bytes):
    info = m.pool_info(pool)
    at = layer_slot * info["layer_stride"]
    return m.pool_array(pool)[page, at: at + page_bytes]


@pytest.mark.parametrize("model,precision", [("deepseek-v3.2-exp", "bf16"), ("deepseek-v3.2-exp", "fp8"),
                                             ("deepseek-v3.2-exp", "c8"), ("deepseek-v4-flash", "fp8")])
def test_every_pool_round_trips_in_place(model, precision):
    spec = sparsekv.model_preset(model, precision)
    m = sparsekv.CacheManager(spec, capacity_blocks=4, block_tokens=128)
    rng = np.random.default_rng(3)
    for p in range(m.num_pools):
        info = m.pool_info(p)
        if info["kind"] == "compressor_state":
            continue  # state snapshots are not token rows
        codec = sparsekv.Codec(info["format"], info["dims"], info["entries_per_block"])
        assert codec.page_bytes == info["page_bytes"]
        page = layer_page(m, p, 1, len(info["layers"]) - 1, codec.page_bytes)
        n = min(8, codec.entries)
        rows = rng.standard_normal((n, codec.dims)).astype(np.float32)
        codec.write(page, 0, rows)  # in place: the pool's memory changed
        assert np.any(m.pool_array(p)[1] != 0)
        back = codec.read(page, 0, n)
        assert back.shape == (n, codec.dims) and back.dtype == np.float32
        if info["format"] == "bf16":
            bf16 = (rows.view(np.uint32) + 0x7FFF + ((rows.view(np.uint32) >> 16) & 1)) >> 16
            assert np.array_equal(back, (bf16 << 16).astype(np.uint32).view(np.float32))
        else:
            assert np.max(np.abs(back - rows)) < 0.1 * np.max(np.abs(rows)), info["format"]
        # Decoded rows written again decode to nearly themselves (a quantizing format may pick
        # another scale from the rounded values, so not always the same bytes).
        codec.write(page, 0, back)
        again = codec.read(page, 0, n)
        assert np.max(np.abs(again - back)) <= 0.1 * np.max(np.abs(back)), info["format"]
        bf = codec.read(page, 0, n, dtype="bfloat16")
        assert bf.dtype == np.uint16 and bf.shape == (n, codec.dims)


def test_codec_errors():
    codec = sparsekv.Codec("fp8_ds_mla", 576, 64)
    page = np.zeros(codec.page_bytes, dtype=np.uint8)
    with pytest.raises(sparsekv.InvalidArgument):
        codec.write(page, 0, np.zeros((2, 512), dtype=np.float32))  # other dims
    with pytest.raises(sparsekv.OutOfRange):
        codec.write(page, 63, np.zeros((2, 576), dtype=np.float32))  # past the page's entries
    with pytest.raises(sparsekv.InvalidArgument):
        codec.read(np.zeros(100, dtype=np.uint8), 0, 1)  # too short a page
    with pytest.raises(TypeError):
        codec.write(page, 0, np.zeros((2, 576), dtype=np.float64))
    with pytest.raises((ValueError, BufferError)):
        codec.write(bytes(codec.page_bytes), 0, np.zeros((1, 576), dtype=np.float32))  # read-only
    with pytest.raises(sparsekv.InvalidArgument):
        sparsekv.Codec("no_such_format", 576, 64)


def e4m3(bits):
    """fp8 e4m3fn bits to float64 (OCP FP8: bias 7, no infinities, 0x7f/0xff NaN)."""
    bits = np.asarray(bits, dtype=np.uint16)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp = (bits >> 3) & 0xF
    man = bits & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    return sign * val


def bf16(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("model,precision", [("deepseek-v3.2-exp", "fp8"), ("deepseek-v3.2-exp", "c8"),
                                             ("deepseek-v3.2-exp", "bf16"), ("deepseek-v4-flash", "fp8")])
def test_engine_views_are_the_formats_fields_in_place(model, precision):
    """What the engine views show of a page the codec wrote, decoded by hand from the formats'
    public layouts, equals what the codec decodes; and the views share the pool's memory."""
    m = sparsekv.CacheManager(sparsekv.model_preset(model, precision), capacity_blocks=3, block_tokens=128)
    rng = np.random.default_rng(5)
    for p in range(m.num_pools):
        info = m.pool_info(p)
        if info["kind"] == "compressor_state":
            views = m.engine_view(p)
            views["values"][2, 0, 3] = 1.5  # fp32 state, in place
            assert np.frombuffer(m._m._page_bytes(p, 2), dtype=np.float32)[3] == 1.5
            continue
        codec = sparsekv.Codec(info["format"], info["dims"], info["entries_per_block"])
        slot = len(info["layers"]) - 1
        page = m.pool_array(p)[1, slot * info["layer_stride"]: slot * info["layer_stride"] + codec.page_bytes]
        rows = rng.standard_normal((codec.entries, codec.dims)).astype(np.float32)
        codec.write(page, 0, rows)
        want = codec.read(page, 0, codec.entries).astype(np.float64)
        v = m.engine_view(p)
        fmt = info["format"]
        if fmt == "bf16":
            got = bf16(v["values"][1, slot])
        elif fmt == "fp8_ds_mla":
            nope = e4m3(v["nope"][1, slot]) * np.repeat(v["scales"][1, slot], 128, axis=1)
            got = np.concatenate([nope, bf16(v["rope"][1, slot])], axis=1)
        elif fmt == "c8_mla":
            nope = v["nope"][1, slot].astype(np.float64) * np.repeat(v["scales"][1, slot], 128, axis=1)
            got = np.concatenate([nope, bf16(v["rope"][1, slot])], axis=1)
        elif fmt == "fp8_v4":
            scale = 2.0 ** (v["scales"][1, slot].astype(np.float64) - 127)
            nope = e4m3(v["nope"][1, slot]) * np.repeat(scale, 64, axis=1)
            got = np.concatenate([nope, bf16(v["rope"][1, slot])], axis=1)
        elif fmt == "idx_fp8":
            got = e4m3(v["values"][1, slot]) * v["scales"][1, slot][:, None]
        elif fmt == "idx_c8":
            got = v["values"][1, slot].astype(np.float64) * v["scales"][1, slot][:, None]
        else:
            pytest.fail(f"a format without an engine view: {fmt}")
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6), fmt
        # In place: a view's write is the pool's.
        first = next(iter(v.values()))
        assert np.shares_memory(first, m.pool_array(p))
