"""Tools around the tiers: the demo, the broker launcher, ``ddnn evaluate`` and the bundle
commands. Nothing here is part of the contract between tiers."""
