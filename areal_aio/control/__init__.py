"""The controller: one asyncio event loop (dispatch, rewards, staleness, replay, the policy clock),
the run's counters and rows, its checkpoints and exports, the held-out eval. Never imports torch."""
