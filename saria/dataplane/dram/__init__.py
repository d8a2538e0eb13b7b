"""The DRAM tier: ``host_pool`` (pinned host memory cut into fixed-size slots, registered with CUDA
segment by segment), ``store`` (the index of which objects live in which slots) and ``staging``
(the reusable buffers reloads land in)."""
