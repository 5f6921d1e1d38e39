"""Per-request `cache_salt` through a real node (a tiny checkpoint with its tokenizer, a file
storage tier) and the official openai client: a tenant's repeated prompt is served from the
cache, the same prompt under another salt, or none, is not (`cached_tokens` 0), the answers do
not change, the native client's salt is the same salt, the storage objects are named by salted
keys, and a salt that is not a bounded non-empty string is refused."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.cache.keys import BlockHasher, salted_root
from kvrt.runtime.client.api import MAX_CACHE_SALT_BYTES
from kvrt.runtime.client.tokenizer import HFTokenizer
from kvrt.workers.storage.base import FileStorage
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _client, _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

pytestmark = pytest.mark.e2e
BS = 8
SYSTEM = "You answer questions about caches in one short sentence, politely and without lists. "


def test_cache_salt_keeps_tenants_apart_in_usage_and_storage(node, tmp_path):
    directory = tmp_path / "qwen2"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=5, vocab_size=320)
    make_tokenizer_dir(directory)
    tok = HFTokenizer.from_dir(str(directory))
    store, http = tmp_path / "store", free_port()
    with launched(node, tmp_path, "--block-size", str(BS), "--model", str(directory), "--num-gpu-blocks", "128",
                  "--storage", f"file:{store}", "--http-port", str(http)) as ln:
        _wait_healthy(http)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/kvrt/cache", timeout=10) as r:
            root = bytes.fromhex(json.load(r)["key_root"])
        oa, model = _client(http), str(directory)

        def cached(salt: str | None, prompt=SYSTEM + "What is a block?") -> tuple[int, str]:
            extra = {} if salt is None else {"cache_salt": salt}
            r = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

        first, text = cached("tenant-a")
        assert first == 0
        again, same = cached("tenant-a")
        assert again > 0 and same == text, "a tenant's repeated prompt is served from its cache"
        assert cached("tenant-b") == (0, text), "another salt shares nothing, and answers the same"
        assert cached(None) == (0, text), "no salt shares nothing with a salt"
        assert cached(None)[0] > 0 and cached("tenant-b")[0] > 0 and cached("tenant-a")[0] == again
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why salt a cache?"}]

        def chat_cached(salt: str) -> int:
            r = oa.chat.completions.create(model=model, messages=chat, max_tokens=2, temperature=0,
                                           extra_body={"cache_salt": salt})
            return r.usage.prompt_tokens_details.cached_tokens

        assert chat_cached("tenant-c") == 0 and chat_cached("tenant-c") > 0 and chat_cached("tenant-d") == 0
        ids = tok.encode(SYSTEM + "What is a block?")
        assert ln.client.generate(ids, 2, cache_salt="tenant-a").cached_device >= again  # the HTTP tenant's blocks
        assert ln.client.generate(ids, 2, cache_salt="tenant-e").cached_device == 0
        with pytest.raises(ValueError, match="cache_salt"):
            ln.client.generate(ids, 2, cache_salt="x" * (MAX_CACHE_SALT_BYTES + 1))
        for bad in ("", 7, "é" * (MAX_CACHE_SALT_BYTES // 2 + 1)):
            with pytest.raises(openai.BadRequestError, match="cache_salt"):
                oa.completions.create(model=model, prompt="hi", max_tokens=1, extra_body={"cache_salt": bad})
        ln.idle_stats()
    files = FileStorage(str(store), 0)
    chains = {salt: BlockHasher(BS, salted_root(root, salt)).update(ids) for salt in ("", "tenant-a", "tenant-b")}
    assert all(len(k) == len(ids) // BS for k in chains.values())
    for salt, keys in chains.items():  # every tenant's blocks were written through under its own keys
        assert all(files.contains(k) for k in keys), salt
    assert len({k for keys in chains.values() for k in keys}) == 3 * (len(ids) // BS)  # and no key is shared
