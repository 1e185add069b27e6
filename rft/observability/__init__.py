"""What a run shows and who may see it: the metric sinks (`metrics`: the JSONL log, TensorBoard, W&B; `prometheus`:
a scrape endpoint per part; `plots`: the reward curve PNG) and the access checks of rft's HTTP endpoints (`access`:
bearer keys, Host allow-list, JSON only; `app_thread`: an app under uvicorn in a thread). Imports nothing of rft
above the config; fastapi (the web extra) only in `access`."""
