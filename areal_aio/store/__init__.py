"""What outlives a message: versioned weights in /dev/shm (the hand-off between workers) and the
run's checkpoints on disk."""
