"""Hosts in the pure rules: which worker pushes a key for its host, link bytes, link-aware placement,
the layout line and its refusals, and the simulator on several ranks per host."""

from __future__ import annotations

import pytest

from imerge_hooks.cluster.rank_layout import check_layout, describe_layout
from imerge_hooks.cluster.topology import Topology
from imerge_hooks.core.errors import IMergeConfigError
from imerge_hooks.core.layout import Placement, key_owner, link_bytes
from imerge_hooks.simulate import ClusterSpec, LayerSpec, ModelSpec, simulate

MiB = 1 << 20


def topo(hosts: list[str], servers: int, gpus: int = 0, aggregate: bool = True) -> Topology:
    size = len(hosts)
    return Topology(0, size, servers, None, None, 0, 1, size, tuple(hosts), None,
                    aggregate and len(set(hosts[:size - servers])) < size - servers, (gpus,) * size)


def test_one_worker_per_host_pushes_each_key_and_owners_take_turns():
    t = topo(["a", "a", "b", "b", "a", "b"], 2)
    assert t.aggregate_in_host and t.key_spread == 2
    assert [t.pushers(k) for k in range(3)] == [[0, 2], [1, 3], [0, 2]]
    assert [key_owner(k, 3) for k in range(4)] == [0, 1, 2, 0]
    flat = topo(["a", "a", "b", "b", "a", "b"], 2, aggregate=False)
    assert flat.pushers(5) == [0, 1, 2, 3]


@pytest.mark.parametrize("hosts,workers,aggregate,busiest", [
    ((0, 0, 1, 1, 2, 3), 4, True, 1.0),  # (a): M per worker host, M per server host
    ((0, 0, 1, 1, 2, 3), 4, False, 2.0),  # without host aggregation every worker pushes M
    ((0, 1, 2, 3, 0, 1, 2, 3), 4, True, 1.5),  # (b): 2(N-1)/N M, as the ring
    ((0, 0, 1, 1, 0, 1), 4, True, 1.0),  # (c): a server on each of two hosts
    ((0, 1, 2, 3, 4, 5, 6, 7), 4, True, 1.0),  # S = W on hosts of their own
])
def test_link_bytes_per_host(hosts, workers, aggregate, busiest):
    assert max(link_bytes(hosts, workers, 1.0, aggregate)) == pytest.approx(busiest)


def test_placement_balances_links_when_servers_share_hosts_with_workers():
    # 3 hosts with a worker each; two servers on host a, none on c: balancing server bytes alone would
    # put half the keys on each of a's servers, so a's link carries everything; by links, no worse.
    links = Placement(2, ["a", "a"], {"a": 1, "b": 1, "c": 1})
    for _ in range(8):
        links.place(MiB)
    assert links.balance() == 1.0  # both of a's servers equally loaded
    spread = Placement(3, ["a", "b", "c"], {"a": 1, "b": 1, "c": 1})
    for _ in range(9):
        spread.place(MiB)
    assert spread.link_balance() == pytest.approx(1.0) and spread.balance() == 1.0
    # One server beside worker a, one on a host of its own: b's worker must push every key off its host,
    # and no link carries more than that (the lone server host would carry 2 x per key it holds).
    mixed = Placement(2, ["a", "s"], {"a": 1, "b": 1})
    for _ in range(12):
        mixed.place(MiB)
    assert max(mixed.link.values()) == 12 * MiB


def test_layout_line_and_refusals():
    t = topo(["a", "a", "b", "b", "a", "b"], 2)
    line = describe_layout(t)
    assert "4 workers + 2 servers on 2 hosts" in line and "2 x (2 workers, 1 server, 0 GPUs): a, b" in line
    assert "host aggregation on" in line
    with pytest.raises(IMergeConfigError, match=r"host 'a' runs 2 workers but has 1 GPU.*-ppn 1"):
        check_layout(topo(["a", "a", "b", "b", "a", "b"], 2, gpus=1))
    check_layout(topo(["a", "a", "b", "b", "a", "b"], 2, gpus=1), share_gpus=True)
    check_layout(topo(["a", "a", "b", "b", "a", "b"], 2, gpus=2))
    block = topo(["a", "a", "a", "b", "b", "b"], 2)  # mpiexec -n 6 -ppn 3: both servers on the last host
    with pytest.raises(IMergeConfigError, match=r"host 'b' holds 2 servers \(world ranks \[4, 5\]\).*MPMD"):
        check_layout(block, servers_per_host=1)
    check_layout(block, servers_per_host=2)


def synthetic() -> ModelSpec:
    return ModelSpec(layers=[LayerSpec(f"l{i}", [8 * MiB], 0.02, 0.04) for i in range(8)], batch_size=8)


@pytest.mark.parametrize("schedule", ["default", "wfbp", "priority", "threshold", "mgwfbp", "adaptive-ps", "imerge"])
def test_simulator_on_two_hosts_of_two_workers(schedule):
    """Colocated servers on two hosts: host aggregation halves what each link carries, so it is faster;
    every schedule runs on a layout with several ranks per host."""
    common = dict(workers=4, servers=2, bandwidth_Bps=60e6, startup_s=2e-4, hosts=(0, 0, 1, 1, 0, 1))
    on = simulate(synthetic(), ClusterSpec(**common), schedule, plan_search=False)
    off = simulate(synthetic(), ClusterSpec(**common, host_aggregation=False), schedule, plan_search=False)
    assert on.iteration_s < off.iteration_s
    m = 64 * MiB
    assert on.iteration_s >= m / 60e6  # at least the busiest link's bytes (M each way) at the link rate


def test_a_model_measured_on_a_host_layout_reads_the_link_rate_of_that_layout():
    from imerge_hooks.plan.costmodel import PSModel

    model = PSModel.fit(4, 2, [MiB, 4 * MiB, 16 * MiB], [0.02, 0.08, 0.32])
    flat = ClusterSpec.from_psmodel(model)
    placed = ClusterSpec.from_psmodel(model, hosts=(0, 0, 1, 1, 0, 1))
    # Flat: a server's link takes W/S = 2 M; on two hosts with aggregation the busiest link takes 1 M.
    assert placed.bandwidth_Bps == pytest.approx(flat.bandwidth_Bps / 2)
    assert ClusterSpec.from_psmodel(model, hosts=(0,) * 6) == flat  # one host: no link to read
