"""``pdserve bench serve``: vLLM's ``bench serve`` flags and metrics against any OpenAI server.

Modules, one job each: ``config`` (flags -> frozen ``BenchConfig``), ``datasets`` (prompts),
``traffic`` (arrival times), ``client`` (one streamed request -> ``RequestOutput``),
``metrics`` (TTFT/TPOT/ITL/E2EL/goodput), ``breakdown`` (server-side stages), ``runner``
(sends a run, sweeps rates), ``report`` (table, JSON), ``plots`` (PNG, optional matplotlib),
``prometheus`` (scrape /metrics), ``cli`` (the subcommand).
"""
