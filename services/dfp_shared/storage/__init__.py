"""Object storage: the stores (``file://`` and ``s3://``), their errors and retries, the operator"s storage roots
and URI rules, output ownership, ranged S3 reads."""

from dfp_shared import public_face

__getattr__, __all__ = public_face(__name__, {
    "store": ["ObjectStore", "LocalStore", "S3Store", "open_store", "split_uri", "visible", "normalize_key", "join_key"],
    "errors": ["StorageError", "NotFound", "AccessRefused"],
    "roots": ["StorageRoots"],
    "uris": ["OutsideRoots", "canonical_uri"],
    "ownership": ["OutputClaims", "OutputOwned"],
})
