"""Prometheus: a scrape endpoint (`/metrics`) per part of a run, on `monitor.prometheus_host`, serving the latest
values a part gives it (`MetricsEndpoint.update`); `metrics_endpoint` builds the one `monitor.prometheus_port` asks
for. Each part announces the port it took on the control topic, and `rft status` lists them."""
from __future__ import annotations

import math

from rft.observability.config import MonitorConfig


class MetricsEndpoint:
    """A Prometheus scrape endpoint (`/metrics`) serving the latest values given to `update`. Names ending in
    `_total` are exposed as counters (the caller passes running totals), everything else as gauges; every
    series carries the labels given at start (run, role, id)."""

    def __init__(self, port: int, *, labels: dict[str, str], host: str = "127.0.0.1", search: int = 1):
        """Serve on `host` (monitor.prometheus_host), on the first free port of `port .. port + search - 1`
        (explorers sharing a host search)."""
        from prometheus_client import CollectorRegistry, start_http_server

        self.labels = labels
        self._values: dict[str, tuple[float, str]] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        last_error: OSError | None = None
        for candidate in range(port, port + max(1, search)):
            try:
                self._server, self._thread = start_http_server(candidate, addr=host, registry=registry)
                self.port = candidate
                return
            except OSError as e:
                last_error = e
        raise OSError(f"no free port for the Prometheus endpoint in {port}..{port + search - 1}: {last_error}")

    def update(self, values: dict[str, float], help_text: dict[str, str] | None = None) -> None:
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._values[name] = (float(value), (help_text or {}).get(name, name.replace("_", " ")))

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        for name, (value, text) in sorted(self._values.items()):
            family = (CounterMetricFamily(name.removesuffix("_total"), text, labels=names) if name.endswith("_total")
                      else GaugeMetricFamily(name, text, labels=names))
            family.add_metric(values, value)
            yield family

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


PORT_SEARCH = 64


def metrics_endpoint(monitor: MonitorConfig, *, run: str, role: str, instance: str) -> MetricsEndpoint | None:
    """The endpoint `monitor.prometheus_port` asks for (None when it is 0), on `monitor.prometheus_host`, on the first
    free port of the PORT_SEARCH from there (the parts of a run may share a host), labelled with the run's name, the
    part's role and its instance. Each part announces the port it took on the control topic, and `rft status` lists
    them."""
    if not monitor.prometheus_port:
        return None
    return MetricsEndpoint(monitor.prometheus_port, host=monitor.prometheus_host, search=PORT_SEARCH,
                           labels={"run": run, "role": role, "instance": instance})
