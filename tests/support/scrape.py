"""koordrp's /metrics and /healthz, as an operator's scraper reads them."""

import re
import socket
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus' text format, found by name and exact labels."""
    for line in metrics.splitlines():
        found = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if found and found.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', found.group(2) or "")) == labels:
            return float(found.group(3))
    raise AssertionError(f"no {name} {labels} in:\n{metrics}")
