"""saria: a KV-cache tiering data plane for LLM agent serving (GPU HBM <-> pinned DRAM <-> NVMe SSD).

Floors, top down (nothing imports upward): ``saria.commands`` (the ``saria`` command) and
``saria.harness`` (the demo and test harness); ``saria.integrations`` (the vLLM connector,
``TieredCache``) and ``saria.replay``; ``saria.control`` decides and ``saria.dataplane`` moves
bytes; ``saria.kernels`` packs pages. ``saria.orders`` (the contract between the floors),
``saria.config`` and ``saria.models`` are neutral. docs/architecture.md has the architecture.
"""

__version__ = "0.1.0"
