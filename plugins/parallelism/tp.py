"""parallel=tp: tensor-parallel attention (heads split across ranks) and tensor-parallel dense FFN."""
from __future__ import annotations

from framework.parallel import Parallelism, ParallelConfig
from framework.registry import PARALLELISM


@PARALLELISM.register("tp")
class TensorParallel(Parallelism):
    Config = ParallelConfig
    replicates_batch = True
