"""netlab: an emulated N-host cluster with real NIC limits, built from network
namespaces, veth pairs, one Linux bridge and ``tc tbf`` token buckets.

Topology (``--prefix imlab``, ``--hosts 2``)::

      imlab-h0                     imlab-sw                     imlab-h1
    +-----------+            +--------------------+            +-----------+
    | lo        |            |        br0         |            | lo        |
    | im0 10.77.0.1/24 <====> h0               h1 <====> im0 10.77.0.2/24 |
    +-----------+   veth     +--------------------+   veth     +-----------+

* every link is shaped in BOTH directions with ``tc qdisc ... tbf``:
  egress of ``im0`` inside the host namespace (the host's upload) and egress of
  ``h<i>`` inside the switch namespace (the host's download);
* nothing is created in, or routed to, the caller's (root) network namespace:
  the 10.77.0.0/24 subnet only exists inside the lab namespaces;
* ranks are started per namespace by an MPMD ``mpiexec`` line (see
  :func:`mpiexec_cmd`): hydra's proxy stays in the root namespace and hands each
  rank its PMI connection as an inherited socket, so only the rank itself runs
  in the host namespace, and MPICH's ch4/ofi ``tcp`` provider is pinned to the
  ``im0`` veth.

CLI (run as root)::

    python -m benchmarks.netlab.netlab up --hosts 4 --bandwidth 1gbit
    python -m benchmarks.netlab.netlab status
    python -m benchmarks.netlab.netlab run --hosts 4 -- python train.py ...
    python -m benchmarks.netlab.netlab check --hosts 2 --bandwidth 100mbit
    python -m benchmarks.netlab.netlab down

Only the Python standard library is used; ``ip`` and ``tc`` (iproute2) are run
through :mod:`subprocess`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NetlabError",
    "LabConfig",
    "DEFAULT_PREFIX",
    "IFACE",
    "SUBNET",
    "parse_rate",
    "format_rate",
    "check_environment",
    "netlab_available",
    "netem_available",
    "up",
    "down",
    "status",
    "list_namespaces",
    "host_ns",
    "switch_ns",
    "host_addr",
    "rank_env",
    "default_mpiexec",
    "mpiexec_cmd",
    "spmd_cmd",
    "run",
    "link_counters",
    "pingpong",
    "duplex_probe",
    "GOODPUT",
    "goodput",
]

DEFAULT_PREFIX = "imlab"
#: TCP payload per 1514-byte Ethernet frame (netlab measures 0.96 of the shaped rate one way)
GOODPUT = 1448 / 1514


def goodput(mtu: int = 1500) -> float:
    """TCP payload per byte on the wire at this MTU: (MTU - 40 IP/TCP - 12 timestamps) / (MTU + 14 Ethernet)."""
    return (mtu - 52) / (mtu + 14)

#: name of the lab NIC inside every host namespace (what FI_TCP_IFACE points at)
IFACE = "im0"
#: the lab subnet; host i gets SUBNET.(i+1)/24.  Exists only inside the lab.
SUBNET = "10.77.0"
BRIDGE = "br0"
MAX_HOSTS = 250
_FINGERPRINT_TAG = "netlab-v1"
_HERE = Path(__file__).resolve().parent

#: environment that makes MPICH (ch4 device, as shipped by the ``mpich`` PyPI
#: wheel) talk over the lab NIC.  See README.md for what each one does.
MPI_NET_ENV: dict[str, str] = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",  # wheel is built ch4:ucx,ofi -> force libfabric
    "FI_PROVIDER": "tcp",  # libfabric tcp provider (no shm/verbs/psm)
    "FI_TCP_IFACE": IFACE,  # bind/advertise the lab veth, not lo
    "MPIR_CVAR_NOLOCAL": "1",  # all ranks share a hostname: disable shm path
}


class NetlabError(RuntimeError):
    """Raised with a human-readable explanation when the lab cannot be used."""


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    # tc's *bps units are BYTES per second
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}


def parse_rate(rate: str | int | float) -> int:
    """Parse a tc-style rate (``"1gbit"``, ``"100mbit"``, ``"2.5gbit"``) into
    bits per second.  A bare number is bits/s.  Like tc, ``mbps`` means
    mega*bytes* per second."""
    if isinstance(rate, (int, float)):
        bits = int(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(rate))
        if not m:
            raise NetlabError(f"cannot parse rate {rate!r} (use e.g. 1gbit, 100mbit)")
        unit = m.group(2).lower() or "bit"
        if unit not in _RATE_UNITS:
            raise NetlabError(f"unknown rate unit {m.group(2)!r} in {rate!r}; use one of {sorted(_RATE_UNITS)}")
        bits = int(float(m.group(1)) * _RATE_UNITS[unit])
    if bits < 8000:
        raise NetlabError(f"rate {rate!r} is too small (< 8kbit)")
    return bits


def format_rate(bits: int) -> str:
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= mult:
            v = bits / mult
            return f"{v:g}{unit}"
    return f"{bits}bit"


def parse_time_ms(value: str | int | float) -> float:
    """``"5ms"``, ``"200us"``, ``"0.1s"``, ``5`` (ms) -> milliseconds."""
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s|)\s*", str(value))
    if not m:
        raise NetlabError(f"cannot parse time {value!r} (use e.g. 0ms, 250us, 5ms)")
    v = float(m.group(1))
    return {"us": v / 1000.0, "ms": v, "s": v * 1000.0, "": v}[m.group(2)]


def host_ns(i: int, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}-h{i}"


def switch_ns(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}-sw"


def host_addr(i: int) -> str:
    """IPv4 address (no mask) of host ``i`` inside the lab."""
    return f"{SUBNET}.{i + 1}"


def _port_name(i: int) -> str:
    """switch-side veth name for host i (lives only inside the switch netns)."""
    return f"h{i}"


def _tool(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
        None,
    )
    if not path:
        raise NetlabError(f"`{name}` not found. netlab needs iproute2 (`ip`, `tc`): apt-get install iproute2")
    return path


def _sh(args: Sequence[str], check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=capture, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout or "").strip()
        raise NetlabError(f"command failed (rc={proc.returncode}): {shlex.join(args)}\n  {msg}")
    return proc


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [_tool("ip")]
    if ns:
        cmd += ["-n", ns]
    return _sh(cmd + list(args), check=check)


def _tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [_tool("tc")]
    if ns:
        cmd += ["-n", ns]
    return _sh(cmd + list(args), check=check)


def _json(proc: subprocess.CompletedProcess):
    out = proc.stdout.strip()
    return json.loads(out) if out else []


@contextlib.contextmanager
def _lock(prefix: str) -> Iterator[None]:
    """Serialise up/down for one prefix across processes (best effort)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    lockdir = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    path = lockdir / f"netlab-{prefix}.lock"
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def exclusive(prefix: str = DEFAULT_PREFIX) -> Iterator[None]:
    """Hold lab ``prefix`` for one benchmark run: a second holder fails at once, naming the first.

    ``up``/``down`` only serialise each other; a benchmark that takes the lab down in its
    ``finally`` while another one runs on it kills the other's ranks. Raises NetlabError.
    """
    import fcntl

    lockdir = Path("/run") if os.access("/run", os.W_OK) else Path("/tmp")
    path = lockdir / f"netlab-{prefix}.inuse"
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise NetlabError(f"lab {prefix!r} is in use by {holder}; wait for it or use another prefix") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:200]}\n")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------
# environment checks
# --------------------------------------------------------------------------


def check_environment(probe: bool = True, prefix: str = DEFAULT_PREFIX) -> None:
    """Raise :class:`NetlabError` explaining why the lab cannot be built here.

    Checks: Linux, root (CAP_NET_ADMIN + CAP_SYS_ADMIN are needed to create
    network namespaces), iproute2 present, and (``probe=True``) that a network
    namespace can really be created and a veth/tbf configured inside it.
    """
    if not sys.platform.startswith("linux"):
        raise NetlabError(f"netlab needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetlabError(
            "netlab must run as root: creating network namespaces, veth pairs and tc "
            "qdiscs needs CAP_SYS_ADMIN + CAP_NET_ADMIN.  Re-run with sudo (keep the "
            "venv: `sudo -E .venv/bin/python -m benchmarks.netlab.netlab ...`)."
        )
    _tool("ip")
    _tool("tc")
    proc = _ip("netns", "list", check=False)
    if proc.returncode != 0:
        raise NetlabError(
            "`ip netns` is unavailable: " + (proc.stderr or "").strip() + "\n"
            "  (kernel without CONFIG_NET_NS, or a container without CAP_SYS_ADMIN; "
            "for docker use --privileged or --cap-add SYS_ADMIN --cap-add NET_ADMIN)"
        )
    if not probe:
        return
    ns = _probe_ns(prefix)
    _ip("netns", "del", ns, check=False)
    try:
        proc = _ip("netns", "add", ns, check=False)
        if proc.returncode != 0:
            raise NetlabError(
                "cannot create a network namespace (`ip netns add` failed): "
                + (proc.stderr or "").strip()
                + "\n  (needs CAP_SYS_ADMIN and a writable /run/netns; inside docker use "
                "--privileged)"
            )
        proc = _ip("link", "add", "p0", "type", "veth", "peer", "name", "p1", ns=ns, check=False)
        if proc.returncode != 0:
            raise NetlabError("cannot create a veth pair (CONFIG_VETH missing?): " + proc.stderr.strip())
        proc = _tc(
            "qdisc",
            "add",
            "dev",
            "p0",
            "root",
            "tbf",
            "rate",
            "1mbit",
            "burst",
            "4096",
            "latency",
            "10ms",
            ns=ns,
            check=False,
        )
        if proc.returncode != 0:
            raise NetlabError("cannot add a tbf qdisc (CONFIG_NET_SCH_TBF missing?): " + proc.stderr.strip())
        proc = _ip("link", "add", BRIDGE, "type", "bridge", ns=ns, check=False)
        if proc.returncode != 0:
            raise NetlabError("cannot create a Linux bridge (CONFIG_BRIDGE missing?): " + proc.stderr.strip())
    finally:
        _ip("netns", "del", ns, check=False)


def _probe_ns(prefix: str) -> str:
    """A throw-away namespace of this process: two test processes probing at once must not share one
    (one's ``netns add`` would find the other's veth: "File exists", and the lab would look missing)."""
    return f"{prefix}-probe-{os.getpid()}"


def netlab_available(prefix: str = "imlabprobe") -> str | None:
    """``None`` if the lab can be built here, else the reason (for pytest skips)."""
    try:
        check_environment(probe=True, prefix=prefix)
    except NetlabError as exc:
        return str(exc)
    return None


def netem_available(prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether the kernel has the netem qdisc (needed for ``--latency`` > 0).
    Probed in a throw-away namespace ``<prefix>-probe-<pid>``."""
    ns = _probe_ns(prefix)
    _ip("netns", "del", ns, check=False)
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", "p0", "type", "veth", "peer", "name", "p1", ns=ns)
        proc = _tc("qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms", ns=ns, check=False)
        return proc.returncode == 0
    finally:
        _ip("netns", "del", ns, check=False)


# --------------------------------------------------------------------------
# lab lifecycle
# --------------------------------------------------------------------------


@dataclass
class LabConfig:
    hosts: int
    rate_bit: int
    prefix: str = DEFAULT_PREFIX
    burst_bytes: int = 0  # 0 -> auto
    queue_ms: float = 50.0  # tbf "latency": max time a packet may wait in the bucket queue
    delay_ms: float = 0.0  # extra one-way delay (netem) on each host's upload
    mtu: int = 1500

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.]{0,30}", self.prefix):
            raise NetlabError(f"bad prefix {self.prefix!r}: letters/digits/_/. only, no '-'")
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise NetlabError(f"--hosts must be in 1..{MAX_HOSTS}, got {self.hosts}")
        if self.burst_bytes <= 0:
            self.burst_bytes = auto_burst(self.rate_bit, self.mtu)

    def fingerprint(self) -> str:
        return (
            f"{_FINGERPRINT_TAG} hosts={self.hosts} rate={self.rate_bit} burst={self.burst_bytes} "
            f"queue={self.queue_ms:g} delay={self.delay_ms:g} mtu={self.mtu}"
        )


def auto_burst(rate_bit: int, mtu: int = 1500) -> int:
    """Bucket size: ~2 ms worth of line rate, at least 64 KiB (one GSO/TSO
    super-packet) and at least 4 MTUs.  Too small a bucket makes tbf under-
    deliver at high rates (timer granularity); too large lets short bursts
    exceed the rate."""
    return max(65536, 4 * (mtu + 14), int(rate_bit / 8 * 0.002))


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Lab namespaces (``<prefix>-sw``, ``<prefix>-h<i>``) that exist now."""
    proc = _ip("netns", "list", check=False)
    pat = re.compile(rf"^{re.escape(prefix)}-(sw|h\d+|probe(-\d+)?)$")
    names = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if pat.match(name):
            names.append(name)
    return sorted(names, key=_ns_sort_key)


def _ns_sort_key(name: str):
    m = re.search(r"-h(\d+)$", name)
    return (0, int(m.group(1))) if m else (-1, 0) if name.endswith("-sw") else (1, 0)


def down(prefix: str = DEFAULT_PREFIX, quiet: bool = True) -> list[str]:
    """Delete every namespace of the lab ``prefix`` (idempotent).  Deleting a
    namespace destroys its veth ends, bridge and qdiscs with it."""
    _tool("ip")
    with _lock(prefix):
        return _down_unlocked(prefix, quiet)


def _down_unlocked(prefix: str, quiet: bool) -> list[str]:
    removed = []
    for ns in list_namespaces(prefix):
        # kill stray processes still living in the namespace (e.g. a rank from a
        # crashed run), otherwise the netns stays alive (but unnamed) after del.
        pids = _sh([_tool("ip"), "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(pid), 9)
        _ip("netns", "del", ns, check=False)
        removed.append(ns)
        if not quiet:
            print(f"removed {ns}")
    return removed


def _tbf_args(cfg: LabConfig) -> list[str]:
    return [
        "tbf",
        "rate",
        f"{cfg.rate_bit}bit",
        "burst",
        str(cfg.burst_bytes),
        "latency",
        f"{cfg.queue_ms:g}ms",
    ]


def _shape(ns: str, dev: str, cfg: LabConfig, delay_ms: float) -> None:
    _tc("qdisc", "del", "dev", dev, "root", ns=ns, check=False)
    if delay_ms > 0:
        proc = _tc(
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "handle",
            "1:",
            "netem",
            "delay",
            f"{delay_ms:g}ms",
            "limit",
            "100000",
            ns=ns,
            check=False,
        )
        if proc.returncode != 0:
            raise NetlabError(
                f"--latency {delay_ms:g}ms needs the netem qdisc, which this kernel lacks "
                f"(CONFIG_NET_SCH_NETEM): {proc.stderr.strip()}.  Use --latency 0ms."
            )
        _tc("qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *_tbf_args(cfg), ns=ns)
    else:
        _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", *_tbf_args(cfg), ns=ns)


def _tbf_of(ns: str, dev: str) -> dict | None:
    proc = _tc("-j", "qdisc", "show", "dev", dev, ns=ns, check=False)
    if proc.returncode != 0:
        return None
    with contextlib.suppress(ValueError):
        for q in _json(proc):
            if q.get("kind") == "tbf":
                return q
    return None


def _is_current(cfg: LabConfig) -> bool:
    """True if the live lab for ``cfg.prefix`` matches ``cfg`` exactly."""
    expected = [switch_ns(cfg.prefix)] + [host_ns(i, cfg.prefix) for i in range(cfg.hosts)]
    if list_namespaces(cfg.prefix) != sorted(expected, key=_ns_sort_key):
        return False
    sw = switch_ns(cfg.prefix)
    proc = _ip("-j", "link", "show", BRIDGE, ns=sw, check=False)
    if proc.returncode != 0:
        return False
    try:
        br = _json(proc)[0]
    except (ValueError, IndexError):
        return False
    if br.get("ifalias") != cfg.fingerprint() or br.get("operstate") not in ("UP", "UNKNOWN"):
        return False
    for i in range(cfg.hosts):
        h = host_ns(i, cfg.prefix)
        proc = _ip("-j", "addr", "show", IFACE, ns=h, check=False)
        if proc.returncode != 0:
            return False
        try:
            link = _json(proc)[0]
        except (ValueError, IndexError):
            return False
        addrs = {a.get("local") for a in link.get("addr_info", [])}
        if host_addr(i) not in addrs or "UP" not in link.get("flags", []):
            return False
        for ns, dev in ((h, IFACE), (sw, _port_name(i))):
            q = _tbf_of(ns, dev)
            if not q or int(q.get("options", {}).get("rate", 0)) != cfg.rate_bit // 8:
                return False
    return True


def up(
    hosts: int,
    bandwidth: str | int = "1gbit",
    latency: str | float = "0ms",
    prefix: str = DEFAULT_PREFIX,
    burst: int | None = None,
    queue: str | float = "50ms",
    mtu: int = 1500,
    force: bool = False,
    quiet: bool = True,
) -> LabConfig:
    """Create (or keep, if identical) the lab.  Idempotent.

    :param hosts: number of host namespaces ``<prefix>-h0 .. h{hosts-1}``
    :param bandwidth: per-direction NIC rate of every host link (tc syntax)
    :param latency: extra one-way host-to-host delay (needs the netem qdisc;
        added on each host's upload only, so RTT between two hosts = 2x)
    :param burst: tbf bucket in bytes (default: :func:`auto_burst`)
    :param queue: tbf ``latency`` = longest a packet may wait before drop
    :param force: rebuild even if the live lab already matches
    :returns: the :class:`LabConfig` in effect
    """
    cfg = LabConfig(
        hosts=int(hosts),
        rate_bit=parse_rate(bandwidth),
        prefix=prefix,
        burst_bytes=int(burst or 0),
        queue_ms=parse_time_ms(queue),
        delay_ms=parse_time_ms(latency),
        mtu=int(mtu),
    )
    check_environment(probe=False)
    with _lock(prefix):
        if not force and _is_current(cfg):
            if not quiet:
                print(f"netlab {prefix}: already up ({cfg.fingerprint()})")
            return cfg
        if cfg.delay_ms > 0 and not netem_available(prefix):
            # checked before tearing anything down, so a bad request keeps the old lab
            raise NetlabError(
                f"--latency {cfg.delay_ms:g}ms needs the netem qdisc, which this kernel lacks "
                "(CONFIG_NET_SCH_NETEM is not set).  Use --latency 0ms."
            )
        _down_unlocked(prefix, quiet=True)
        try:
            _build(cfg)
        except BaseException:
            _down_unlocked(prefix, quiet=True)
            raise
        if not quiet:
            print(f"netlab {prefix}: up ({cfg.fingerprint()})")
    return cfg


def _build(cfg: LabConfig) -> None:
    sw = switch_ns(cfg.prefix)
    proc = _ip("netns", "add", sw, check=False)
    if proc.returncode != 0:
        raise NetlabError(f"`ip netns add {sw}` failed: {proc.stderr.strip()}")
    _ip("link", "set", "lo", "up", ns=sw)
    _ip("link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0", ns=sw)
    _ip("link", "set", BRIDGE, "alias", cfg.fingerprint(), ns=sw)
    _ip("link", "set", BRIDGE, "up", ns=sw)
    for i in range(cfg.hosts):
        h, port = host_ns(i, cfg.prefix), _port_name(i)
        _ip("netns", "add", h)
        _ip("link", "set", "lo", "up", ns=h)
        # create the pair directly inside the host netns with its peer in the
        # switch netns: nothing ever appears in the root namespace.
        _ip(
            "link",
            "add",
            IFACE,
            "mtu",
            str(cfg.mtu),
            "type",
            "veth",
            "peer",
            "name",
            port,
            "mtu",
            str(cfg.mtu),
            "netns",
            sw,
            ns=h,
        )
        _ip("addr", "add", f"{host_addr(i)}/24", "dev", IFACE, ns=h)
        _ip("link", "set", port, "master", BRIDGE, ns=sw)
        _shape(h, IFACE, cfg, cfg.delay_ms)  # host upload
        _shape(sw, port, cfg, 0.0)  # host download
        _ip("link", "set", port, "up", ns=sw)
        _ip("link", "set", IFACE, "up", ns=h)
    # wait for carrier on all host ends (veth is immediate, but be safe)
    deadline = time.time() + 5
    while time.time() < deadline:
        if all(
            "LOWER_UP" in (_json(_ip("-j", "link", "show", IFACE, ns=host_ns(i, cfg.prefix)))[0]["flags"])
            for i in range(cfg.hosts)
        ):
            break
        time.sleep(0.05)


# --------------------------------------------------------------------------
# introspection
# --------------------------------------------------------------------------


def link_counters(i: int, prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    """``{"tx_bytes", "rx_bytes", "tx_packets", "rx_packets"}`` of ``im0`` in host i."""
    proc = _ip("-j", "-s", "link", "show", IFACE, ns=host_ns(i, prefix))
    st = _json(proc)[0]["stats64"]
    return {
        "tx_bytes": st["tx"]["bytes"],
        "rx_bytes": st["rx"]["bytes"],
        "tx_packets": st["tx"]["packets"],
        "rx_packets": st["rx"]["packets"],
    }


def status(prefix: str = DEFAULT_PREFIX) -> dict:
    """Describe the live lab: hosts, addresses, qdisc rates, byte counters."""
    out: dict = {"prefix": prefix, "namespaces": list_namespaces(prefix), "hosts": []}
    sw = switch_ns(prefix)
    if sw in out["namespaces"]:
        proc = _ip("-j", "link", "show", BRIDGE, ns=sw, check=False)
        with contextlib.suppress(ValueError, IndexError):
            out["fingerprint"] = _json(proc)[0].get("ifalias")
    hosts = sorted(int(m.group(1)) for n in out["namespaces"] if (m := re.search(r"-h(\d+)$", n)))
    for i in hosts:
        h = host_ns(i, prefix)
        entry: dict = {"ns": h, "iface": IFACE}
        proc = _ip("-j", "-s", "addr", "show", IFACE, ns=h, check=False)
        try:
            link = _json(proc)[0]
            entry["addr"] = [
                f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("family") == "inet"
            ]
            entry["state"] = link.get("operstate")
        except (ValueError, IndexError, KeyError):
            entry["addr"], entry["state"] = [], "MISSING"
        with contextlib.suppress(Exception):
            entry.update(link_counters(i, prefix))
        for key, ns, dev in (("upload", h, IFACE), ("download", sw, _port_name(i))):
            q = _tbf_of(ns, dev)
            if q:
                o = q.get("options", {})
                entry[key] = {
                    "rate": format_rate(int(o.get("rate", 0)) * 8),
                    "burst": o.get("burst"),
                    "dev": f"{ns}:{dev}",
                }
            else:
                entry[key] = None
        out["hosts"].append(entry)
    return out


def _print_status(st: dict) -> None:
    if not st["namespaces"]:
        print(f"netlab {st['prefix']}: down (no namespaces)")
        return
    print(f"netlab {st['prefix']}: {len(st['hosts'])} host(s)  [{st.get('fingerprint', '?')}]")
    for h in st["hosts"]:
        up_ = h["upload"]["rate"] if h.get("upload") else "UNSHAPED"
        dn = h["download"]["rate"] if h.get("download") else "UNSHAPED"
        print(
            f"  {h['ns']:<14} {h['iface']} {','.join(h['addr']) or '-':<16} {h.get('state', '?'):<5} "
            f"up={up_:<8} down={dn:<8} tx={h.get('tx_bytes', 0)}B rx={h.get('rx_bytes', 0)}B"
        )


# --------------------------------------------------------------------------
# launching MPI ranks inside the lab
# --------------------------------------------------------------------------


def default_mpiexec() -> str:
    """The ``mpiexec`` next to ``sys.executable`` (the mpich wheel's hydra),
    falling back to ``$PATH``."""
    cand = Path(sys.executable).parent / "mpiexec"
    if cand.exists():
        return str(cand)
    found = shutil.which("mpiexec")
    if not found:
        raise NetlabError("no mpiexec found next to sys.executable or on $PATH (pip install mpich)")
    return found


def rank_env(
    i: int, hosts: int, prefix: str = DEFAULT_PREFIX, extra: Mapping[str, str] | None = None,
    host: int | None = None,
) -> dict[str, str]:
    """Environment for rank ``i`` on host ``host`` (default ``i % hosts``): the MPI-over-veth
    variables, ``IMERGE_HOST`` (the namespaces share one kernel and host name, so IMerge is told
    which emulated host a rank stands for) and ``NETLAB_NETNS``/``NETLAB_HOST``/``NETLAB_ADDR``."""
    h = i % hosts if host is None else host
    env = dict(MPI_NET_ENV)
    env.update(
        {
            "NETLAB_PREFIX": prefix,
            "NETLAB_NETNS": host_ns(h, prefix),
            "NETLAB_HOST": str(h),
            "NETLAB_ADDR": host_addr(h),
            "IMERGE_HOST": host_ns(h, prefix),
        }
    )
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env


def _live_hosts(prefix: str) -> int:
    n = sum(1 for ns in list_namespaces(prefix) if re.search(r"-h\d+$", ns))
    if n == 0:
        raise NetlabError(f"netlab {prefix!r} is not up (run `netlab up --hosts N` first)")
    return n


def mpiexec_cmd(
    rank_cmds: Sequence[Sequence[str]],
    hosts: int | None = None,
    prefix: str = DEFAULT_PREFIX,
    mpiexec: str | None = None,
    extra_env: Mapping[str, str] | None = None,
    mpiexec_args: Sequence[str] = (),
    host_of: Sequence[int] | None = None,
) -> list[str]:
    """Build an MPMD hydra command line that starts rank ``i`` (running
    ``rank_cmds[i]``) inside namespace ``<prefix>-h{i % hosts}``, or ``<prefix>-h{host_of[i]}``
    (several ranks on one host share its link; their traffic to each other stays inside it)::

        mpiexec -n 1 ip netns exec imlab-h0 env MPIR_CVAR_CH4_NETMOD=ofi ... cmd0 \\
              : -n 1 ip netns exec imlab-h1 env ... cmd1

    ``hosts`` defaults to the number of host namespaces that are up.
    ``extra_env`` is added to every rank (after the netlab variables, so it can
    override them).  The list is meant for ``subprocess.run(cmd)``; use
    :func:`shlex.join` to print it.
    """
    if not rank_cmds:
        raise NetlabError("mpiexec_cmd: no rank commands")
    if isinstance(rank_cmds[0], str):
        raise NetlabError("mpiexec_cmd wants one argv list per rank; use spmd_cmd(cmd, nranks)")
    if hosts is None:
        hosts = _live_hosts(prefix)
    ip, envbin = _tool("ip"), shutil.which("env") or "/usr/bin/env"
    cmd: list[str] = [mpiexec or default_mpiexec(), *mpiexec_args]
    for i, argv in enumerate(rank_cmds):
        if i:
            cmd.append(":")
        env = rank_env(i, hosts, prefix, extra_env, None if host_of is None else host_of[i])
        cmd += ["-n", "1", ip, "netns", "exec", env["NETLAB_NETNS"], envbin]
        cmd += [f"{k}={v}" for k, v in env.items()]
        cmd += [str(a) for a in argv]
    return cmd


def spmd_cmd(cmd: Sequence[str], nranks: int, hosts: int | None = None, **kw) -> list[str]:
    """Same command for every rank: ``mpiexec_cmd([cmd] * nranks, hosts, **kw)``."""
    return mpiexec_cmd([list(cmd)] * int(nranks), hosts, **kw)


def run(
    cmd: Sequence[str],
    nranks: int | None = None,
    hosts: int | None = None,
    prefix: str = DEFAULT_PREFIX,
    timeout: float | None = None,
    capture: bool = False,
    **kw,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` as ``nranks`` MPI ranks spread over the lab hosts."""
    if hosts is None:
        hosts = _live_hosts(prefix)
    full = spmd_cmd(cmd, nranks or hosts, hosts, prefix=prefix, **kw)
    return subprocess.run(full, timeout=timeout, capture_output=capture, text=True)


def pingpong(
    hosts: int = 2,
    prefix: str = DEFAULT_PREFIX,
    mib: float = 8.0,
    iters: int = 3,
    bidir: bool = True,
    timeout: float = 60.0,
    extra_env: Mapping[str, str] | None = None,
) -> dict:
    """Run ``pingpong.py`` between ``<prefix>-h0`` and ``<prefix>-h1`` and
    return its JSON result, plus the veth byte counters before/after."""
    script = str(_HERE / "pingpong.py")
    args = [sys.executable, script, "--mib", str(mib), "--iters", str(iters)]
    if bidir:
        args.append("--bidir")
    before = [link_counters(i, prefix) for i in range(min(hosts, 2))]
    full = spmd_cmd(args, 2, hosts, prefix=prefix, extra_env=extra_env)
    proc = subprocess.run(full, timeout=timeout, capture_output=True, text=True)
    after = [link_counters(i, prefix) for i in range(min(hosts, 2))]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PINGPONG ")), None)
    if proc.returncode != 0 or line is None:
        raise NetlabError(
            f"pingpong failed (rc={proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-4000:]}"
        )
    res = json.loads(line[len("PINGPONG ") :])
    res["veth_delta"] = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return res


def duplex_probe(
    workers: int,
    servers: int,
    prefix: str = DEFAULT_PREFIX,
    rounds: int | None = None,
    timeout: float = 600.0,
) -> dict:
    """Run ``duplex_probe.py`` on the lab (rank i on host i, servers last) and return its JSON:
    what every link busy both ways at once moves (``aggregate_Bps``)."""
    args = [sys.executable, str(_HERE / "duplex_probe.py"), "--servers", str(servers)]
    if rounds is not None:
        args += ["--rounds", str(rounds)]
    full = spmd_cmd(args, workers + servers, prefix=prefix, extra_env={"OMP_NUM_THREADS": "1"})
    proc = subprocess.run(full, timeout=timeout, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        raise NetlabError(f"duplex_probe failed (rc={proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _cli(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.netlab.netlab",
        description="Emulated cluster (netns + veth + bridge + tc tbf) for MPI benchmarks.",
    )
    ap.add_argument(
        "--prefix",
        default=os.environ.get("NETLAB_PREFIX", DEFAULT_PREFIX),
        help="namespace name prefix (default imlab, or $NETLAB_PREFIX)",
    )
    # --prefix is accepted before or after the sub-command
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    p = add("up", help="create the lab (idempotent)")
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--bandwidth", default="1gbit", help="per-direction link rate, tc syntax (default 1gbit)")
    p.add_argument("--latency", default="0ms", help="extra one-way host->host delay (needs netem)")
    p.add_argument("--burst", type=int, default=None, help="tbf bucket bytes (default auto)")
    p.add_argument("--queue", default="50ms", help="tbf queue limit as time (default 50ms)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--force", action="store_true", help="rebuild even if identical")

    add("down", help="remove every namespace of the prefix (idempotent)")

    p = add("status", help="show hosts, addresses, qdisc rates, counters")
    p.add_argument("--json", action="store_true")

    p = add("run", help="run CMD as MPI ranks inside the lab: run [--np R] -- CMD...")
    p.add_argument("--hosts", type=int, default=None, help="hosts to use (default: all that are up)")
    p.add_argument("--np", type=int, default=None, help="ranks (default: one per host); rank i -> host i%%hosts")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra env for every rank")
    p.add_argument("--dry-run", action="store_true", help="only print the mpiexec command line")
    p.add_argument("argv", nargs=argparse.REMAINDER)

    p = add("check", help="up + pingpong between h0 and h1 + verdict (does not tear down)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--bandwidth", default="100mbit")
    p.add_argument("--mib", type=float, default=8.0)
    p.add_argument("--iters", type=int, default=3)

    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            check_environment(probe=False)
            up(
                args.hosts,
                args.bandwidth,
                args.latency,
                args.prefix,
                args.burst,
                args.queue,
                args.mtu,
                args.force,
                quiet=False,
            )
            _print_status(status(args.prefix))
        elif args.cmd == "down":
            check_environment(probe=False)
            removed = down(args.prefix, quiet=False)
            if not removed:
                print(f"netlab {args.prefix}: nothing to remove")
        elif args.cmd == "status":
            st = status(args.prefix)
            print(json.dumps(st, indent=2)) if args.json else _print_status(st)
        elif args.cmd == "run":
            check_environment(probe=False)
            argv_ = list(args.argv)
            if argv_ and argv_[0] == "--":
                argv_ = argv_[1:]
            if not argv_:
                ap.error("run: give a command after --")
            hosts = args.hosts or _live_hosts(args.prefix)
            extra = dict(kv.split("=", 1) for kv in args.env)
            full = spmd_cmd(argv_, args.np or hosts, hosts, prefix=args.prefix, extra_env=extra)
            if args.dry_run:
                print(shlex.join(full))
                return 0
            return subprocess.call(full)
        elif args.cmd == "check":
            cfg = up(args.hosts, args.bandwidth, prefix=args.prefix, quiet=False)
            res = pingpong(args.hosts, args.prefix, args.mib, args.iters)
            limit_MBps = cfg.rate_bit / 8 / 1e6
            print(json.dumps(res, indent=2))
            for key in ("MBps_0to1", "MBps_1to0"):
                if key in res:
                    print(
                        f"{key}: {res[key]:.2f} MB/s  (limit {limit_MBps:.2f} MB/s, ratio {res[key] / limit_MBps:.2f})"
                    )
            ok = 0.3 < res["MBps_0to1"] / limit_MBps < 2.0 and res["veth_delta"][0]["tx_bytes"] >= res["bytes"]
            print("OK" if ok else "SUSPICIOUS: rate not limited or traffic not on the veth")
            return 0 if ok else 1
    except NetlabError as exc:
        print(f"netlab: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `netlab status | head` stays quiet
    sys.exit(_cli())
