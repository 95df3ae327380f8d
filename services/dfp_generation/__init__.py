"""dflash-pipeline generation service."""
