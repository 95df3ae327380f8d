"""Store operations retried: transient S3 and network errors with doubling, jittered pauses (tenacity); a lasting
failure (a missing object or bucket, refused credentials) raised at once as the store's own error."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from tenacity import RetryCallState, RetryError, Retrying, retry_if_exception_type, stop_after_attempt

from dfp_shared.storage.errors import NotFound, StorageError

log = logging.getLogger(__name__)
RETRY_ATTEMPTS = 5  # tries of each store operation, on top of the client's


class _Transient(Exception):
    """A transient storage error (its reason the message), worth another attempt."""


def _retry(fn: Callable, what: str, attempts: int = RETRY_ATTEMPTS, base_delay: float = 0.2):
    """Call ``fn``, retrying transient S3/network errors with exponential backoff and jitter.

    The boto3 client retries each request itself; this loop also covers what it cannot: a
    connection broken while a body streams, a multipart transfer that failed as a whole.
    """
    def attempt():
        try:
            return fn()
        except Exception as exc:
            reason = _transient_reason(exc, what)
            if reason is None:
                raise
            raise _Transient(reason) from exc

    def backoff(state: RetryCallState) -> float:  # between half and one and a half of the doubling delay
        return base_delay * 2 ** (state.attempt_number - 1) * (0.5 + random.random())

    def logged(state: RetryCallState) -> None:
        log.warning("transient storage error, retrying",
                    extra={"what": what, "reason": str(state.outcome.exception()), "attempt": state.attempt_number,
                           "delay_s": round(state.next_action.sleep, 3)})

    try:
        return Retrying(stop=stop_after_attempt(attempts), wait=backoff, retry=retry_if_exception_type(_Transient),
                        before_sleep=logged)(attempt)
    except RetryError as exc:
        reason = exc.last_attempt.exception()
        raise StorageError(f"{what}: {reason} (gave up after {attempts} attempts)") from None


def _transient_reason(exc: Exception, what: str) -> str | None:
    """Why a transient error happened (worth a retry); raises StorageError for a lasting S3 failure.

    Returns None for an exception that is not a storage error at all (the caller re-raises it).
    """
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError
    from botocore import exceptions as bx

    if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, bx.ClientError):
        exc = exc.__context__  # boto3 wraps the client error of a failed (multipart) upload
    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code = error.get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            raise NotFound(f"{what}: no such object") from None
        if code == "NoSuchBucket":
            raise NotFound(f"{what}: bucket does not exist") from None
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            raise StorageError(f"{what}: access denied ({code}); check the S3 credentials") from None
        reason = f"{code or status}: {error.get('Message', '')}".rstrip(": ")
        if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling", "InternalError"):
            return reason
        raise StorageError(f"{what}: {reason}") from None
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
        raise StorageError(f"{what}: no S3 credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a role)") from None
    if isinstance(exc, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, RetriesExceededError)):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, bx.BotoCoreError):
        raise StorageError(f"{what}: {type(exc).__name__}: {exc}") from None
    return None

