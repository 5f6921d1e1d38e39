"""What a real node tells each request its prompt cost adds up: cached tokens per tier (device,
host, storage) plus computed prompt tokens equal the prompt, for every request, with a host tier
and a file storage tier and many requests in flight (matches given back for lack of device
blocks and made again, swap-ins, storage reads, preemptions), and the answers stay right."""
from __future__ import annotations

import time

import pytest

from kvrt.runtime.client.client import Client, Result
from tests.launched import SMALL, launched, oracle, shared_prefix_prompts

pytestmark = pytest.mark.e2e

NEW = 4


def _round(client: Client, prompts: list, timeout: float = 120.0) -> list[Result]:
    """Every prompt submitted at once; their Results in prompt order."""
    rids = [client.submit(p, NEW, stream=False) for p in prompts]
    got: dict[str, Result] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(rids):
        assert time.monotonic() < deadline, f"{len(rids) - len(got)} requests unanswered within {timeout} s"
        for ev in client.poll(1.0):
            assert isinstance(ev, Result), f"a request failed: {ev}"
            got[ev.request_id] = ev
    return [got[r] for r in rids]


def test_cached_and_computed_add_up_for_every_request_with_both_tiers(node, tmp_path):
    prompts = shared_prefix_prompts(seed=5, systems=4, users=4)  # 16 prompts, 4 shared heads
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    opts = (*SMALL, "--num-gpu-blocks", "48", "--num-cpu-blocks", "256", "--storage", f"file:{tmp_path / 'store'}")
    with launched(node, tmp_path / "logs", *opts) as ln:
        rounds = [_round(ln.client, prompts) for _ in range(2)]  # the second round hits host and storage
        stats = ln.idle_stats()
    wrong = []
    for n, res in enumerate(rounds):
        for p, r, w in zip(prompts, res, want):
            assert r.output_token_ids.tolist() == w, f"round {n}: wrong answer for {r.request_id}"
            if r.cached_tokens + r.computed_prompt_tokens != len(p) or r.prompt_tokens != len(p):
                wrong.append((n, r.request_id, len(p), r.cached_device, r.cached_host, r.cached_storage,
                              r.computed_prompt_tokens, r.preemptions))
    assert not wrong, f"(round, request, prompt, device, host, storage, computed, preemptions): {wrong}"
    assert sum(r.cached_host + r.cached_storage for r in rounds[1]) > 0, "the warm round hit neither tier"
    assert stats["device_used"] == 0 and stats["host_used"] == 0
