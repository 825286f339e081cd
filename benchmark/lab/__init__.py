"""Development instruments: programs that measure one mechanism of stocaching while it is being
changed, for the people changing it, not scenarios a user runs to judge the library (those are
``python -m benchmark``'s subcommands). Each runs from the repository root as
``python -m benchmark.lab.<name>`` and prints its options with ``--help``:

* ``cpu_roles``: the CPU seconds of the training process, the DataLoader workers and the
  Prefetcher's loader processes, plain loader against ``Prefetcher(processes=N)``;
* ``prefetch_cost``: the CPU the Prefetcher's own machinery costs a load, ``--before DIR``
  alternating with an older checkout's package.
"""
