"""The workers' torch.distributed rendezvous: an address the other hosts reach, never loopback across
hosts, and a store that listens on that address only, on a port the kernel chose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import kill_job, mpiexec_path, run_mpi

from imerge_hooks.errors import IMergeConfigError
from imerge_hooks.rendezvous import Interface, check_address, choose_address

SCRIPT = Path(__file__).parent / "scripts" / "rendezvous.py"
REPO = Path(__file__).resolve().parent.parent
LO = Interface("lo", "127.0.0.1", "255.0.0.0")


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


def test_single_host_store_listens_on_loopback_only():
    run = run_mpi(SCRIPT, 3, servers=1, timeout=120).check()
    listen = [line for line in run.stdout.splitlines() if "@0 LISTEN" in line][0].split()[2:]
    assert listen == ["127.0.0.1"], run.stdout
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


def _launch(nl, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Workers 0, 2 on emulated host 0 and 1, 3 on host 1, a server on host 0; the hosts' names resolve to an address
    neither namespace has (as 127.0.1.1 on Debian images)."""
    cmd = nl.mpiexec_cmd([[sys.executable, str(SCRIPT)]] * 5, hosts=2, prefix=PREFIX, mpiexec=mpiexec_path(),
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
