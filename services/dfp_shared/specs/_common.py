"""Field types shared by the job specs."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from ..storage import StorageError, check_uri


def _uri(value: str) -> str:
    try:
        return check_uri(value)
    except StorageError as exc:
        raise ValueError(str(exc)) from None


StorageUri = Annotated[str, AfterValidator(_uri)]
"""A ``file://`` or ``s3://`` URI (or a bare local path) without ``..`` segments."""
