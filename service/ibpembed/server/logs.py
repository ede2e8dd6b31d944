# SPDX-License-Identifier: Apache-2.0
"""Log records of the serving process that need more than a level setting."""

from __future__ import annotations

import datetime
import json
import logging

# grpc.aio logs this, at ERROR and with a traceback, when a servicer's reply (a message or the
# status) meets a call that has already ended: the client cancelled it or its deadline passed
# while the handler ran. grpc then drops the reply; the server is fine.
_GRPC_LOGGER = "grpc._cython.cygrpc"
_DEAD_CALL_REPLY = "ExecuteBatchError raised in core by servicer method"


class DeadCallReplyFilter(logging.Filter):
    """Demotes grpc's ExecuteBatchError record to one WARNING line without the traceback, so
    error-log alerts do not fire on a routine client cancellation. Every other grpc record
    passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(_DEAD_CALL_REPLY):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = f"{record.msg} (the call had already ended: reply dropped)"
            record.exc_info = record.exc_text = None
        return True


def quiet_dead_call_replies() -> None:
    """Install :class:`DeadCallReplyFilter` on grpc's logger (once per process)."""
    logger = logging.getLogger(_GRPC_LOGGER)
    if not any(isinstance(f, DeadCallReplyFilter) for f in logger.filters):
        logger.addFilter(DeadCallReplyFilter())


class JsonFormatter(logging.Formatter):
    """One JSON object a line (``--log-format json``): what log pipelines (Loki, Cloud Logging,
    Elastic) parse without a grok pattern. Keys: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, and ``exception`` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            # timezone.utc, not datetime.UTC: that alias came with Python 3.11.
            "time": datetime.datetime.fromtimestamp(
                record.created, datetime.timezone.utc
            ).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str, log_format: str) -> None:
    """The process's logging: ``level`` (a name logging knows), ``log_format`` text or json."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])
