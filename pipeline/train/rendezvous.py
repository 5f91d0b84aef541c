"""torchrun's c10d rendezvous with every listening socket bound to one network interface, not to all of them.

torchrun's own c10d backend listens on every interface: its rendezvous store and the store it shares with the
workers are ``TCPStore`` servers, which bind the wildcard address whatever host they are given, and gloo binds the
address its host name resolves to. A training run would so be reachable from the whole network while it trains.
This backend, ``--rdzv-backend aiayn`` (registered with torchrun through the ``torchrun.handlers`` entry point in
pyproject.toml), is the same dynamic c10d rendezvous with:

- both stores listening on the address of ``--rdzv-conf interface=NAME`` (``lo``, 127.0.0.1, by default: one node),
  through a socket bound here and handed to the store (``master_listen_fd``);
- that address as the workers' ``MASTER_ADDR`` (this node's address in the rendezvous);
- ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to the interface for the workers (unless already set), so the
  process group's own connections use it too.

Several nodes name the interface their peers reach them on (``launch.interface``); node 0 hosts the rendezvous
store (``--rdzv-conf is_host=true``).
"""

from __future__ import annotations

import functools
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import psutil
from torch.distributed import TCPStore

if TYPE_CHECKING:  # torchrun loads this module while importing its rendezvous package: import that lazily
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKEND = "aiayn"
LOOPBACK = "lo"
DEFAULT_PORT = 29400


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (e.g. ``lo`` -> 127.0.0.1); ValueError naming the known
    interfaces when it has none."""
    addrs = psutil.net_if_addrs()
    for a in addrs.get(name, []):
        if a.family == socket.AF_INET:
            return a.address
    known = {n: [a.address for a in v if a.family == socket.AF_INET] for n, v in addrs.items()}
    raise ValueError(f"network interface {name!r} has no IPv4 address; interfaces with one: "
                     f"{ {n: v for n, v in known.items() if v} }; set launch.interface to one of them")


def bound_store(address: str, port: int, is_server: bool, timeout: timedelta) -> TCPStore:
    """A multi-tenant ``TCPStore`` on ``address:port``; its server (when ``is_server``) listens on that address
    only (port 0: any free port)."""
    if not is_server:
        return TCPStore(address, port, is_master=False, multi_tenant=True, timeout=timeout)
    sock = socket.create_server((address, port), backlog=128)
    port = sock.getsockname()[1]
    return TCPStore(address, port, is_master=True, multi_tenant=True, timeout=timeout, master_listen_fd=sock.detach(),
                    wait_for_workers=False)


class EndpointUnreachable(RuntimeError):
    """A node could not reach the rendezvous that node 0 hosts."""


def wait_for_endpoint(host: str, port: int, timeout_s: float) -> None:
    """Wait until ``host:port`` (node 0's rendezvous) accepts a TCP connection; :class:`EndpointUnreachable`
    naming it after ``timeout_s``. torchrun's store client would otherwise retry silently, then fail with a
    socket error that does not say what to check."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise EndpointUnreachable(
                    f"the rendezvous endpoint {host}:{port} (launch.rdzv_endpoint) did not answer within "
                    f"{timeout_s:.0f} s ({e.strerror or e}): node 0 hosts it there; check that node 0 runs and that "
                    f"{host} is its address on launch.interface, reachable from this node") from None
        time.sleep(0.5)


def check_hosts(host: str, port: int, interface: str, address: str) -> None:
    """Node 0 hosts the rendezvous on ``address`` (its ``interface``'s): the endpoint the other nodes are given must
    lead there, else they would wait for nothing until their timeout. :class:`EndpointUnreachable` naming it."""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)}
    except socket.gaierror as e:
        raise EndpointUnreachable(f"the rendezvous endpoint {host}:{port} (launch.rdzv_endpoint) does not resolve "
                                  f"({e.strerror}): node 0 hosts the rendezvous there; point it at node 0") from None
    if address not in resolved:
        raise EndpointUnreachable(
            f"the rendezvous endpoint {host}:{port} (launch.rdzv_endpoint) resolves to {sorted(resolved)}, but node 0 "
            f"hosts the rendezvous on {address}, its address on interface {interface} (launch.interface): the other "
            "nodes would never reach it; point launch.rdzv_endpoint at that address (on Kubernetes: a headless "
            "Service, whose name resolves to the pod's own address)")


@functools.cache
def _handler_class() -> type:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class BoundRendezvousHandler(DynamicRendezvousHandler):
        """The dynamic c10d rendezvous whose shared store (the workers' ``MASTER_ADDR:MASTER_PORT``) listens on
        this node's rendezvous address (the bound interface's) only."""

        def _create_tcp_store_server(self, master_addr, master_port) -> TCPStore:
            return bound_store(master_addr, master_port, True, timedelta(seconds=300))

        def get_backend(self) -> str:
            return BACKEND  # torchrun checks that the handler is the backend it asked for

    return BoundRendezvousHandler


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's handler factory for ``--rdzv-backend aiayn`` (see the module docstring)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    interface = params.get("interface", LOOPBACK)
    address = interface_address(interface)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, interface)  # the workers inherit the agent's environment
    host, port = parse_rendezvous_endpoint(params.endpoint or f"{address}:0", default_port=DEFAULT_PORT)
    is_host = params.get_as_bool("is_host", params.max_nodes == 1)
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    join_timeout = params.get_as_int("join_timeout", 600)
    if not is_host:
        wait_for_endpoint(host, port, join_timeout)
    elif params.endpoint:
        check_hosts(host, port, interface, address)
    # The host listens on its own interface's address; the others reach it at the endpoint.
    store = bound_store(address if is_host else host, port, is_host, read_timeout)
    timeout = RendezvousTimeout(join=timedelta(seconds=join_timeout))
    return _handler_class().from_backend(params.run_id, store, C10dRendezvousBackend(store, params.run_id),
                                          params.min_nodes, params.max_nodes, address, timeout)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torchrun calls it for the factory it registers under ``aiayn``."""
    return create_handler
