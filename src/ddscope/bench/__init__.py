"""`ddscope bench`: the context sweep, throughput decomposition and attribution (docs/bench.md)."""
