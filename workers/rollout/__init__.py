"""The rollout worker (`python -m areal_aio.workers.rollout`): the policy behind a
continuous-batching engine with a KV cache, counter-based sampling."""
