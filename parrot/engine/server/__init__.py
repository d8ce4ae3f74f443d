"""An engine as its own process: the HTTP app (app), registration and heartbeats with the manager, idempotent fills
(op_memo), and starting engine processes (procs).
"""
