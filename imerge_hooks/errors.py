"""Exceptions users can act on; messages name the rank, server, key and tensors involved."""


class IMergeError(RuntimeError):
    """Base class of every IMerge error."""


class IMergeConfigError(IMergeError, ValueError):
    """The launch or configuration is wrong (ranks, servers, options)."""


class IMergeMismatchError(IMergeError):
    """Workers disagree about the model: key sizes, dtypes or tensor names differ."""


class IMergeTimeoutError(IMergeError, TimeoutError):
    """A wait ran past ``timeout_s``: some rank is missing, slow or dead."""


class IMergeUsageError(IMergeError):
    """The API was used in an order that cannot work (e.g. zero_grad while pushing)."""
