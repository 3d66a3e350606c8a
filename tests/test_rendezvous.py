"""The workers' torch.distributed rendezvous: an address the other hosts reach, never loopback across
hosts, never an address other hosts hold too (Docker's bridge), never an unspecified one, and a store
that listens on that address only, on a port the kernel chose."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mpirun import kill_job, mpiexec_path, run_mpi

from imerge_hooks.cluster import rendezvous
from imerge_hooks.cluster.rendezvous import Interface, check_address, choose_address, interfaces
from imerge_hooks.core.errors import IMergeConfigError

SCRIPT = Path(__file__).parent / "scripts" / "rendezvous.py"
REPO = Path(__file__).resolve().parent.parent
LO = Interface("lo", "127.0.0.1", "255.0.0.0")
DOCKER0 = Interface("docker0", "172.17.0.1", "255.255.0.0")  # the same on every host that runs Docker


def test_choose_address_shares_a_network_with_every_host():
    own = [LO, Interface("docker0", "172.17.0.1", "255.255.0.0"), Interface("eth0", "10.1.2.3", "255.255.255.0")]
    others = [[LO, Interface("eth0", "10.1.2.9", "255.255.255.0")], [Interface("ib0", "10.1.2.12", "255.255.0.0")]]
    assert choose_address(own, others, None, spans_hosts=True) == "10.1.2.3"
    assert choose_address(own, others, "docker0", spans_hosts=True) == "172.17.0.1"
    assert choose_address(own, others, None, spans_hosts=False) == "127.0.0.1"
    with pytest.raises(IMergeConfigError, match="master_interface 'eth7' has no IPv4 address"):
        choose_address(own, others, "eth7", spans_hosts=True)
    with pytest.raises(IMergeConfigError, match="no IPv4 address other than loopback"):
        choose_address([LO], others, None, spans_hosts=True)


def test_loopback_is_refused_across_hosts_and_named():
    assert check_address("127.0.1.1", False, "MASTER_ADDR") == "127.0.1.1"
    with pytest.raises(IMergeConfigError, match=r"MASTER_ADDR='127.0.1.1' is a loopback .*IMERGE_MASTER_INTERF"):
        check_address("127.0.1.1", True, "MASTER_ADDR")


def test_choose_address_passes_over_a_bridge_address_every_host_holds(caplog):
    """docker0 172.17.0.1/16, numbered before eth0 on every host, "shares a network" with every host:
    each worker would connect to its own host's 172.17.0.1. eth0 is taken, and both are named."""
    eth = [Interface("eth0", f"10.1.2.{n}", "255.255.255.0") for n in (3, 9, 12)]
    own, others = [LO, DOCKER0, eth[0]], [[LO, DOCKER0, eth[1]], [LO, DOCKER0, eth[2]]]
    assert choose_address(own, others, None, spans_hosts=True) == "10.1.2.3"
    with caplog.at_level(logging.INFO, logger="imerge"):
        assert choose_address(own, others, None, spans_hosts=True, names=["n1", "n2"]) == "10.1.2.3"
    said = {(r.levelname, r.getMessage()) for r in caplog.records}
    assert any(level == "WARNING" and "docker0 172.17.0.1 (host(s) n1, n2 hold it too)" in text
               for level, text in said), said
    assert any(level == "INFO" and "rendezvous on eth0 10.1.2.3" in text and "n2 via eth0 10.1.2.12" in text
               for level, text in said), said
    # worker 0's own bridge address is unique, but other hosts hold one same address in its network:
    # they would send to it into their own docker0
    unique = Interface("docker0", "172.17.0.2", "255.255.0.0")
    assert choose_address([LO, unique, eth[0]], others, None, spans_hosts=True) == "10.1.2.3"
    # docker0 on different /16s shares no network; eth0 still wins
    other16 = Interface("docker0", "172.18.0.1", "255.255.0.0")
    assert choose_address([LO, other16, eth[0]], [[LO, DOCKER0, eth[1]]], None, spans_hosts=True) == "10.1.2.3"
    with pytest.raises(IMergeConfigError, match=r"no address of this host .*docker0 172\.17\.0\.1.*MASTER_ADDR.*"
                                                 r"IMERGE_MASTER_INTERFACE"):
        choose_address([LO, DOCKER0], others, None, spans_hosts=True)
    with pytest.raises(IMergeConfigError, match=r"172\.17\.0\.1 \(master_interface 'docker0'\) is held by host\(s\) "
                                                 r"n1, n2 too"):
        choose_address(own, others, "docker0", spans_hosts=True, names=["n1", "n2"])


def test_hosts_in_one_network_stack_are_one_host_for_the_rendezvous():
    """Emulated hosts (IMERGE_HOST) in worker 0's namespace hold its very interfaces, not copies;
    hosts sharing another stack count once."""
    eth = [Interface("eth0", "10.1.2.3", "255.255.255.0")]
    reports = {"h1": ("boot/1", eth), "h2": ("boot/2", [LO, DOCKER0]), "h3": ("boot/2", [LO, DOCKER0]),
               "h4": (None, eth)}
    assert rendezvous.other_hosts("boot/1", reports) == {"h2": [LO, DOCKER0], "h4": eth}
    assert choose_address([LO, *eth], [], None, spans_hosts=True) == "10.1.2.3"


@pytest.mark.parametrize("spans", [True, False])
def test_unspecified_and_ipv6_master_addr_are_refused_and_named(spans):
    """0.0.0.0 or :: would make worker 0's store listen on every interface while the other hosts'
    workers connect to themselves; refused on one host too (see check_address)."""
    for text, numeric in (("0.0.0.0", "0.0.0.0"), ("0", "0.0.0.0")):
        with pytest.raises(IMergeConfigError, match=rf"MASTER_ADDR='{text}' is an unspecified address \({numeric}\)"
                                                     r".*Unset MASTER_ADDR.*IMERGE_MASTER_INTERFACE"):
            check_address(text, spans, "MASTER_ADDR")
    for text in ("::", "[::]"):
        with pytest.raises(IMergeConfigError, match=rf"MASTER_ADDR='{re.escape(text)}' is the unspecified IPv6 "
                                                     r"address.*Unset MASTER_ADDR"):
            check_address(text, spans, "MASTER_ADDR")
    with pytest.raises(IMergeConfigError, match=r"MASTER_ADDR='fe80::1' is an IPv6 address; .* IPv4 only"):
        check_address("fe80::1", spans, "MASTER_ADDR")
    assert check_address("10.1.2.3", spans, "MASTER_ADDR") == "10.1.2.3"


def test_single_host_store_listens_on_loopback_only():
    run = run_mpi(SCRIPT, 3, servers=1, timeout=120).check()
    listen = [line for line in run.stdout.splitlines() if "@0 LISTEN" in line][0].split()[2:]
    assert listen == ["127.0.0.1"], run.stdout
    assert all(f"@{r} SUM 3" in run.stdout for r in range(2)), run.stdout


def test_emulated_hosts_sharing_this_network_stack_meet_at_its_address():
    """Two IMERGE_HOSTs in this namespace hold the same addresses (the same interfaces): not a
    bridge every host holds, so the rendezvous is this machine's first non-loopback address."""
    own = [i.address for i in interfaces() if not i.loopback]
    if not own:
        pytest.skip("this machine has no IPv4 address but loopback")
    run = run_mpi(SCRIPT, 3, servers=1, hosts=["h0", "h1", "h0"], timeout=120, env={"IMERGE_TIMEOUT_S": "60"}).check()
    assert [run.lines(r, "ADDR")[0].split()[0] for r in range(2)] == [own[0]] * 2, run.stdout
    assert all(f"@{r} SUM 3" in run.stdout for r in range(2)), run.stdout


def _netlab():
    if os.geteuid() != 0:
        return None, "needs root (network namespaces)"
    sys.path.insert(0, str(REPO))
    from benchmarks.netlab import netlab as nl

    why = nl.netlab_available(prefix="imlabrdvprobe")
    return (nl, None) if why is None else (None, why)


NL, NO_LAB = _netlab()
PREFIX = "imlabrdv"
DOCKER_PREFIX = "imlabrdvdk"


@pytest.fixture(scope="module")
def two_hosts():
    if NL is None:
        pytest.skip(f"no emulated hosts: {NO_LAB}")
    with NL.exclusive(PREFIX):
        NL.up(hosts=2, bandwidth="1gbit", prefix=PREFIX)
        try:
            yield NL
        finally:
            NL.down(prefix=PREFIX)


@contextlib.contextmanager
def _hosts_with_docker0(nl, prefix: str) -> Iterator[None]:
    """Two emulated hosts, each with a bridge docker0 172.17.0.1/16 numbered before the cluster link
    (``im0``, a veth pair between them on the lab's addresses), as Docker leaves on GPU nodes. The
    namespaces go (netlab's ``down``) even where building them or the test fails."""
    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    with nl.exclusive(prefix):
        nl.down(prefix=prefix)
        try:
            hosts = [nl.host_ns(i, prefix) for i in range(2)]
            for ns in hosts:
                ip("netns", "add", ns)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "add", "docker0", "type", "bridge")
                ip("-n", ns, "addr", "add", "172.17.0.1/16", "dev", "docker0")
                ip("-n", ns, "link", "set", "docker0", "up")
            ip("-n", hosts[0], "link", "add", nl.IFACE, "type", "veth", "peer", "name", nl.IFACE, "netns", hosts[1])
            for i, ns in enumerate(hosts):
                ip("-n", ns, "addr", "add", f"{nl.host_addr(i)}/24", "dev", nl.IFACE)
                ip("-n", ns, "link", "set", nl.IFACE, "up")
                links = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], check=True, capture_output=True,
                                       text=True).stdout
                names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
                assert names.index("docker0") < names.index(nl.IFACE), names  # listed first, as the hazard needs
            yield
        finally:
            nl.down(prefix=prefix)


@pytest.fixture(scope="module")
def docker_hosts():
    if NL is None:
        pytest.skip(f"no emulated hosts: {NO_LAB}")
    with _hosts_with_docker0(NL, DOCKER_PREFIX):
        yield NL


def _launch(nl, env: dict[str, str], timeout: float = 120, prefix: str = PREFIX) -> subprocess.CompletedProcess:
    """Workers 0, 2 on emulated host 0 and 1, 3 on host 1, a server on host 0; the hosts' names resolve to an address
    neither namespace has (as 127.0.1.1 on Debian images)."""
    cmd = nl.mpiexec_cmd([[sys.executable, str(SCRIPT)]] * 5, hosts=2, prefix=prefix, mpiexec=mpiexec_path(),
                         host_of=[0, 1, 0, 1, 0], extra_env={"IMERGE_NUM_SERVERS": "1", **env})
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(SCRIPT.parent)]), PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout * float(os.environ.get("IMERGE_TEST_TIMEOUT_SCALE", "2")))
    except BaseException:
        out, err = kill_job(proc)
        raise AssertionError(f"the two-host job did not finish\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_workers_on_two_hosts_meet_at_an_address_both_reach(two_hosts):
    run = _launch(two_hosts, {"IMERGE_TIMEOUT_S": "60"})
    assert run.returncode == 0, run.stderr[-3000:]
    host0 = two_hosts.host_addr(0)
    addrs = [line.split() for line in run.stdout.splitlines() if " ADDR " in line]
    assert len(addrs) == 4 and all(a[2] == host0 for a in addrs), run.stdout
    assert {a[4] for a in addrs} == {two_hosts.IFACE}, run.stdout  # gloo told which interface
    listen = [line for line in run.stdout.splitlines() if "@0 LISTEN" in line][0].split()[2:]
    assert listen == [host0], run.stdout
    assert sum(f"@{r} SUM 10" in run.stdout for r in range(4)) == 4, run.stdout


def test_loopback_master_addr_across_hosts_is_refused_on_every_worker(two_hosts):
    run = _launch(two_hosts, {"MASTER_ADDR": "127.0.1.1", "IMERGE_TIMEOUT_S": "60"})
    assert run.returncode != 0
    assert "MASTER_ADDR='127.0.1.1' is a loopback address" in run.stderr, run.stderr[-3000:]
    assert "IMerge worker 3: worker 0 could not set up the rendezvous" in run.stderr, run.stderr[-3000:]


def test_a_bridge_address_every_host_holds_is_passed_over(docker_hosts):
    """docker0 172.17.0.1/16 before im0 on both hosts: the workers meet at host 0's im0 address and sum,
    and worker 0 says which address it took and which it passed over."""
    run = _launch(docker_hosts, {"IMERGE_TIMEOUT_S": "60", "IMERGE_LOG_LEVEL": "info"}, prefix=DOCKER_PREFIX)
    assert run.returncode == 0, run.stderr[-3000:]
    host0, host1 = docker_hosts.host_addr(0), docker_hosts.host_ns(1, DOCKER_PREFIX)
    addrs = [line.split() for line in run.stdout.splitlines() if " ADDR " in line]
    assert len(addrs) == 4 and all(a[2] == host0 and a[4] == docker_hosts.IFACE for a in addrs), run.stdout
    listen = [line for line in run.stdout.splitlines() if "@0 LISTEN" in line][0].split()[2:]
    assert listen == [host0], run.stdout
    assert sum(f"@{r} SUM 10" in run.stdout for r in range(4)) == 4, run.stdout
    assert (f"WARNING IMerge worker 0: the torch.distributed rendezvous passes over docker0 172.17.0.1 (host(s) "
            f"{host1} hold it too)") in run.stderr, run.stderr[-3000:]
    assert f"INFO IMerge worker 0: torch.distributed rendezvous on {docker_hosts.IFACE} {host0} " in run.stderr, \
        run.stderr[-3000:]


def test_unspecified_master_addr_across_hosts_ends_fast_on_every_worker(two_hosts):
    """MASTER_ADDR=0.0.0.0 used to make the workers on host 1 connect to themselves until timeout_s: with
    a timeout_s (600 s) longer than the launch's, a wait would kill the job and fail the test."""
    run = _launch(two_hosts, {"MASTER_ADDR": "0.0.0.0", "IMERGE_TIMEOUT_S": "600"})
    assert run.returncode != 0
    assert "MASTER_ADDR='0.0.0.0' is an unspecified address" in run.stderr, run.stderr[-3000:]
    for worker in (1, 2, 3):
        assert f"IMerge worker {worker}: worker 0 could not set up the rendezvous" in run.stderr, run.stderr[-3000:]
