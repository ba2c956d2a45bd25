"""areal_aio: asynchronous RL for language models on one machine."""
