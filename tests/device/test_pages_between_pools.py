"""device/page_copies.py PagesBetweenPools: pages of one pool copied into another of the same layout (a self-draft
takes the target's KV of a prompt this way, engine/draft_proposer.py), float and quantized pools alike, any count
(groups padded with the reserved page), no other page touched; pools of another layout are told apart."""

import jax
import numpy as np
import pytest

from jaxserve.device.page_copies import PAGE_COPY_GROUP, PagesBetweenPools, pools_alike
from jaxserve.models import KVPages

LAYERS, PAGE_SIZE, HEADS, WIDTH = 2, 4, 3, 8


def _random_pool(num_pages: int, kv_dtype: str, seed: int) -> KVPages:
    pool = KVPages.zeros(LAYERS, num_pages, PAGE_SIZE, HEADS, WIDTH, np.float32, kv_dtype)
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(pool)))
    leaves = [
        jax.random.randint(key, leaf.shape, -100, 100).astype(leaf.dtype)
        if np.issubdtype(leaf.dtype, np.integer)
        else jax.random.normal(key, leaf.shape).astype(leaf.dtype)
        for key, leaf in zip(keys, jax.tree.leaves(pool))
    ]
    return jax.tree.unflatten(jax.tree.structure(pool), leaves)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_pages_copy_into_their_places_and_nothing_else_changes(kv_dtype):
    source, dest = _random_pool(48, kv_dtype, 1), _random_pool(40, kv_dtype, 2)
    assert pools_alike(source, dest)
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(dest)]
    # more than one group, the last one short; source and destination pages in no common order
    source_pages = [int(p) for p in np.random.default_rng(0).permutation(np.arange(1, 48))[: PAGE_COPY_GROUP + 5]]
    dest_pages = list(range(39, 39 - len(source_pages), -1))
    copied = PagesBetweenPools(source, dest)(source, dest, source_pages, dest_pages)
    for src, old, new in zip(jax.tree.leaves(source), before, jax.tree.leaves(copied)):
        new = np.asarray(new)
        np.testing.assert_array_equal(new[dest_pages], np.asarray(src)[source_pages])
        untouched = [p for p in range(1, 40) if p not in dest_pages]
        np.testing.assert_array_equal(new[untouched], old[untouched])


def test_pools_of_another_layout_are_told_apart():
    pool = KVPages.zeros(LAYERS, 8, PAGE_SIZE, HEADS, WIDTH, np.float32)
    assert pools_alike(pool, KVPages.zeros(LAYERS, 20, PAGE_SIZE, HEADS, WIDTH, np.float32))
    assert not pools_alike(pool, KVPages.zeros(LAYERS + 1, 8, PAGE_SIZE, HEADS, WIDTH, np.float32))
    assert not pools_alike(pool, KVPages.zeros(LAYERS, 8, PAGE_SIZE * 2, HEADS, WIDTH, np.float32))
    assert not pools_alike(pool, KVPages.zeros(LAYERS, 8, PAGE_SIZE, HEADS, WIDTH + 1, np.float32))
    assert not pools_alike(pool, KVPages.zeros(LAYERS, 8, PAGE_SIZE, HEADS, WIDTH, np.float32, "int8"))
    assert not pools_alike(pool, KVPages.zeros(LAYERS, 8, PAGE_SIZE, HEADS, WIDTH, jax.numpy.bfloat16))
    with pytest.raises(ValueError, match="3 pages to copy into 2"):
        PagesBetweenPools(pool, pool)(pool, pool, [1, 2, 3], [1, 2])
