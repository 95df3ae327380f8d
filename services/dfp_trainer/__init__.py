"""dflash-pipeline trainer service."""
