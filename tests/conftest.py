"""Test-wide environment: W&B offline, Triton kernels interpreted on a CPU, one torch thread per process, and
hypothesis's examples and caches in the temporary folder (not .hypothesis/ in the checkout: tests write nowhere else)."""
import os
import tempfile

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("SERVELAB_START_METHOD", "forkserver")   # ranks fork from a warm server: ~0.2 s, not ~3 s
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "servelab-hypothesis"))
try:  # Triton reads TRITON_INTERPRET when it is first imported: decide before any test imports it
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
except ImportError:
    pass
