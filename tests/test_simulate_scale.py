"""Simulating hundreds of workers: the fold (a few simulated workers stand for many alike ones) and
link-aware key placement in O(S + H) per key, both checked against doing it the long way."""

from __future__ import annotations

import random

import pytest

from imerge_hooks.core.layout import Placement
from imerge_hooks.plan.search import FOLD_TOLERANCE, HOST_FOLD_TOLERANCE, PARTITION_TOLERANCE
from imerge_hooks.simulate import ClusterSpec, LayerSpec, ModelSpec, fold_factor, simulate
from imerge_hooks.simulate import run as run


def model() -> ModelSpec:
    sizes = [(4 << 20, 4096), (1 << 20, 1024), (256 << 10,), (64 << 10, 256), (2 << 20,)]
    return ModelSpec(layers=[LayerSpec(f"l{i}", list(b), 0.002, 0.004) for i, b in enumerate(sizes)], batch_size=8)


def test_fold_factor_leaves_small_and_placed_clusters_alone():
    assert fold_factor(ClusterSpec(workers=16, servers=16, bandwidth_Bps=1e9, startup_s=1e-4)) == 1
    assert fold_factor(ClusterSpec(workers=256, servers=128, bandwidth_Bps=1e9, startup_s=1e-4)) == 64
    assert fold_factor(ClusterSpec(workers=36, servers=5, bandwidth_Bps=1e9, startup_s=1e-4)) == 9
    assert fold_factor(ClusterSpec(workers=37, servers=37, bandwidth_Bps=1e9, startup_s=1e-4)) == 1  # prime
    hosts = tuple(range(32)) + tuple(range(8))
    assert fold_factor(ClusterSpec(workers=32, servers=8, bandwidth_Bps=1e9, startup_s=1e-4, hosts=hosts)) == 1


def hosts_of_8(workers: int, **kw) -> ClusterSpec:
    hosts = workers // 8
    return ClusterSpec(workers=workers, servers=hosts, bandwidth_Bps=1.25e8, startup_s=1e-4,
                       hosts=tuple(w // 8 for w in range(workers)) + tuple(range(hosts)), **kw)


def test_alike_hosts_fold_to_at_least_fold_hosts_hosts():
    assert fold_factor(hosts_of_8(64)) == 1  # 8 hosts: FOLD_HOSTS
    assert fold_factor(hosts_of_8(128)) == 2 and fold_factor(hosts_of_8(256)) == 4
    assert fold_factor(hosts_of_8(256), stagger=True) == 4
    # Hosts that are not alike (one with a server, one without; ranks out of host order) are not folded.
    uneven = tuple(w // 8 for w in range(128)) + tuple(range(0, 16, 2))
    assert fold_factor(ClusterSpec(workers=128, servers=8, bandwidth_Bps=1e9, startup_s=1e-4, hosts=uneven)) == 1
    shuffled = tuple((w % 16) for w in range(128)) + tuple(range(16))
    assert fold_factor(ClusterSpec(workers=128, servers=16, bandwidth_Bps=1e9, startup_s=1e-4, hosts=shuffled)) == 1


@pytest.mark.parametrize("schedule,stagger", [("wfbp", None), ("imerge", False), ("imerge", True)])
def test_fold_over_alike_hosts_is_flagged_and_close(schedule, stagger):
    """Hosts of 8 with a server each: simulated host j stands for a block of hosts, its server for theirs
    (flagged: server_orbits), and a push to its own orbit crosses the NIC for all but one host it stands for,
    so the NICs carry what they do unfolded: within 3% of simulating every host on a model whose groups
    cut evenly over the servers."""
    cluster = hosts_of_8(128)
    even = ModelSpec(layers=[LayerSpec(f"l{i}", [32 << 20], 0.02, 0.04) for i in range(3)], batch_size=8)
    folded = simulate(even, cluster, schedule, timeline=False, plan_search=False, stagger=stagger,
                      partition_bytes=2 << 20)
    assert folded.fold == 2 and folded.server_orbits == 8
    full = simulate(even, cluster, schedule, timeline=False, plan_search=False, fold_workers=False,
                    groups=folded.groups, stagger=stagger, partition_bytes=2 << 20)
    assert full.fold == 1
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=0.03)


def test_fold_over_alike_hosts_counts_the_pushes_inside_a_host():
    """Were every push to its own orbit taken as inside the host (free), one folded host in 2 would move
    1/8 of its bytes for nothing: with the link the bound, the fold would be ~6% fast."""
    cluster = hosts_of_8(128, host_aggregation=True)
    heavy = ModelSpec(layers=[LayerSpec("l0", [256 << 20], 0.001, 0.002)], batch_size=8)
    folded = simulate(heavy, cluster, "wfbp", timeline=False)
    full = simulate(heavy, cluster, "wfbp", timeline=False, fold_workers=False, groups=folded.groups)
    assert folded.fold == 2
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=0.01)


@pytest.mark.parametrize("schedule", ["default", "wfbp", "priority", "mgwfbp"])
@pytest.mark.parametrize("workers,servers", [(32, 32), (32, 8), (48, 12)])
def test_fold_without_stagger_is_exact(schedule, workers, servers):
    """Every worker pushes the same key at the same point: W/m workers, each push weighing m at its
    server, give the times of simulating all W."""
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=1.25e8, startup_s=1e-4,
                          fabric_Bps=2e9)
    folded = simulate(model(), cluster, schedule, timeline=False)
    full = simulate(model(), cluster, schedule, timeline=False, fold_workers=False, groups=folded.groups)
    assert folded.fold > 1 and full.fold == 1
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=1e-9)


@pytest.mark.parametrize("workers,servers", [(64, 8), (48, 12), (32, 16)])
def test_fold_with_stagger_is_exact_where_the_simulated_workers_cover_the_servers(workers, servers):
    """With stagger worker j + ak starts where j does when k is a multiple of S: the fold keeps every
    server and gives the times of simulating all W."""
    cluster = ClusterSpec(workers=workers, servers=servers, bandwidth_Bps=1.25e8, startup_s=1e-4)
    folded = simulate(model(), cluster, "imerge", timeline=False, plan_search=False, stagger=True)
    assert fold_factor(cluster, stagger=True) == folded.fold > 1 and (workers // folded.fold) % servers == 0
    assert folded.server_orbits is None
    full = simulate(model(), cluster, "imerge", timeline=False, plan_search=False, fold_workers=False,
                    groups=folded.groups, stagger=True)
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=1e-9)


def test_fold_over_servers_is_flagged_close_and_searched_on_with_a_margin(monkeypatch):
    """S = W leaves no such fold: servers s, s + k, ... are folded too (approximate, flagged), within 2% of
    simulating every worker where the layout repeats over the servers, and a plan search on it wants a
    partition size, stagger or window to win by more than that fold's error."""
    cluster = ClusterSpec(workers=64, servers=64, bandwidth_Bps=1.25e8, startup_s=1e-4)
    even = ModelSpec(layers=[LayerSpec(f"l{i}", [64 << 20], 0.002, 0.004) for i in range(3)], batch_size=8)
    folded = simulate(even, cluster, "imerge", timeline=False, plan_search=False, stagger=True, partition_bytes=1 << 20)
    assert folded.fold == 4 and folded.server_orbits == 16
    full = simulate(even, cluster, "imerge", timeline=False, plan_search=False, fold_workers=False,
                    groups=folded.groups, stagger=True, partition_bytes=1 << 20)
    assert folded.iteration_s == pytest.approx(full.iteration_s, rel=0.02)  # every group: one key per server
    seen = []
    real = run.searched_plan
    monkeypatch.setattr(run, "searched_plan", lambda *a, **kw: seen.append(kw["tolerance"]) or real(*a, **kw))
    simulate(model(), cluster, "imerge", timeline=False)
    simulate(model(), ClusterSpec(workers=64, servers=8, bandwidth_Bps=1.25e8, startup_s=1e-4), "imerge",
             timeline=False)
    assert seen == [FOLD_TOLERANCE, PARTITION_TOLERANCE]  # the orbit fold, then an exact one
    simulate(model(), hosts_of_8(128), "imerge", timeline=False)
    assert seen[-1] == HOST_FOLD_TOLERANCE


def test_on_the_orbit_fold_every_worker_decides_stagger_up_to_64_and_none_is_chosen_above(monkeypatch):
    """Up to EVERY_WORKER_DECIDES workers the search's last choices are made on every worker; above, on the
    orbit fold, the search cannot judge stagger (the fold can be tens of percent optimistic with it) and
    installs none, where the fold is exact."""
    calls = []
    real = run.searched_plan
    monkeypatch.setattr(run, "searched_plan", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    small = simulate(model(), ClusterSpec(workers=32, servers=32, bandwidth_Bps=1.25e8, startup_s=1e-4), "imerge",
                     timeline=False)
    assert calls[-1]["exact"] is not None and not calls[-1]["unstaggered"]
    assert "on every worker:" in small.plan.note or small.plan.stagger is False
    large = simulate(model(), ClusterSpec(workers=128, servers=128, bandwidth_Bps=1.25e8, startup_s=1e-4), "imerge",
                     timeline=False)
    assert calls[-1]["exact"] is None and calls[-1]["unstaggered"]
    assert calls[-1]["tolerance"] == PARTITION_TOLERANCE  # without stagger the fold is exact
    assert large.plan.stagger is False and large.server_orbits is None
    assert "without stagger (the simulation cannot judge it here)" in large.plan.note


def reference_place(load, link, nxt, server_hosts, pushers, nbytes):
    """Placement.place written out the long way: every host link's bytes after each candidate server."""
    order = [s % len(load) for s in range(nxt, nxt + len(load))]
    options = {}
    for s in order:
        after, inbound = dict(link), 0
        for host, count in pushers.items():
            if host != server_hosts[s]:
                after[host] = after.get(host, 0) + count * nbytes
                inbound += count * nbytes
        after[server_hosts[s]] = after.get(server_hosts[s], 0) + inbound
        options[s] = after
    best = min(order, key=lambda s: (max(options[s].values()), options[s][server_hosts[s]], load[s]))
    return best, options[best]


def test_link_aware_placement_matches_the_long_way():
    rng = random.Random(7)
    for _ in range(300):
        servers, hosts = rng.randint(1, 8), rng.randint(1, 6)
        server_hosts = [f"h{rng.randrange(hosts)}" for _ in range(servers)]
        pushers = {f"h{h}": rng.randint(1, 3) for h in range(hosts) if rng.random() < 0.8} or {"h0": 1}
        placement = Placement(servers, server_hosts, pushers)
        for _ in range(30):
            nbytes = rng.choice([4, 4096, rng.randint(1, 10**6)])
            want, link = reference_place(placement.load, placement.link, placement.next, server_hosts, pushers,
                                         nbytes)
            assert placement.place(nbytes) == want
            assert placement.link == link
