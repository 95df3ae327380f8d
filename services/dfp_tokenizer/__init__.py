"""dflash-pipeline tokenizer service."""
