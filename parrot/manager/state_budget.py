"""The bytes of text the manager holds for sessions, bounded per session and in all.

What is counted: every variable value (set by a client or generated) and the text of every submitted prompt,
as UTF-8 bytes. What a client sends (a value, a prompt) is *reserved* first and refused past either bound with
LimitExceeded naming the bound; generated values are only *charged* (their size is already bounded by the
output token limits, and refusing them would lose work). A closed session gives its bytes back.

With ``max_sessions`` and the per-request limits this bounds the manager's memory under abuse:
about ``max_total_bytes`` x the interpreter's overhead per byte of text, plus a fixed cost per node
(docs/results/operations.md: reliability, abuse run).
"""

from __future__ import annotations

from parrot.common.errors import LimitExceeded


class StateBudget:
    """One per session store; each session's graph charges it. Used from the event loop only."""

    def __init__(self, max_session_bytes: int | None = None, max_total_bytes: int | None = None) -> None:
        self.max_session_bytes = max_session_bytes
        self.max_total_bytes = max_total_bytes
        self.total_bytes = 0

    def reserve(self, session_bytes: int, nbytes: int, what: str) -> None:
        """Room for ``nbytes`` more client text in a session holding ``session_bytes``, else LimitExceeded."""
        if self.max_session_bytes is not None and session_bytes + nbytes > self.max_session_bytes:
            raise LimitExceeded(f"{what} of {nbytes} bytes would take the session past its max_session_bytes limit "
                                f"({session_bytes} of {self.max_session_bytes} used); delete the session or start "
                                "another", param="max_session_bytes")
        if self.max_total_bytes is not None and self.total_bytes + nbytes > self.max_total_bytes:
            raise LimitExceeded(f"{what} of {nbytes} bytes does not fit: the server holds {self.total_bytes} bytes "
                                f"of session state, its max_state_bytes limit is {self.max_total_bytes}; retry "
                                "after sessions end", param="max_state_bytes")

    def charge(self, nbytes: int) -> None:
        self.total_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.total_bytes = max(0, self.total_bytes - nbytes)
