"""Commands users run beside training: ``imerge-whatif`` (``whatif``), the timeline report
(``timeline_report``) and the transport check (``transport_check``).

Imports: anything in ``imerge_hooks``; nothing imports them.
"""
