"""The disaggregation report (``python -m benchmarks.disagg_report``), one job a module.

``plan`` (what to run: topologies, bench runs, sizes; pure), ``cluster`` (start and stop a
``pdserve launch`` topology), ``execute`` (run a plan, save raw JSON), ``summary`` (markdown
and plots from the saved JSON).
"""
