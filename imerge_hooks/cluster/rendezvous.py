"""The workers' torch.distributed rendezvous: an address every worker can reach, and a store bound to it.

``torch.distributed`` (the DDP hook, Lightning, a torchrun-style script's own
``init_process_group``) needs worker 0's address and a port. The host name is no guide: on common
Debian/Ubuntu images ``/etc/hosts`` maps it to ``127.0.1.1``, which workers on other hosts cannot
reach. So every worker reports its interfaces' IPv4 addresses and networks and its network stack
(machine and network namespace), and worker 0 takes the first of its own addresses that every
other host reaches (one worker per other network stack is enough): a host reaches it through an
interface of its own whose network holds it. An address that more than one host holds (Docker's
``docker0`` 172.17.0.1/16 on every GPU node) is no rendezvous address, nor is one that another
host would send into a bridge local to it (a network some hosts hold under one same address):
workers there would connect to their own host and wait for ``timeout_s``. ``MASTER_ADDR`` or
``master_interface`` (``IMERGE_MASTER_INTERFACE``, as gloo's ``GLOO_SOCKET_IFNAME``) overrides
that. Loopback across hosts, unspecified addresses (0.0.0.0, ``::``) and IPv6 are refused.

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
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import IMergeConfigError

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


def network_stack() -> str | None:
    """Names this process's network stack: the machine (its kernel's boot id) and its network
    namespace. Emulated hosts (``IMERGE_HOST``) in one namespace hold the same addresses because
    they are the same interfaces, not copies on different hosts. None where it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


Report = tuple[str | None, list[Interface]]  # a worker's network stack and interfaces


def other_hosts(own_stack: str | None, reports: Mapping[str, Report]) -> dict[str, list[Interface]]:
    """The interfaces of the other hosts (``reports``: one worker's per host), one entry per network
    stack: a host in worker 0's stack reaches any of its addresses, and hosts that share a stack
    hold one set of interfaces, not copies of it."""
    seen = {own_stack}
    found: dict[str, list[Interface]] = {}
    for host, (stack, found_there) in reports.items():
        if stack is None or stack not in seen:
            seen.add(stack)
            found[host] = list(found_there)
    return found


def _names(names: Sequence[str], others: Sequence[Sequence[Interface]]) -> list[str]:
    return list(names)[:len(others)] + [f"#{k + 1}" for k in range(len(names), len(others))]


def _held(others: Sequence[Sequence[Interface]], names: Sequence[str]) -> dict[str, list[str]]:
    """Every non-loopback address of the other hosts: the hosts that hold it."""
    held: dict[str, list[str]] = {}
    for name, host in zip(_names(names, others), others):
        for i in host:
            if not i.loopback and name not in held.setdefault(i.address, []):
                held[i.address].append(name)
    return held


def _listed(items: Sequence[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def refuse_held_elsewhere(address: str, others: Sequence[Sequence[Interface]], names: Sequence[str],
                          where: str) -> None:
    """Refuse a rendezvous address that another host holds too: its workers would connect to their own host."""
    holders = _held(others, names).get(address)
    if holders:
        raise IMergeConfigError(
            f"IMerge worker 0: the rendezvous address {address} ({where}) is held by host(s) {_listed(holders)} too "
            "(a bridge local to each host, such as Docker's docker0): workers there would connect to their own "
            "host. Set MASTER_ADDR to an address of worker 0's host that only it holds and the others reach, or "
            "IMERGE_MASTER_INTERFACE to its interface (e.g. eth0)")


def _named_interface(own: Sequence[Interface], others: Sequence[Sequence[Interface]], interface: str,
                     names: Sequence[str]) -> str:
    """The address of the interface the user named (``master_interface``), refused where it has none or
    another host holds the same address."""
    named = [i for i in own if i.name == interface]
    if not named:
        raise IMergeConfigError(f"IMerge worker 0: master_interface {interface!r} has no IPv4 address on this host "
                                f"(interfaces: {', '.join(f'{i.name} {i.address}' for i in own) or 'none'})")
    refuse_held_elsewhere(named[0].address, others, names, f"master_interface {interface!r}")
    log.info("IMerge worker 0: torch.distributed rendezvous on %s %s: master_interface (IMERGE_MASTER_INTERFACE)",
             interface, named[0].address)
    return named[0].address


def choose_address(own: Sequence[Interface], others: Sequence[Sequence[Interface]], interface: str | None,
                   spans_hosts: bool, names: Sequence[str] = ()) -> str:
    """Worker 0's rendezvous address. ``own``: worker 0's interfaces; ``others``: those of one worker
    on each other host (each other network stack, ``other_hosts``), named by ``names`` in messages;
    ``interface``: the name asked for (``master_interface``), if any.

    Says which on worker 0: an info line (interface, address, why), a warning where an address that
    another host holds too, or that another host would send into a bridge of its own, was passed over.
    """
    if not spans_hosts:
        log.info("IMerge worker 0: torch.distributed rendezvous on lo 127.0.0.1: the workers share one host")
        return "127.0.0.1"
    names = _names(names, others)
    held = _held(others, names)
    if interface is not None:
        return _named_interface(own, others, interface, names)
    usable = [i for i in own if not i.loopback]
    if not usable:
        raise IMergeConfigError("IMerge worker 0: workers span hosts but this host has no IPv4 address other than "
                                "loopback; set MASTER_ADDR to an address the other hosts reach")
    own_addresses = {i.address for i in usable}

    def copied(address: str) -> bool:  # held by more than one host
        return len(held.get(address, ())) + (address in own_addresses) > 1

    def bridged(candidate: Interface) -> str | None:
        """Why ``candidate`` is no rendezvous address: another host holds it, or would send to it
        through an interface whose address several hosts hold (a bridge local to each)."""
        if candidate.address in held:
            return f"{candidate.name} {candidate.address} (host(s) {_listed(held[candidate.address])} hold it too)"
        target = ipaddress.IPv4Address(candidate.address)
        for name, host in zip(names, others):
            for i in host:
                if not i.loopback and copied(i.address) and target in i.network:
                    return (f"{candidate.name} {candidate.address} ({name} would send to it into its own "
                            f"{i.name} {i.network}, whose address {i.address} other hosts hold too)")
        return None

    def reached_by(candidate: Interface, host: Sequence[Interface]) -> Interface | None:
        target = ipaddress.IPv4Address(candidate.address)
        for i in host:
            if not i.loopback and not copied(i.address) and (
                    target in i.network or ipaddress.IPv4Address(i.address) in candidate.network):
                return i
        return None

    skipped: list[str] = []
    rest: list[Interface] = []
    for candidate in usable:
        why = bridged(candidate)
        if why is not None:
            skipped.append(why)
            continue
        rest.append(candidate)
        via = [reached_by(candidate, host) for host in others]
        if all(via):
            if skipped:
                log.warning("IMerge worker 0: the torch.distributed rendezvous passes over %s: workers on other hosts "
                            "would connect to their own host", "; ".join(skipped))
            routes = [f"{n} via {i.name} {i.address}" for n, i in zip(names, via) if i is not None]
            how = (f"every other host reaches it ({_listed(routes)})" if others
                   else "every other host's workers share this host's network stack")
            log.info("IMerge worker 0: torch.distributed rendezvous on %s %s (%s): %s", candidate.name,
                     candidate.address, candidate.network, how)
            return candidate.address
    if not rest:
        raise IMergeConfigError(
            f"IMerge worker 0: workers span hosts but no address of this host can be their rendezvous: "
            f"{'; '.join(skipped)}. Set MASTER_ADDR to an address of worker 0's host that the other hosts reach, "
            "or IMERGE_MASTER_INTERFACE to its interface (e.g. eth0)")
    log.warning("IMerge worker 0: none of this host's addresses (%s) shares a network with every other host's "
                "workers%s; the rendezvous uses %s %s. Set MASTER_ADDR or IMERGE_MASTER_INTERFACE if the other hosts "
                "cannot reach it", ", ".join(i.address for i in rest),
                f" (passed over: {'; '.join(skipped)})" if skipped else "", rest[0].name, rest[0].address)
    return rest[0].address


_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # "this host on this network": a source, never a destination


def check_address(address: str, spans_hosts: bool, where: str) -> str:
    """``address`` as a numeric IPv4 address; refuses loopback when workers span hosts, and an
    unspecified address (0.0.0.0, ``::``) or IPv6 in any case.

    Unspecified across hosts hangs: worker 0's store listens on every interface, each other worker
    connects to its own host, and gloo is told no interface. On one host it happens to work (Linux
    takes 0.0.0.0 as a destination for this host), but it is refused there too: the store, which
    takes no password, would listen on every interface of the host, and the same launch would hang
    once it spans hosts; unset, IMerge takes 127.0.0.1 there. The rendezvous is IPv4 only (the
    interfaces compared are IPv4), so IPv6 text is named as such, not a resolver error.
    """
    text = address.strip()
    try:
        literal = ipaddress.ip_address(text[1:-1] if text.startswith("[") and text.endswith("]") else text)
    except ValueError:
        literal = None
    fix = ("Unset MASTER_ADDR to let IMerge choose (127.0.0.1 on one host; across hosts an address of worker 0's "
           "host that the others reach), or set it to such an address, or IMERGE_MASTER_INTERFACE to its "
           "interface (e.g. eth0)")
    if isinstance(literal, ipaddress.IPv6Address):
        if literal.is_unspecified:
            raise IMergeConfigError(f"IMerge worker 0: {where}={address!r} is the unspecified IPv6 address, not one a "
                                    f"worker can connect to. {fix}")
        raise IMergeConfigError(f"IMerge worker 0: {where}={address!r} is an IPv6 address; the workers' rendezvous "
                                f"is IPv4 only. {fix}")
    try:
        numeric = socket.gethostbyname(text)
    except (OSError, UnicodeError) as exc:
        raise IMergeConfigError(f"IMerge worker 0: {where}={address!r} does not resolve to an IPv4 address "
                                f"({exc})") from None
    if ipaddress.IPv4Address(numeric) in _THIS_NETWORK:
        hazard = ("workers on the other hosts would connect to their own host and wait" if spans_hosts else
                  "the same launch would hang once workers span hosts")
        raise IMergeConfigError(
            f"IMerge worker 0: {where}={address!r} is an unspecified address ({numeric}), not one a worker can "
            f"connect to: worker 0's store would listen on every interface, and {hazard}. {fix}")
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
