"""Stop-string detection with streaming hold-back (no torch).

Text that could still be the beginning of a stop string is held back from the stream until it is either
ruled out or completes the stop string (then the stream ends before it). ``text`` is always the output so far,
without the stop string (unless ``include_stop_str_in_output``).
"""

from __future__ import annotations

from parrot.common.sampling import FinishReason, SamplingParams


class StopChecker:
    def __init__(self, sampling: SamplingParams) -> None:
        self.stops = sampling.stop
        self.include = sampling.include_stop_str_in_output
        self.min_tokens = sampling.min_tokens
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self._text = ""
        self._emitted = 0  # chars of _text already streamed
        self._done = False

    @property
    def text(self) -> str:
        return self._text

    def push(self, piece: str, num_tokens: int) -> tuple[str, FinishReason | None]:
        """Add decoded text; return (text to stream now, STOP if a stop string completed)."""
        if self._done:
            return "", FinishReason.STOP
        start = max(0, len(self._text) - self.max_stop + 1)
        self._text += piece
        if self.stops and num_tokens >= self.min_tokens:
            hit = -1
            hit_stop = ""
            for s in self.stops:
                i = self._text.find(s, start)
                if i != -1 and (hit == -1 or i < hit):
                    hit, hit_stop = i, s
            if hit != -1:
                self._text = self._text[: hit + (len(hit_stop) if self.include else 0)]
                self._done = True
                return self._take(len(self._text)), FinishReason.STOP
        # hold back the longest suffix that is a proper prefix of some stop string
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self._text)), 0, -1):
                if self._text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._take(len(self._text) - hold), None

    def flush(self) -> str:
        """Release held-back text (generation ended for another reason)."""
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out
