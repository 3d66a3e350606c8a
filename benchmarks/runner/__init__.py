"""The benchmark runner behind ``benchmarks/run.py``, one step per module:

``cli`` (the command line), ``grid`` (models, schedules, paths, model facts, bounds),
``document`` (the result JSON and what ``--resume`` keeps), ``launch`` (the launches and one
mpiexec launch on the emulated cluster), ``measure`` (the measured part: launches, fabric probe,
scale check, timeline), ``predict`` (calibrated PS models and the simulator), ``emulator_check``
(is the emulator faithful; the link monitor's share statistics), ``validate`` (the simulator
against the measurement), ``report`` (tables, bounds and efficiency, targets, plots).
"""
