"""Experiments: one module per question. Each declares its sweep as data, writes
results/<name>.<backend>.json through `loop_orders.results`, and plots only from that file.

    loop-orders figures [--quick]          # every experiment, then paper_notes.md
    python -m experiments.traffic          # one experiment (same options)
"""
