"""The `serve` section: `rft serve` (the OpenAI-compatible endpoint), its access control and limits, and the joiner
that turns its traffic and feedback into experience groups (rft/serve/). The engine is the explorer's."""
from __future__ import annotations

from dataclasses import dataclass

from rft.config import COUNT, POSITIVE, Range, Section, option
from rft.config.fields import PORT_OR_ANY


@dataclass(frozen=True)
class ServeConfig(Section):
    """`rft serve` (the OpenAI-compatible endpoint) and the joiner that turns its traffic and feedback into
    experience groups (rft/serve/). The engine is the explorer's (explorer.engine and its settings)."""
    KEY = "serve"
    host: str = option("127.0.0.1", help="address `rft serve` listens on (0.0.0.0: every interface)")
    port: int = option(8000, help="its TCP port (`rft serve --port` overrides)", range=PORT_OR_ANY)
    model_name: str = option("",
        help="the model id clients name (`model` of a request, GET /v1/models); empty: run.name")
    max_batch: int = option(16, help="requests generated together in one engine call", range=COUNT)
    feedback_expire_s: float = option(3600.0, range=POSITIVE,
        help="a completion without feedback this long after it was served expires")
    group_size: int = option(4, help="rewarded single completions (n = 1) of one prompt that make a group", range=COUNT)
    group_wait_s: float = option(30.0, range=POSITIVE,
        help="singles wait this long for peers of their prompt, then join the baseline window")
    baseline_window: int = option(64, help="rewards per prompt remembered for its running-mean baseline", range=COUNT)
    api_key_env: str = option("RFT_SERVE_API_KEY",
        help="environment variable holding the bearer key(s) clients must send (comma-separated); set or not, the "
        "key never goes into the run directory; needed when serve.host is beyond loopback (docs/security.md)")
    api_key_file: str = option("",
        help="a file holding bearer keys, one per line (besides api_key_env); keep it outside the run dir")
    allowed_hosts: list[str] = option(factory=list,
        help="Host header values accepted (the DNS-rebinding defence); empty: localhost, 127.0.0.1, ::1, "
        "serve.host and this host's names; [\"*\"]: any")
    max_body_bytes: int = option(1048576, help="largest request body; a longer one gets 413", range=COUNT)
    max_request_tokens: int = option(16384, range=COUNT,
        help="largest n x max_tokens of one completion request (400 past it)")
    max_queue: int = option(64, range=COUNT,
        help="requests waiting for the tokenizer or the engine; past it a request gets 429 with Retry-After")
    max_images: int = option(4, range=Range(0, 256, note="0: no image parts"),
        help="a vision-language model: image content parts one request may carry (400 past it); a text model "
        "takes none")
    max_image_bytes: int = option(1048576, range=COUNT,
        help="largest image of a request, decoded from its base64 data URI (400 past it); the body's base64 counts "
        "against serve.max_body_bytes too")
    max_image_pixels: int = option(4194304, range=Range(1, 100_000_000),
        help="largest width x height of one image, read from its header before its pixels are decoded (400 past it)")
    request_timeout_s: float = option(300.0, range=POSITIVE,
        help="a completion request not generated within this many seconds gets 504")
    adapters: dict[str, str] = option(factory=dict,
        help="other LoRA runs of the same base served beside this run's policy: model name (a request's `model`) "
        "-> that run's weight store directory (its newest adapter version is served); needs explorer.engine "
        "vllm and model.lora.rank at least their rank; their traffic is answered, not recorded "
        "(rft/serve/server.py)")
