"""`python -m prefill`: one prefill worker, as `pdserve prefill` (the same flags, and vLLM's
environment variables folded into them the same way, e.g. VLLM_ENGINE_READY_TIMEOUT_S)."""

import argparse
import logging
import os
import sys

from engine_core.server.server_args import apply_environment
from prefill.worker import add_worker_arguments, run

if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_worker_arguments(parser)
    args = parser.parse_args()
    apply_environment(args)
    sys.exit(run(args))
