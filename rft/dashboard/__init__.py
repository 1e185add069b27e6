"""`rft dashboard CONFIG`: the live run page in a browser (curves, fleet, staleness, throughput, config).

- `rft.dashboard.model`: what the page shows, folded from the two sources a run already has, its control topic
  (read with rft.transport, as `rft status` reads it) and its `metrics.jsonl`: no database of its own.
- `rft.dashboard.server`: the web server (FastAPI + uvicorn): a JSON API, a server-sent events stream per run,
  and one page whose script and style are files of this package (nothing is loaded from elsewhere).

No core role imports this package: `rft run` starts it as a part of its own (`monitor.dashboard_port`).
"""
