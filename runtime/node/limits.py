"""The open-files limit of a node's processes, raised to the hard limit at start, and how long
an idle connection to a ZeroMQ port may hold a descriptor.

Why: every client connection (HTTP, the ZeroMQ client API, KV events subscribers) is a file
descriptor, and the common soft limit of 1,024 let about a thousand idle connections make
the next accept, shared-memory open or pidfd fail with "Too many open files", which stopped
the node. The hard limit is what the system allows without privileges; the children inherit
the raised limit from the launcher.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

# how long a TCP connection to a ZeroMQ port may stay without completing its ZeroMQ handshake
# before libzmq closes it (its own default is 30 s): an idle connection that never speaks holds
# a descriptor no longer than this
ZMQ_HANDSHAKE_MS = 5_000


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:  # (a hard limit above the kernel's nr_open)
        log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, e)
        return soft
    log.debug("open-files limit raised from %d to %d", soft, hard)
    return hard
