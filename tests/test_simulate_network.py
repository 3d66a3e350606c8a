"""The simulator's vectorised max-min network against a plain progressive filling over flow objects."""

import math
import random

import numpy as np
import pytest

from imerge_hooks.simulate.loop import _Msg, _Sim, max_min_levels


def reference_rates(flows: list[_Msg], hosts: int, bandwidth: float, local_bandwidth: float,
                    fabric: float | None) -> list[float]:
    """Weighted max-min fair rates by progressive filling, one flow at a time (what the simulator
    computed before it was vectorised): host links 0..2H-1 have ``bandwidth``, local links (>= 2H)
    ``local_bandwidth``, the optional fabric (every flow crosses it) ``fabric``; ties within 1e-12."""
    fabric_link = -1
    rate = [0.0] * len(flows)
    frozen = [False] * len(flows)
    members: dict[int, list[int]] = {}
    weight: dict[int, float] = {}
    for i, f in enumerate(flows):
        for link, coef in zip(f.links, f.coefs):
            members.setdefault(link, []).append(i)
            weight[link] = weight.get(link, 0.0) + f.weight * coef
    cap = {link: local_bandwidth if link >= 2 * hosts else bandwidth for link in members}
    if fabric is not None:
        members[fabric_link] = list(range(len(flows)))
        cap[fabric_link] = fabric
        weight[fabric_link] = sum(f.weight for f in flows)
    count = {link: len(lst) for link, lst in members.items()}
    live = list(members)

    def coef_on(f: _Msg, link: int) -> float:
        return f.coefs[f.links.index(link)] if link in f.links else 1.0

    while live:
        level = min(cap[link] / weight[link] for link in live)
        limit = level * (1.0 + 1e-12)
        for link in [link for link in live if cap[link] / weight[link] <= limit]:
            for i in members[link]:
                if frozen[i]:
                    continue
                frozen[i] = True
                f = flows[i]
                rate[i] = level * f.weight
                crossed = list(zip(f.links, f.coefs)) + ([(fabric_link, 1.0)] if fabric is not None else [])
                for other, coef in crossed:
                    cap[other] = max(cap[other] - rate[i] * coef, 0.0)
                    count[other] -= 1
                    weight[other] -= f.weight * coef
        live = [link for link in live if count[link] > 0]
        for link in live:  # rounding must not leave a live link with no weight
            if weight[link] <= 0.0:
                weight[link] = sum(flows[i].weight * coef_on(flows[i], link) for i in members[link] if not frozen[i])
    return [r if r > 0.0 else bandwidth * 1e-9 for r in rate]


def make_sim(hosts: int, bandwidth: float, local_bandwidth: float, fabric: float | None) -> _Sim:
    """An event loop with one worker and one server on each of ``hosts`` hosts, for its network alone."""
    return _Sim(fwd=[0.0], bwd=[0.0], layer_names=["layer"], layer_tensors=[[0]], groups=[[0]], group_keys=[[0]],
                key_bytes=[4], key_server=[0], workers=hosts, servers=hosts, bandwidth=bandwidth, startup=0.0,
                priority=False, stagger=False, credit=None, push_after_backward=False, overlap=False, iterations=1,
                record=False, fabric=fabric, hosts=list(range(hosts)) * 2, local_bandwidth=local_bandwidth)


def random_flows(rng: random.Random, hosts: int, n: int, uneven: bool) -> list[_Msg]:
    """Pushes (worker -> server) and results (server -> worker) between random hosts, some on one host
    (its local link), with folding coefficients on the server's side and, if ``uneven``, log-normal weights."""
    flows = []
    for _ in range(n):
        a, b = rng.randrange(hosts), rng.randrange(hosts)
        fold = rng.choice([1.0, 1.0, 2.0, 4.0, 16.0, rng.uniform(1.0, 8.0)])
        push = rng.random() < 0.5
        links = (2 * hosts + a,) if a == b and rng.random() < 0.7 else (a, hosts + b)
        coefs = (1.0, fold) if push else (fold, 1.0)
        weight = math.exp(rng.gauss(0.0, 0.6)) if uneven and push else 1.0
        flows.append(_Msg(push, a, b, 0, 1000, links, "", (a, hosts + b), weight=weight, coefs=coefs))
    return flows


def network_rates(sim: _Sim, flows: list[_Msg]) -> list[float]:
    """The rates ``_Sim._max_min`` gives ``flows``, started in this order in ``sim``'s empty network."""
    for m in flows:
        m.fid = next(sim.fid)
        sim.net.add(m)
    sim.net.flush()
    sim._max_min()
    return [m.rate for m in flows]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-9, abs=0.0)


@pytest.mark.parametrize("seed", range(60))
def test_max_min_matches_the_reference_on_random_flows(seed):
    rng = random.Random(seed)
    hosts = rng.randint(1, 7)
    bandwidth = rng.choice([1.25e8, 1e9, rng.uniform(1e6, 1e9)])
    local_bandwidth = rng.choice([2e9, bandwidth, bandwidth / 3])
    fabric = rng.choice([None, None, bandwidth * rng.uniform(0.5, 3.0) * hosts, bandwidth / 2])
    flows = random_flows(rng, hosts, rng.randint(1, 120), uneven=seed % 2 == 1)
    sim = make_sim(hosts, bandwidth, local_bandwidth, fabric)
    first = network_rates(sim, flows)
    assert_close(first, reference_rates(flows, hosts, bandwidth, local_bandwidth, fabric))
    # Flows end and others start: the table keeps the rest in order, their classes and its kept levels.
    ended = [i for i in range(len(flows)) if rng.random() < 0.4]
    assert [m.fid for m in sim.net.remove(np.array(ended, dtype=np.intp))] == [flows[i].fid for i in ended]
    now = [m for i, m in enumerate(flows) if i not in ended]
    more = random_flows(rng, hosts, rng.randint(0, 30), uneven=seed % 2 == 1)
    network_rates(sim, more)
    now += more
    assert_close([m.rate for m in now], reference_rates(now, hosts, bandwidth, local_bandwidth, fabric))
    # The first flow set again (new flows, the same pattern): the kept levels give the same rates.
    again = [_Msg(m.push, m.worker, m.server, 0, 1000, m.links, "", m.pair, weight=m.weight, coefs=m.coefs)
             for m in flows]
    sim.net.remove(np.array([m.row for m in now], dtype=np.intp))
    assert network_rates(sim, again) == first
    # One flow ends and a like one starts: the same pattern, the same rates, the new flow's too.
    i = rng.randrange(len(again))
    m = again[i]
    like = _Msg(m.push, m.worker, m.server, 0, 1000, m.links, "", m.pair, weight=m.weight, coefs=m.coefs)
    sim.net.remove(np.array([m.row], dtype=np.intp))
    network_rates(sim, [like])
    assert_close([f.rate for f in again[:i] + again[i + 1:] + [like]], first[:i] + first[i + 1:] + [first[i]])


def test_a_full_link_still_lets_its_flows_progress():
    """A link of capacity 0 gives its flows level 0: they get B x 1e-9, the others their fair share."""
    sim = make_sim(2, 1e9, 0.0, None)
    flows = [_Msg(True, 0, 0, 0, 1000, (4,), "", (0, 2)),  # host 0's local link
             _Msg(True, 0, 1, 0, 1000, (0, 3), "", (0, 3)),
             _Msg(False, 1, 0, 0, 1000, (0, 3), "", (2, 1))]
    rates = network_rates(sim, flows)
    assert rates == [1e9 * 1e-9, 5e8, 5e8]
    assert_close(rates, reference_rates(flows, 2, 1e9, 0.0, None))


def test_levels_by_hand():
    """Links of capacity 8, 10 and 40; flow A crosses links 0 and 2, B (weight 2, twice its bytes on link 2)
    links 1 and 2, C link 2. Link 1 fills first at 10 / 2 = 5 (B: 10, so 20 of link 2), then link 0 at 8 / 1
    (A: 8; link 2 has 40 - 20 - 8 = 12 left), then link 2 at 12 / 1 (C: 12)."""
    links = np.array([[0, 2, 3], [1, 2, 3], [2, 3, 3]])
    coefs = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 0.0], [1.0, 0.0, 0.0]])
    weight = np.array([1.0, 2.0, 1.0])
    level = max_min_levels(links, coefs, weight, np.array([8.0, 10.0, 40.0]))
    assert (level * weight).tolist() == [8.0, 10.0, 12.0]
    assert max_min_levels(links[:0], coefs[:0], weight[:0], np.array([1.0])).tolist() == []
