"""The figures benchmarks print."""


def quantile(samples: list[float], fraction: float) -> float:
    """The sample below which ``fraction`` of them lie (nearest rank): p99 is quantile(samples, 0.99)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
