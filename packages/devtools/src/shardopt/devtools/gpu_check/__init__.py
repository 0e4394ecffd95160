"""``shardopt gpu-check``: a one-command check of shardopt on one CUDA device that writes
``report.json`` and ``report.md`` (see the README's "GPU check"). Nothing heavy is imported
until it runs."""

from shardopt.devtools.gpu_check._runner import add_gpu_check_parser, main, run_gpu_check

__all__ = ["add_gpu_check_parser", "main", "run_gpu_check"]
