"""Process-wide logging: human-readable lines or one JSON object per line.

One `logging.config.dictConfig` dictionary serves both the master (before gunicorn
starts) and gunicorn itself (its `logconfig_dict`), so every line of a process, ours and
gunicorn's, has one format. gunicorn's access log is silenced: the request log
(pipeserve.request, server/request_log.py) writes one richer line per request instead.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

LogFormat: TypeAlias = Literal["human", "json"]
HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# JSON lines: `time` (ISO 8601, UTC), these record attributes, then every `extra` field.
JSON_FIELDS = ("levelname", "name", "process", "message")
JSON_RENAMES = {"levelname": "level", "name": "logger", "process": "pid"}


def logging_config(log_format: LogFormat, level: str) -> dict[str, Any]:
    formatter: dict[str, Any] = {"format": HUMAN_FORMAT}
    if log_format == "json":
        formatter = {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": list(JSON_FIELDS),
            "rename_fields": JSON_RENAMES,
            "timestamp": "time",
            "json_ensure_ascii": False,
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"pipeserve": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "pipeserve",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {
            "gunicorn.error": {"level": level.upper(), "handlers": [], "propagate": True},
            "gunicorn.access": {"level": "CRITICAL", "handlers": [], "propagate": False},
        },
    }


__all__ = ["LogFormat", "logging_config"]
