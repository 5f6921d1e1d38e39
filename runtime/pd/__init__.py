"""Prefill/decode disaggregation on the engine side: the KV connector seam the scheduler calls
(`connector.py`), the prefill and decode connectors, their peer links and the HMAC
sessions that authenticate them, and which connector a node's role gets (`roles.py`)."""
