"""Moving objects between tiers: ``engine`` (the :class:`TransferEngine` facade: checks plans and
orders and hands them to a path), one module per path (``dram_loads`` DRAM->GPU, ``ssd_loads``
SSD->GPU, ``stores`` GPU->DRAM, ``writes`` DRAM/GPU->SSD, ``prewarm`` SSD->DRAM; ``packing`` is
the offload thread the stores and GPU-source writes share), and what the paths share:
``load_job`` (a reload in flight), ``tables`` (page tables, block-id checks, the unpack),
``results`` (completions, counters), ``streams`` (CUDA streams and events, and their CPU twins),
``coordinator`` (DRAM pacing while SSD reads run, paper Eq. 4) and ``pcie`` (NVML counters)."""
