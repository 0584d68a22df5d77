"""`python -m decode`: one decode worker (same flags as `pdserve decode`)."""

import argparse
import logging
import os
import sys

from decode.worker import add_worker_arguments, run

if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="pdserve decode", description=__doc__)
    add_worker_arguments(parser)
    sys.exit(run(parser.parse_args()))
