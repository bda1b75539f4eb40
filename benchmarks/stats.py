"""The figures benchmarks print, and how their samples are taken."""

import math
import time
from typing import Callable


def quantile(samples: list[float], fraction: float) -> float:
    """The sample below which ``fraction`` of them lie (nearest rank): p99 is quantile(samples, 0.99)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def timed(count: int, call: Callable[[int], object]) -> list[float]:
    """Seconds each of ``count`` calls took; ``call`` gets the call's index."""
    samples = []
    for index in range(count):
        started = time.perf_counter()
        call(index)
        samples.append(time.perf_counter() - started)
    return samples


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds ``pid`` has run so far, every thread it ever had included: its process CPU clock (Linux's
    ``clock_getcpuclockid``, exact). Summing /proc/PID/task/*/schedstat would miss the threads that ended,
    such as the thread grpcio starts for a future's callback on an idle channel and ends after it."""
    return time.clock_gettime_ns(_process_clock(pid))


def _process_clock(pid: int) -> int:
    # The clock id clock_getcpuclockid(3) gives, which Python does not wrap: ~pid << 3 | CPUCLOCK_SCHED.
    return ((~pid) << 3) | 2


def median_interval(samples: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median (95 % with the default ``z``): the order
    statistics whose ranks lie ``z`` standard deviations of Binomial(n, 1/2) either side of n/2."""
    ordered = sorted(samples)
    count = len(ordered)
    reach = z * math.sqrt(count) / 2
    low = max(0, math.floor(count / 2 - reach) - 1)
    high = min(count - 1, math.ceil(count / 2 + reach))
    return ordered[low], ordered[high]
