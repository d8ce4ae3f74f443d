"""Flows: branches and loops the manager runs itself (docs/flows.md).

spec (the declaration, checked at submission) -> runner (instantiates steps into the session's DAG as decisions
resolve) -> service (the manager's entry points, tool-call queues, journal, restart); conditions and server_tools
are the closed sets of comparisons and functions a flow may use (no client code runs on the server).
"""
