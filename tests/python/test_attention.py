"""The Lightning Indexer and sparse MLA on a CacheManager's pools from Python, reading the
pages in place, against numpy references over the same entries decoded with sparsekv.Codec."""

import numpy as np

import sparsekv

BLOCK = 64


def test_indexer_and_sparse_mla_match_numpy():
    m = sparsekv.CacheManager(sparsekv.model_preset("deepseek-v3.2-exp", "fp8"), capacity_blocks=8,
                              block_tokens=BLOCK)
    pools = {m.pool_info(p)["kind"]: p for p in range(m.num_pools)}
    kp, lp = pools["indexer_key"], pools["mla_latent"]
    layer = m.pool_info(lp)["layers"][0]
    seq = m.create_sequence()
    n = 4 * BLOCK + 1
    m.append_tokens(seq, list(range(n)))
    m.allocate_slots(seq, n)
    rng = np.random.default_rng(11)
    decoded = {}
    for pool in (kp, lp):
        info = m.pool_info(pool)
        codec = sparsekv.Codec(info["format"], info["dims"], info["entries_per_block"])
        slot = info["layers"].index(layer)
        arr = m.pool_array(pool)
        rows = []
        for page in m.block_table(seq, pool):
            view = arr[page, slot * info["layer_stride"]: slot * info["layer_stride"] + codec.page_bytes]
            codec.write(view, 0, rng.standard_normal((codec.entries, codec.dims)).astype(np.float32))
            rows.append(codec.read(view, 0, codec.entries))
        decoded[pool] = np.concatenate(rows).astype(np.float64)

    # The indexer: one token at position n - 1 sees keys 0..n-1; scores sum_h w_h relu(q_h . k).
    heads, top_k = 8, 32
    q = rng.standard_normal((1, heads, 128)).astype(np.float32)
    w = np.abs(rng.standard_normal((1, heads))).astype(np.float32) + 0.1
    key_table, target_table = m.block_table(seq, kp), m.block_table(seq, lp)
    got = m.lightning_indexer(kp, layer, q, w, key_table, [n - 1], top_k, target_table=target_table,
                              target_block_entries=BLOCK)
    assert got.shape == (1, top_k) and got.dtype == np.int32
    keys = decoded[kp][:n]
    scores = (np.maximum(q[0].astype(np.float64) @ keys.T, 0) * w[0][:, None]).sum(axis=0)
    physical = np.array([target_table[j // BLOCK] * BLOCK + j % BLOCK for j in range(n)])
    chosen = set(got[0].tolist())
    assert len(chosen) == top_k
    kth = np.sort(scores)[-top_k]
    for j in range(n):  # every entry above the k-th score is chosen; none well below it is
        if scores[j] > kth * (1 + 1e-5):
            assert physical[j] in chosen, j
        if scores[j] < kth * (1 - 1e-5):
            assert physical[j] not in chosen, j
    assert list(got[0]) == sorted(got[0])  # ascending

    # Sparse MLA over the chosen latent entries.
    mh = 16
    qm = rng.standard_normal((1, mh, 576)).astype(np.float32)
    scale = 1 / np.sqrt(576)
    out, lse = m.sparse_mla(lp, layer, qm, got, scale)
    assert out.shape == (1, mh, 512) and lse.shape == (1, mh)
    logical = [int(np.where(physical == p)[0][0]) for p in got[0]]
    kv = decoded[lp][logical]  # [top_k, 576]
    logits = (qm[0].astype(np.float64) @ kv.T) * scale  # [mh, top_k]
    mx = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - mx)
    ref_lse = (mx[:, 0] + np.log(p.sum(axis=1)))
    ref = (p / p.sum(axis=1, keepdims=True)) @ kv[:, :512]
    assert np.allclose(out[0], ref, rtol=1e-3, atol=1e-3), np.max(np.abs(out[0] - ref))
    assert np.allclose(lse[0], ref_lse, rtol=1e-4, atol=1e-4)  # natural log
    # The same call is the same bits (batch-invariant kernels), and -1 reads nothing.
    out2, _ = m.sparse_mla(lp, layer, qm, got, scale)
    assert np.array_equal(out, out2)
    padded = got.copy()
    padded[0, -1] = -1
    out3, _ = m.sparse_mla(lp, layer, qm, padded, scale)
    assert not np.array_equal(out3, out)
