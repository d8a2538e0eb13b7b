"""Without CUDA the Triton kernels run under Triton's interpreter, which must be chosen before any
``@triton.jit`` function is defined, i.e. before saria.kernels is imported by a test module."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
