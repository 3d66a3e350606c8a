"""The workers' torch.distributed rendezvous: an address every worker can reach, and a store bound to it.

``torch.distributed`` (the DDP hook, Lightning, a torchrun-style script's own
``init_process_group``) needs worker 0's address and a port. The host name is no guide: on common
Debian/Ubuntu images ``/etc/hosts`` maps it to ``127.0.1.1``, which workers on other hosts cannot
reach. So every worker reports its interfaces' IPv4 addresses and networks, and worker 0 takes
the first of its own that shares a network with every other host's workers (one worker per host
is enough); ``MASTER_ADDR`` or ``master_interface`` (``IMERGE_MASTER_INTERFACE``, as gloo's
``GLOO_SOCKET_IFNAME``) overrides that. A loopback address is refused when workers span hosts.

Worker 0 binds a listening socket to that address only (port 0, or ``MASTER_PORT``) and serves a
``TCPStore`` on it: the port is the one the kernel gave, so no other process can take it between
choosing and binding, and nothing listens on other interfaces. The port goes to every worker over
MPI. Scripts that call ``init_process_group()`` themselves (env://) connect to that store as
clients (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent). Where workers span hosts,
each worker also tells gloo which of its interfaces reaches worker 0 (``GLOO_SOCKET_IFNAME``,
unless set).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import IMergeConfigError

log = logging.getLogger("imerge")

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 address and mask


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    netmask: str

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.netmask}", strict=False)

    @property
    def loopback(self) -> bool:
        return ipaddress.IPv4Address(self.address).is_loopback


def interfaces() -> list[Interface]:
    """This host's interfaces with an IPv4 address (Linux: every one; elsewhere: the host name's
    addresses, as /32 networks)."""
    found: list[Interface] = []
    try:
        import fcntl

        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for name in names:
                request = struct.pack("256s", name.encode()[:15])
                try:
                    address = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24])
                    netmask = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFNETMASK, request)[20:24])
                except OSError:
                    continue  # no IPv4 address on it
                found.append(Interface(name, address, netmask))
    except (ImportError, OSError, AttributeError):
        pass
    if not found:
        try:
            for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
                found.append(Interface("", info[4][0], "255.255.255.255"))
        except OSError:
            pass
    return found


def choose_address(own: Sequence[Interface], others: Sequence[Sequence[Interface]], interface: str | None,
                   spans_hosts: bool) -> str:
    """Worker 0's rendezvous address. ``own``: worker 0's interfaces; ``others``: those of one worker
    on each other host; ``interface``: the name asked for (``master_interface``), if any."""
    if not spans_hosts:
        return "127.0.0.1"
    usable = [i for i in own if not i.loopback]
    if interface is not None:
        named = [i for i in own if i.name == interface]
        if not named:
            raise IMergeConfigError(f"IMerge worker 0: master_interface {interface!r} has no IPv4 address on this host "
                                    f"(interfaces: {', '.join(f'{i.name} {i.address}' for i in own) or 'none'})")
        return named[0].address
    for candidate in usable:
        if all(any(not i.loopback and ipaddress.IPv4Address(i.address) in candidate.network for i in host)
               for host in others):
            return candidate.address
    if not usable:
        raise IMergeConfigError("IMerge worker 0: workers span hosts but this host has no IPv4 address other than "
                                "loopback; set MASTER_ADDR to an address the other hosts reach")
    log.warning("IMerge worker 0: none of this host's addresses (%s) shares a network with every other host's "
                "workers; the rendezvous uses %s. Set MASTER_ADDR or IMERGE_MASTER_INTERFACE if the other hosts "
                "cannot reach it", ", ".join(i.address for i in usable), usable[0].address)
    return usable[0].address


def check_address(address: str, spans_hosts: bool, where: str) -> str:
    """``address`` as a numeric IPv4 address; refuses loopback when workers span hosts."""
    try:
        numeric = socket.gethostbyname(address)
    except OSError as exc:
        raise IMergeConfigError(f"IMerge worker 0: {where}={address!r} does not resolve ({exc})") from None
    if spans_hosts and ipaddress.IPv4Address(numeric).is_loopback:
        raise IMergeConfigError(
            f"IMerge worker 0: {where}={address!r} is a loopback address ({numeric}), but workers span hosts: "
            "workers on the other hosts cannot reach it. Set MASTER_ADDR to an address of worker 0's host that "
            "the others reach, or IMERGE_MASTER_INTERFACE to the interface (e.g. eth0); unset MASTER_ADDR to let "
            "IMerge choose")
    return numeric


def listen(address: str, port: int) -> socket.socket:
    """A TCP socket listening on ``address:port`` only (port 0: one the kernel picks)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        what = f"MASTER_PORT={port}" if port else "a port"
        raise IMergeConfigError(f"IMerge worker 0: cannot listen on {address} with {what} for the workers' "
                                f"torch.distributed store ({exc}); {address} must be an address of worker 0's host"
                                + (" and the port free" if port else "")) from None
    return sock


def serve_store(sock: socket.socket, workers: int, timeout_s: float) -> Any:
    """Worker 0: a TCPStore server on ``sock`` (it binds nothing itself)."""
    import torch.distributed as dist

    address, port = sock.getsockname()
    return dist.TCPStore(address, port, workers, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.fileno())


def client_store(address: str, port: int, workers: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(address, port, workers, False, datetime.timedelta(seconds=timeout_s))


def interface_towards(address: str, own: Sequence[Interface]) -> str | None:
    """The name of this host's interface that holds ``address`` or shares its network."""
    target = ipaddress.IPv4Address(address)
    for i in own:
        if i.name and (i.address == address or target in i.network) and not i.loopback:
            return i.name
    return None


def environment_store_handoff() -> dict[str, str]:
    """What makes a script's own env:// ``init_process_group`` a client of worker 0's store."""
    return {"TORCHELASTIC_USE_AGENT_STORE": str(True)}
