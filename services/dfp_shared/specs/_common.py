"""Field types shared by the job specs."""

from __future__ import annotations

import math
import typing
from typing import Annotated

from pydantic import AfterValidator, BaseModel

from dfp_shared.storage.uris import OutsideRoots, canonical_uri


def _uri(value: str) -> str:
    try:
        canonical_uri(value)
    except OutsideRoots as exc:
        raise ValueError(str(exc)) from None
    return value


StorageUri = Annotated[str, AfterValidator(_uri)]
"""A canonical ``s3://bucket/key`` or ``file:///path`` URI, or an absolute local path (see
:func:`dfp_shared.storage.uris.canonical_uri`); whether it lies inside the operator's roots is
checked by the API and by every worker."""


def _finite(value, where: str = ""):
    """``value`` (plain JSON) if no number in it is NaN or infinite (JSON has no such numbers; a parser
    that accepts them would otherwise store them as null)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where or 'value'}: {value!r} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite(v, f"{where}[{i}]")
    return value


FiniteJson = Annotated[dict, AfterValidator(_finite)]
"""A JSON object whose numbers, however deep, are all finite."""


def _is_storage_uri(annotation, metadata=()) -> bool:
    if any(getattr(m, "func", None) is _uri for m in metadata):
        return True
    if typing.get_origin(annotation) is Annotated:
        return _is_storage_uri(None, annotation.__metadata__)
    return any(_is_storage_uri(arg) for arg in typing.get_args(annotation))


def storage_fields(model: type[BaseModel]) -> list[str]:
    """Names of the model's fields that hold storage URIs."""
    return [name for name, info in model.model_fields.items() if _is_storage_uri(info.annotation, info.metadata)]
