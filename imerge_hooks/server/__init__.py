"""The parameter server: its loop (``loop``: receive pushes, average, answer), one key's streaming average
(``aggregate``) and a server rank's life after ``init()`` (``stages``). ``python -m imerge_hooks.server``
runs a server rank.

Imports: ``core`` and ``cluster``. Never ``worker``, ``frontends`` or ``tools``.
"""
