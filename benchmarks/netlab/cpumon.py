"""How much CPU the emulated cluster's ranks use, and how busy the whole machine is.

An emulation is faithful only while the host has CPU to spare: once the ranks and the kernel's
networking fill the cores, iterations stretch for reasons no real cluster has. Two readings:

* the ranks' CPU: user + system time of every process under the launch (``root_pid``: mpiexec;
  its descendants are the ranks, which also pay the kernel's TCP work they do in their system
  calls), as a share of all cores;
* the machine: ``/proc/stat``, everything (softirq, the runner's own link monitor, any other
  process), an upper bound.

    mon = CpuMonitor(root_pid, interval_s=0.25).start(); ...; mon.stop()
    mon.ranks_fraction(t0, t1), mon.busy_fraction(t0, t1)   # 0..1 of all cores between two
                                                             # time.monotonic() readings
"""

from __future__ import annotations

import os
import threading
import time

_TICKS = os.sysconf("SC_CLK_TCK")
_CORES = os.cpu_count() or 1


def read_proc_stat() -> tuple[int, int]:
    """(all jiffies, idle + iowait jiffies) summed over every core."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def tree_cpu_s(root_pid: int, seen: dict[int, float]) -> float:
    """CPU seconds (user + system) of ``root_pid`` and all its descendants. ``seen`` keeps each pid's
    last reading, so a process that has exited still counts with what it had used."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / _TICKS
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        if pid in cpu:
            seen[pid] = cpu[pid]
        todo += children.get(pid, [])
    return sum(seen.values())


class CpuMonitor:
    """Samples the ranks' CPU and ``/proc/stat`` every ``interval_s`` in a daemon thread."""

    def __init__(self, root_pid: int | None = None, interval_s: float = 0.5) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self._seen: dict[int, float] = {}
        # (monotonic s, all jiffies, idle jiffies, CPU seconds of the process tree)
        self.samples: list[tuple[float, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpumon", daemon=True)

    def start(self) -> CpuMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            total, idle = read_proc_stat()
            ranks = tree_cpu_s(self.root_pid, self._seen) if self.root_pid is not None else 0.0
            self.samples.append((time.monotonic(), total, idle, ranks))
            if self._stop.wait(self.interval_s):
                return

    def _ends(self, start: float, end: float) -> tuple[tuple, tuple] | None:
        """The first and last sample between ``start`` and ``end`` (None: fewer than two)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        return (inside[0], inside[-1]) if len(inside) >= 2 else None

    def busy_fraction(self, start: float, end: float) -> float | None:
        """Busy share of all cores between the samples nearest to ``start`` and ``end`` (None: too few)."""
        ends = self._ends(start, end)
        if ends is None:
            return None
        (_, t0, i0, _), (_, t1, i1, _) = ends
        return 1.0 - (i1 - i0) / (t1 - t0) if t1 > t0 else None

    def ranks_fraction(self, start: float, end: float) -> float | None:
        """The ranks' CPU as a share of all cores between the samples nearest to ``start`` and ``end``."""
        ends = self._ends(start, end)
        if ends is None or self.root_pid is None:
            return None
        (w0, _, _, c0), (w1, _, _, c1) = ends
        return (c1 - c0) / ((w1 - w0) * _CORES) if w1 > w0 else None
