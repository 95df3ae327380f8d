"""``dflash-pipeline demo``: the whole pipeline locally on the CPU with a small target."""
