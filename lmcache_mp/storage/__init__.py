"""The daemon's storage: the CPU memory pool (L1), the tiers below it, and the manager over both."""
