"""A server's Prometheus ``/metrics`` text as a small lookup (prometheus_client's parser does the parsing)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


class Metrics:
    """Samples by name; a name with several label sets (e.g. per model) sums its values."""

    def __init__(self, samples: list[Sample]) -> None:
        self._samples = samples

    def value(self, name: str, default: float | None = None) -> float | None:
        values = [s.value for s in self._samples if s.name == name]
        return sum(values) if values else default

    def int_value(self, name: str) -> int | None:
        v = self.value(name)
        return int(v) if v is not None else None

    def label_int(self, name: str, label: str) -> int | None:
        """An integer carried in a label (vLLM's ``cache_config_info`` puts its settings there)."""
        for s in self._samples:
            if s.name == name and label in s.labels:
                try:
                    return int(float(s.labels[label]))
                except ValueError:
                    return None
        return None


def parse_prometheus(text: str) -> Metrics:
    """Parse the text exposition format; a malformed body gives no samples (metrics are advisory)."""
    samples: list[Sample] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    except ValueError:
        return Metrics([])
    return Metrics(samples)
