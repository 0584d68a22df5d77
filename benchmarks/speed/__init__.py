"""The engine speed benchmark (``python -m benchmarks.engine_speed``), one job a module:
limits and model arithmetic, the engine driver, the timed cases, the HF baseline, the
summary."""
