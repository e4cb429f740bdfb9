"""What every schedule shares and no kernel needs: the problem, its options and limits, the
ledger of HBM traffic, and the one registry of schedules (forward and backward)."""
