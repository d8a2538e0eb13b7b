"""saria: a KV-cache tiering data plane for LLM agent serving (GPU HBM <-> pinned DRAM <-> NVMe SSD).

Layers: ``saria.control`` decides, ``saria.dataplane`` moves bytes, ``saria.kernels`` packs pages.
See DESIGN.md (in the shared folder beside the repository) for the architecture.
"""

__version__ = "0.1.0"
