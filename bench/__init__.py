"""hutch's benchmark harness: ``python -m bench [names...] [--quick]``.

Every benchmark measures hutch and a host baseline in the same run and reports the ratio;
see ``bench/README.md``. Modules: ``stats`` (pure numbers), ``host`` (host facts),
``daemon`` (a private hutchd per run), ``baselines`` (host-side reference work),
``cases`` (the benchmarks), ``report`` (JSON files and the table), ``__main__`` (CLI).
"""
