"""zfctl.bench: time ZenFlow configurations against plain CPU offload, phase by phase.

    from zfctl.bench import BenchOptions, run_bench
    report = run_bench(BenchOptions(topks=[0.1, 0.2], intervals=[2, 4]), rich.console.Console())

`grid` builds the configurations (user grid + zero-offload and off baselines), `runner` holds the
timed loop, `timing` the clocks (CUDA events / wall clock), `summary` the per-step-kind averages,
`report` the tables and files, `plot` the optional PNG. `zfctl bench` (zfctl/cli/bench.py) is the
command-line front end.
"""

from zfctl.bench.suite import BenchOptions, BenchReport, run_bench

__all__ = ["BenchOptions", "BenchReport", "run_bench"]
