"""netlab: emulated cluster (network namespaces + veth + tc tbf).

The end-to-end test needs root and working ``ip netns``; it is skipped
otherwise.  It uses its own prefix so it never touches a benchmark's lab.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from benchmarks.netlab import netlab as nl
from benchmarks.netlab.linkmon import LinkMonitor

PREFIX = "imlabpytest"  # distinct from the default "imlab" used by benchmarks
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_rate():
    assert nl.parse_rate("1gbit") == 10**9
    assert nl.parse_rate("100mbit") == 10**8
    assert nl.parse_rate("2.5gbit") == 25 * 10**8
    assert nl.parse_rate("125mbps") == 10**9  # tc: mbps = megaBYTES/s
    with pytest.raises(nl.NetlabError):
        nl.parse_rate("fast")


@pytest.mark.skipif(shutil.which("ip") is None and not os.path.exists("/usr/sbin/ip"), reason="iproute2 missing")
def test_mpiexec_cmd_layout():
    cmd = nl.mpiexec_cmd([["a"], ["b"], ["c"]], hosts=2, prefix="xx", mpiexec="mpiexec")
    assert cmd[0] == "mpiexec"
    groups = " ".join(cmd[1:]).split(" : ")
    assert len(groups) == 3
    for rank, (grp, ns, prog) in enumerate(zip(groups, ["xx-h0", "xx-h1", "xx-h0"], "abc")):
        words = grp.split()
        assert words[:2] == ["-n", "1"]
        assert words[3:6] == ["netns", "exec", ns], rank
        for key, val in nl.MPI_NET_ENV.items():
            assert f"{key}={val}" in words
        assert words[-1] == prog


_SKIP = None if os.geteuid() == 0 else "needs root"
if _SKIP is None:
    _SKIP = nl.netlab_available(prefix=PREFIX)


@pytest.mark.skipif(_SKIP is not None, reason=f"netlab unavailable: {_SKIP}")
def test_pingpong_is_rate_limited_and_uses_veth():
    pytest.importorskip("mpi4py")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec) and shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    limit_MBps = 100e6 / 8 / 1e6  # 100mbit -> 12.5 MB/s
    try:
        nl.up(hosts=2, bandwidth="100mbit", prefix=PREFIX)
        with LinkMonitor(2, PREFIX, interval_s=0.05) as monitor:
            res = nl.pingpong(hosts=2, prefix=PREFIX, mib=8, iters=2, bidir=False, timeout=60)
        # the switch ports saw it too: host 0 uploaded (port rx) what host 1 downloaded (port tx)
        assert len(monitor.samples) >= 3 and monitor.errors == 0
        (_, first), (_, last) = monitor.samples[0], monitor.samples[-1]
        assert last[0][0] - first[0][0] >= res["bytes"] * res["iters"]
        assert last[1][1] - first[1][1] >= res["bytes"] * res["iters"]
        ratio = res["MBps_0to1"] / limit_MBps
        assert 0.3 < ratio < 2.0, f"measured {res['MBps_0to1']:.1f} MB/s vs limit {limit_MBps} MB/s"
        # the bytes really crossed the emulated NIC (warm-up + timed rounds)
        sent = res["bytes"] * (res["iters"] + 1)
        assert res["veth_delta"][0]["tx_bytes"] >= sent
        assert res["veth_delta"][1]["rx_bytes"] >= sent
        assert [r["netns"] for r in res["ranks"]] == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
    finally:
        nl.down(prefix=PREFIX)
    assert nl.list_namespaces(PREFIX) == []


def test_a_lab_held_by_one_run_refuses_a_second(tmp_path):
    """Two benchmark runs on one lab prefix: the second fails at once and names the first."""
    import subprocess

    prefix = "imlabexcl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]);"
         "from benchmarks.netlab import netlab as nl\n"
         "with nl.exclusive(sys.argv[2]):\n print('held', flush=True); time.sleep(30)",
         str(REPO), prefix], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(nl.NetlabError, match=rf"lab '{prefix}' is in use by pid {holder.pid}"):
            with nl.exclusive(prefix):
                pass
    finally:
        holder.kill()
        holder.wait()
    with nl.exclusive(prefix):  # free again once the holder is gone
        pass
