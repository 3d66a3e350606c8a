"""``python -m imerge_hooks.server``: run this rank as a parameter server (an MPMD launch; servers come
last), serve until every worker shut down, then exit 0."""

from imerge_hooks.cluster.startup import run_server_program

run_server_program()
