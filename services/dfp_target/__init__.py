"""dflash-pipeline target service."""
