"""The data layer: one reading of every accepted form of training data.

:class:`TrainingData` takes tensors, ``(x, y)``, a ``DataLoader`` (also over an
``IterableDataset``) or a rank's shard under ``torch.distributed``, and answers
what the location optimiser and the context posterior ask: batches, all inputs,
size, checks. :mod:`._process_group` holds the sums over a process group (the
identity without one), :mod:`._shards` a rank's rows of the data set,
:mod:`._checks` the checks every input passes where it enters, and :mod:`._ranks`
the local ``gloo`` launcher of the tests and the multi-process benchmarks.
"""

from ._checks import (
    check_finite,
    check_fits_model,
    check_inputs,
    check_like_model,
    check_likelihood,
    check_targets,
)
from ._process_group import (
    all_gather_object,
    all_reduce_sum,
    broadcast_object,
    check_same_on_ranks,
    communication_device,
    is_distributed,
    is_multi_process,
    max_over_ranks,
    rank,
    reduce_mean,
    reduce_sum,
    reduce_sum_in_place,
    shard_offsets,
    world_size,
)
from ._shards import assemble_rows, check_shard, local_indices
from ._training_data import Data, SizedLoader, TrainingData

__all__ = [
    "all_gather_object",
    "broadcast_object",
    "communication_device",
    "is_multi_process",
    "reduce_sum_in_place",
    "Data",
    "SizedLoader",
    "TrainingData",
    "all_reduce_sum",
    "assemble_rows",
    "check_finite",
    "check_fits_model",
    "check_inputs",
    "check_like_model",
    "check_likelihood",
    "check_targets",
    "check_same_on_ranks",
    "is_distributed",
    "local_indices",
    "max_over_ranks",
    "rank",
    "reduce_mean",
    "reduce_sum",
    "shard_offsets",
    "world_size",
    "check_shard",
]
