"""Exceptions users can act on; messages name the rank, server, key and tensors involved.

Horovod's names are aliases, so ``except hvd.HorovodInternalError`` clauses written for Horovod
resolve: ``HorovodInternalError`` is ``IMergeError`` (what a failed collective raises) and
``HostsUpdatedInterrupt`` is ``IMergeHostsUpdated`` (never raised: IMerge's hosts are fixed at launch).
"""


class IMergeError(RuntimeError):
    """Base class of every IMerge error."""


class IMergeConfigError(IMergeError, ValueError):
    """The launch or configuration is wrong (ranks, servers, options)."""


class IMergeMismatchError(IMergeError):
    """Workers disagree: about the model (key sizes, dtypes, tensor names) or about which collective they run."""


class IMergeTimeoutError(IMergeError, TimeoutError):
    """A wait ran past ``timeout_s``: some rank is missing, slow or dead."""


class IMergeUsageError(IMergeError):
    """The API was used in an order that cannot work (e.g. zero_grad while pushing)."""


class IMergeArgumentError(IMergeUsageError, ValueError):
    """A bad argument to a collective (``alltoall`` splits, ``root_rank``): a ``ValueError``, as in Horovod."""


class IMergeHostsUpdated(IMergeError):
    """Horovod's ``HostsUpdatedInterrupt`` (elastic mode). IMerge never raises it: its hosts are fixed at launch."""

    def __init__(self, skip_sync: bool = False, *args: object) -> None:
        super().__init__(*args or ("IMerge: the set of hosts changed",))
        self.skip_sync = skip_sync


HorovodInternalError = IMergeError
HostsUpdatedInterrupt = IMergeHostsUpdated
