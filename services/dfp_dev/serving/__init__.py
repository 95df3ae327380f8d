"""``dflash-pipeline serve-check``: an exported drafter served by a real vLLM from its own environment."""
