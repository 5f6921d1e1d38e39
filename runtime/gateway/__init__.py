"""The gateway process: the node's front door to the network. It owns every ZeroMQ socket that
outsiders reach (the client API, a prefill node's decode peers, the KV events and their replay)
and relays them to the engine's private sockets, so that libzmq aborting a process on a hostile
peer's bytes ends only this one, which the launcher restarts (`gateway.py`)."""
