"""The rendezvous store, listening on one address only.

torch's TCPStore binds its server to every interface, so on a node any process that can reach the port could join a
deployment's rendezvous. `serve_store` binds the listening socket itself, to the pod's own address, and hands it
to the store (which then owns and closes it).
"""

from __future__ import annotations

import socket

import torch.distributed as dist


def serve_store(host: str, port: int = 0) -> dist.TCPStore:
    """A TCPStore server on ``host:port`` only (port 0: a free one, read back from ``.port``).

    Raises OSError when the address is taken or is not this machine's.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())
