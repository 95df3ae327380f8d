"""Structured JSON logging for every service."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

_SECRET_RE = re.compile(r"(?i)(password|secret|token|api[_-]?key|authorization|aws_secret_access_key)(\s*[=:]\s*)(\S+)")
_URL_CRED_RE = re.compile(r"(\w+://[^:/@\s]*:)([^@\s]+)(@)")


def redact(text: str) -> str:
    """Mask credentials in free text (``key=value`` pairs and ``scheme://user:pass@host``)."""
    text = _URL_CRED_RE.sub(r"\1***\3", text)
    return _SECRET_RE.sub(r"\1\2***", text)


class JsonFormatter(logging.Formatter):
    _RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in self._RESERVED and not key.startswith("_"):
                doc[key] = value if isinstance(value, (int, float, bool, type(None))) else redact(str(value))
        if record.exc_info:
            doc["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(doc, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(level: str = "INFO", json_logs: bool = True, service: str | None = None) -> None:
    """Configure the root logger once: JSON lines (default) or plain text on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(PlainFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if service:
        old_factory = logging.getLogRecordFactory()

        def factory(*args, **kwargs):
            record = old_factory(*args, **kwargs)
            record.service = service
            return record

        logging.setLogRecordFactory(factory)
