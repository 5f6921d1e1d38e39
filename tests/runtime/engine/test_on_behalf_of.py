"""A request's `on_behalf_of` (whose quota it counts against, runtime/client/api.py): checked at
intake, and a quota key of its socket's that no other socket shares."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.runtime.client.api import MAX_ON_BEHALF_OF_BYTES, GenerateRequest
from kvrt.runtime.engine.clients import Clients
from kvrt.runtime.engine.intake import validate
from kvrt.runtime.node.config import NodeConfig


def _req(who) -> GenerateRequest:
    return GenerateRequest("r", np.array([1, 2, 3], np.int32), 4, on_behalf_of=who)


@pytest.mark.parametrize("who", [7, None, b"1.2.3.4", "a\nb", "x" * (MAX_ON_BEHALF_OF_BYTES + 1)])
def test_a_bad_on_behalf_of_is_refused_at_intake(who):
    assert validate(_req(who), NodeConfig(node="x")).startswith("on_behalf_of")


@pytest.mark.parametrize("who", ["", "127.0.0.1", "::1", "x" * MAX_ON_BEHALF_OF_BYTES])
def test_an_http_clients_name_is_taken(who):
    assert validate(_req(who), NodeConfig(node="x")) == ""


def test_quota_keys_are_per_socket_and_name():
    a, b = b"\0socket-a", b"\0socket-b"
    assert Clients.quota_key(a, "") == a
    keys = {Clients.quota_key(s, w) for s in (a, b) for w in ("", "1.2.3.4", "5.6.7.8")}
    assert len(keys) == 6, "no socket shares a quota with another, nor one name with another"
