"""``shardopt bench``: DDP, torch's ZeRO, the drop-in and shardopt stages 1 and 2, interleaved
on local gloo ranks (``_run``), reported as a table, ``bench.json`` and ``bench.png``
(``_report``)."""

from shardopt.devtools.bench._cli import add_bench_parser, run_bench

__all__ = ["add_bench_parser", "run_bench"]
