"""The CUDA path's ordering, checked on the CPU through a stand-in device (``scripts/fake_device.py``):
a group's readiness covers every stream that wrote its gradients, nothing on the path waits on the
device, the DDP hook's next write waits for the copies its callbacks queued, and a flag is read from
its own copy. The comm thread's side (a key behind an unfinished event waits while the others go on)
runs in the shared job (``scripts/device_readiness.py``, ``test_comm_thread_never_waits_on_the_device``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from fake_device import FakeDevice  # noqa: E402

from imerge_hooks.core.wire import KeySpec  # noqa: E402
from imerge_hooks.frontends import ddp  # noqa: E402
from imerge_hooks.worker.group import Group  # noqa: E402


def device_group(device: FakeDevice, staging: bool = False, result_device: str = "cpu") -> Group:
    n = 8
    keys = [KeySpec(k, 4 * n // 2, "float32", 0, (f"t{k}",)) for k in range(2)]
    return Group(index=0, flat=torch.arange(n, dtype=torch.float32), result=torch.zeros(n, device=result_device),
                 keys=keys, key_ranges=[(0, n // 2), (n // 2, n)], priority=0, names=("t0", "t1"),
                 staging=torch.zeros(n) if staging else None, device=device)


def test_readiness_covers_every_stream_that_wrote_a_gradient():
    """A gradient whose last kernel ran on another stream (a custom stream, AMP, checkpointing) is ready
    only when that stream gets there too, not when the submitting thread's stream does."""
    device = FakeDevice()
    group = device_group(device)
    device.stream = "side"
    group.note_producer()
    device.stream = "compute"
    group.note_producer()
    group.mark_ready()
    assert device.log[-1] == ("record_ready", ("compute", "side"))
    on_compute, on_side = group.ready_events
    assert not group.slot_ready(0)
    device.finish(on_compute)
    assert not group.slot_ready(0) and not group.slot_ready(1)  # the side stream's gradient is not written yet
    device.finish(on_side)
    assert group.slot_ready(0) and group.slot_ready(1)
    group.mark_ready()  # the next round starts from the streams of its own gradients
    assert device.log[-1] == ("record_ready", ("compute",))


def test_a_staged_key_is_ready_once_its_own_copy_ran_and_the_last_uploads_did():
    device = FakeDevice()
    group = device_group(device, staging=True)
    group.flat.fill_(3.0)
    group.mark_ready()
    assert not group.slot_ready(1)
    assert not any(entry[0] == "copy_after" for entry in device.log)  # nothing queued before the data is written
    device.finish(group.ready_events[0])
    assert group.slot_ready(1)  # the copy out of flat ran behind the ready event
    assert torch.equal(group.staging[4:], torch.full((4,), 3.0)) and not group.staging[:4].any()  # key by key
    group.uploaded = upload = device.copy_after(group.flat, group.result, [group.ready_events[0]])
    upload.complete = False  # the last round's upload out of ``result`` has not run yet: MPI must not write it
    assert not group.slot_ready(0)
    device.finish(upload)
    assert group.slot_ready(0)


def test_nothing_on_the_gradient_path_waits_on_the_device():
    """Every event's synchronize() fails here: a whole round on the stand-in device never calls one."""
    device = FakeDevice(hold=False)
    group = device_group(device, staging=True)
    group.mark_ready()
    for slot in range(2):
        assert group.slot_ready(slot)
        group.send_buffer(slot)
        group.recv_buffer(slot)
        group.result[slice(*group.key_ranges[slot])] = 2.0
        group.unpack(slot)
    group.results_queued()
    group.use_results()
    assert torch.equal(group.flat, torch.full((8,), 2.0))
    assert device.log[-1][0] == "wait_on_current"


def test_a_flag_on_the_device_is_read_from_its_own_copy():
    """With CUDA-aware MPI the result is in device memory: its flag is read by the device's own one-element
    read, not by synchronizing the copy stream (``streams.DeviceStreams.read_scalar``)."""
    device = FakeDevice(hold=False)
    group = device_group(device, result_device="meta")
    assert group.flag(3) == 1.0
    assert device.log[-1] == ("read_scalar", 3)


class _Hook:
    """What ``IMergeHookState._deliver`` reads of its state."""

    def __init__(self, outstanding: dict) -> None:
        self.outstanding = outstanding
        self.collected: dict = {}


def test_the_next_bucket_write_waits_for_the_copies_the_callbacks_queued():
    """DDP's buckets are copied out of the gradient buffer on the copy stream; the futures complete after
    the event that follows those copies, and the next round's write into the buffer waits for it (so it
    is not ordered by DDP's own wait alone)."""
    device = FakeDevice(hold=False)
    group = device_group(device)
    group.flat.copy_(torch.arange(8.0) + 10)
    buckets = {0: (torch.zeros(4), torch.futures.Future()), 1: (torch.zeros(4), torch.futures.Future())}
    seen = []
    for index, (_, future) in buckets.items():
        future.add_done_callback(lambda _f, index=index: seen.append((index, device.log[-1][0])))
    with device.on_copy_stream():
        ddp.IMergeHookState._deliver(_Hook(dict(buckets)), group, [(0, 0, 4), (1, 4, 4)], group.flat, None)
    assert torch.equal(buckets[0][0], torch.arange(4.0) + 10) and torch.equal(buckets[1][0], torch.arange(4.0) + 14)
    assert seen == [(0, "record_copies_done"), (1, "record_copies_done")]  # the event is there before any future
    consumed = group.consumed
    assert consumed is not None
    group.before_write()
    assert device.log[-1] == ("wait_on_current", "compute", consumed.name)
    group.before_write()  # once per round
    assert device.log[-1] == ("wait_on_current", "compute", consumed.name) and group.consumed is None


def test_a_failed_round_completes_the_futures_with_the_error():
    device = FakeDevice(hold=False)
    group = device_group(device)
    future = torch.futures.Future()
    ddp.IMergeHookState._deliver(_Hook({0: (torch.zeros(4), future)}), group, [(0, 0, 4)], group.flat,
                                 RuntimeError("server 0 died"))
    with pytest.raises(RuntimeError, match="server 0 died"):
        future.wait()
    assert group.consumed is None
