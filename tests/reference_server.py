"""A vLLM OpenAI server with the reference connector (``saria.harness.reference``), started as
``saria serve`` starts vLLM (its environment: the connector-free core reservation, so both servers
run the same threads), for the outputs a ``saria serve`` must match bit for bit: requests carry
``kv_transfer_params`` (``load_tokens``: what the saria server reused for that request).

    python tests/reference_server.py MODEL [vLLM options...]
"""

from __future__ import annotations

import json
import sys

from saria.commands import serve
from saria.harness.reference_runs import CONNECTOR


def main(argv: list[str]) -> int:
    model, rest = serve.split_passthrough(argv)
    argv = serve.command(model, rest, None) + ["--kv-transfer-config", json.dumps(CONNECTOR)]
    return serve.run_vllm(argv, serve.environment(rest, serve.vllm_distribution()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
