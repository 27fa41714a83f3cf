"""`ddscope bench`: the context sweep, throughput decomposition and attribution (docs/bench.md).

Rooms, in the order their imports point (each imports only the ones before it): `errors.py`, `limit/` (the
physical floor), `collecting/` (what the server and the files say), `judging/` (what it means), `running/` (the
experiment, which ends by handing its rows to judging), and `cli.py`. `synthetic_models.py` builds random models
for tests and benchmarks."""
