"""The rules every room shares, with no process state: settings (``config``), errors, the wire protocol
(``wire``: key specs, tags, MPI buffers; ``requests``: polled MPI requests), how groups are cut into keys and
where keys go (``layout``), the wire formats (``compression``), reduction operators (``ops``), polling with
back-off, host buffers, the timeline recorder and mpi4py's loader.

Imports: nothing else of ``imerge_hooks``. Everything may import it.
"""
