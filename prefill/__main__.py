"""`python -m prefill`: exactly `pdserve prefill` (the same flags, and vLLM's environment
variables folded into them the same way, e.g. VLLM_ENGINE_READY_TIMEOUT_S and VLLM_API_KEY)."""

import sys

from deploy.cli import main

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
