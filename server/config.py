"""`ServerConfig`: the HTTP side of serving (address, API key, limits).

Built once in `server/__main__.py` from flags and environment; `server/app.py` reads it.
Engine shapes live in `model.config.EngineConfig`, not here.
"""

from __future__ import annotations

import dataclasses

from server import reasoning, tool_calls

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the id /v1/models lists (the GGUF file name); requests may name any model
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # None: no authentication
    chat_template: str | None = None  # template text from --chat-template; None: the GGUF's
    tool_call_parser: str = "auto"  # --tool-call-parser: server/tool_calls.py's CHOICES
    reasoning_format: str = "auto"  # --reasoning-format: server/reasoning.py's CHOICES
    pooling: str = "auto"  # --pooling: /v1/embeddings' (server/embeddings_api.py); auto: the GGUF's, else last
    slot_save_path: str | None = None  # --slot-save-path: slot files' directory (server/slots_api.py); None: no slot actions
    spm_infill: bool = False  # --spm-infill: FIM prompts (server/infill.py) as suffix, prefix, middle
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    max_choices: int = 64  # prompts x n per request
    shutdown_grace_s: float = 10.0  # open streams get this long to finish on SIGINT/SIGTERM
    engine_shutdown_timeout_s: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model name must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError("max body size must be >= 1024 bytes")
        if self.max_choices < 1:
            raise ValueError("max choices must be >= 1")
        if self.shutdown_grace_s < 0 or self.engine_shutdown_timeout_s < 0:
            raise ValueError("shutdown timeouts must be >= 0")
        if self.tool_call_parser not in tool_calls.CHOICES:
            raise ValueError(f"tool call parser must be one of {', '.join(tool_calls.CHOICES)}")
        if self.reasoning_format not in reasoning.CHOICES:
            raise ValueError(f"reasoning format must be one of {', '.join(reasoning.CHOICES)}")
        if self.pooling not in ("auto", "mean", "last"):
            raise ValueError(f"pooling must be auto, mean or last, got {self.pooling!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}")
