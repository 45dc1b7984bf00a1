"""Without CUDA, run the Triton kernels in Triton's interpreter on CPU tensors. Triton reads TRITON_INTERPRET when
a kernel is decorated, so this must happen before kernels.fused_moe is first imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    # The test machine's cores are shared; one thread also keeps float sums reproducible.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
