"""Scoring replies: the reward contract and the built-in rewards, the reward processes, the
rollout-based process reward."""
