"""The trainer worker (`python -m areal_aio.workers.trainer`): the trainable policy and its
optimizer, the objectives, micro-batching and packing, the data-parallel ranks, checkpoints and exports."""
