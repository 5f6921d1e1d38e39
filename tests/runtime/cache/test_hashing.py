"""Block keys: deterministic, chained, incremental, multimodal-aware."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from hypothesis import given
from hypothesis import strategies as st

from kvrt.runtime.cache.keys import KEY_BYTES, ROOT_KEY, BlockHasher, as_token_array, chain_keys, salted_root
from tests.conftest import run_py

BS = 16


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int32)


def keys_of(toks, block_size=BS) -> list[bytes]:
    return BlockHasher(block_size).update(toks)


def test_golden_keys_pin_the_format():
    """A decode node, a storage tier and a later kvrt version must derive these exact keys: any
    change to the root, the byte order or the chaining shows up here."""
    toks = np.arange(2 * BS, dtype=np.int32)
    k0, k1 = keys_of(toks)
    assert k0 == xxhash.xxh3_128_digest(ROOT_KEY + np.arange(BS, dtype="<i4").tobytes())
    assert k1 == xxhash.xxh3_128_digest(k0 + np.arange(BS, 2 * BS, dtype="<i4").tobytes())
    assert ROOT_KEY.hex() == xxhash.xxh3_128_digest(b"kvrt.prefix-cache.root.v1").hex()
    assert len(k0) == len(k1) == KEY_BYTES


@pytest.mark.e2e
def test_same_keys_in_another_process():
    code = ("import numpy as np; from kvrt.runtime.cache.keys import BlockHasher;"
            "t = np.random.default_rng(7).integers(0, 50000, 100, dtype=np.int32);"
            "print(','.join(k.hex() for k in BlockHasher(16).update(t)))")
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split(",") == [k.hex() for k in keys_of(tokens(100, seed=7))]


def test_only_full_blocks_get_keys():
    assert len(keys_of(tokens(BS - 1))) == 0
    assert len(keys_of(tokens(3 * BS))) == 3
    assert len(keys_of(tokens(3 * BS + 5))) == 3


def test_keys_chain_the_prefix():
    a = tokens(4 * BS)
    b = a.copy()
    b[BS + 3] += 1  # block 1 differs
    ka, kb = keys_of(a), keys_of(b)
    assert ka[0] == kb[0]
    assert all(x != y for x, y in zip(ka[1:], kb[1:]))  # every later key differs too
    # equal block tokens after different prefixes give different keys
    c = np.concatenate([tokens(BS, seed=1), a[BS:2 * BS]])
    assert keys_of(c)[1] != ka[1]


def test_incremental_equals_one_shot():
    full = tokens(10 * BS + 7)
    h = BlockHasher(BS)
    got = []
    for n in (5, BS, 3 * BS + 1, 3 * BS + 2, 7 * BS, 10 * BS + 7):
        got += h.update(full[:n])
    assert got == h.keys == keys_of(full)
    assert len(h.keys) == 10
    assert h.update(full) == []  # nothing new: nothing hashed twice


def test_input_types_agree():
    t = tokens(3 * BS)
    assert keys_of(t.tolist()) == keys_of(t) == keys_of(t.astype(np.int64))
    assert keys_of(t) == chain_keys(t.astype("<i4").tobytes(), BS)
    with pytest.raises(ValueError):
        as_token_array(np.zeros((2, 2)))


def test_block_size_changes_keys():
    t = tokens(4 * BS)
    assert keys_of(t, BS)[1] != keys_of(t, 2 * BS)[0]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        BlockHasher(0)


def test_the_model_identity_roots_the_chain():
    """Every part of a node's identity (model, weights, KV layout, block size, tp) changes the
    root, so the same tokens under another model never share a key; equal configs agree."""
    import dataclasses

    from kvrt.runtime.node.config import NodeConfig

    base = NodeConfig(node="n")
    root = base.key_root
    assert root == NodeConfig(node="other-name", port=7000, num_gpu_blocks=3).key_root  # not identity
    assert root == NodeConfig(node="n", dtype="f4").key_root  # one dtype, two spellings
    fp8 = NodeConfig(node="n", kv_cache_dtype="fp8").key_root  # FP8 blocks: vLLM's two names, one root
    assert fp8 == NodeConfig(node="n", kv_cache_dtype="fp8_e4m3", dtype="float16").key_root
    assert len(root) == KEY_BYTES and root != ROOT_KEY
    changes = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=32, tp=2,
                   vocab_size=256, model_seed=1, kv_cache_dtype="fp8")
    roots = {name: NodeConfig(node="n", **{name: v}).key_root for name, v in changes.items()}
    assert root not in roots.values() and len(set(roots.values())) == len(roots), roots
    ident = base.identity()
    for f in dataclasses.fields(ident):
        other = dataclasses.replace(ident, **{f.name: "x" if isinstance(getattr(ident, f.name), str) else 99})
        assert other.key_root() != root, f.name
    toks = tokens(2 * BS)
    rooted = BlockHasher(BS, root=root).update(toks)
    assert rooted[0] == xxhash.xxh3_128_digest(root + toks[:BS].astype("<i4").tobytes())
    assert not set(rooted) & set(keys_of(toks))
    with pytest.raises(ValueError, match="root"):
        BlockHasher(BS, root=b"short")


@given(a=st.text(max_size=40), b=st.text(max_size=40))
def test_a_cache_salt_moves_the_whole_chain(a, b):
    """Requests share a block key (and so a cached block, on any tier: storage objects are named
    by these keys) only when their salts are equal; "" is no salt, the node's own root."""
    toks = tokens(3 * BS)
    ka, kb = (BlockHasher(BS, salted_root(ROOT_KEY, s)).update(toks) for s in (a, b))
    if a == b:
        assert ka == kb
    else:
        assert not set(ka) & set(kb), "two salts share a block"
    assert salted_root(ROOT_KEY, "") == ROOT_KEY
    assert len(salted_root(ROOT_KEY, a or "x")) == KEY_BYTES and salted_root(ROOT_KEY, a or "x") != ROOT_KEY


def test_the_c_loop_derives_the_python_loops_keys():
    """The block-key loop runs in C (runtime/cache/_cache_core.c): it must be built with the package
    and give exactly the reference loop's keys, for any block size, length (a partial last
    block gets no key) and parent."""
    from kvrt.runtime.cache import _cache_core
    from tests.runtime.cache import cache_reference

    parent = xxhash.xxh3_128_digest(b"another root")
    for bs in (1, 16, 64, 128):
        for n_tokens in (0, bs - 1, bs, 5 * bs + 3, 300 * bs):
            data = tokens(n_tokens, seed=bs + n_tokens).astype("<i4").tobytes()
            for root in (ROOT_KEY, parent):
                want = cache_reference.chain_keys(data, bs, root)
                assert _cache_core.chain_keys(data, bs, root) == want
                assert chain_keys(data, bs, root) == want
                assert chain_keys(memoryview(data), bs, root) == want
    with pytest.raises(ValueError):
        _cache_core.chain_keys(b"", 16, b"short")
    with pytest.raises(ValueError):
        _cache_core.chain_keys(b"", 0, ROOT_KEY)
    with pytest.raises(ValueError):
        chain_keys(b"", 16, b"short")  # a parent that is not a block key


# a fresh interpreter in which the xxhash package's extension module is replaced by one that
# does not export XXH3_128bits (kvrt's own atomics extension), before the cache's C loops load
_NO_XXH3 = """
import sys, types
import kvrt.ipc._atomic, xxhash
fake = types.ModuleType("xxhash._xxhash")
fake.__file__ = kvrt.ipc._atomic.__file__
sys.modules["xxhash._xxhash"] = fake
try:
    import kvrt.runtime.cache.keys
except ImportError as e:
    print(e)
"""

# a fresh interpreter in which the C loops were never built
_NOT_BUILT = """
import sys
sys.modules["kvrt.runtime.cache._cache_core"] = None
try:
    import kvrt.runtime.cache.keys
except ImportError as e:
    print(e)
"""


@pytest.mark.e2e
def test_the_c_loops_say_what_is_missing_when_they_cannot_load():
    """The block-key hash comes from the xxhash package's extension module at import: where it
    is not found the import fails and says what to do, and so does a checkout whose loops were
    never built (there is no other implementation to fall back on)."""
    from tests.conftest import run_py

    r = run_py(_NO_XXH3)
    assert r.returncode == 0, r.stderr
    assert "does not export XXH3_128bits" in r.stdout and "pip install --force-reinstall" in r.stdout, r.stdout
    r = run_py(_NOT_BUILT)
    assert r.returncode == 0, r.stderr
    assert "is not built" in r.stdout and "pip install -e ." in r.stdout, r.stdout
