"""dflash-pipeline api service."""
