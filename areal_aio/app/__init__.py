"""The commands a user runs (`run`, `eval`, `sft`, `check`, `report`, `keys`), the checks before a
run starts, and the trackers a run reports to."""
