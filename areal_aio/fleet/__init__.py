"""The workers as the controller sees them: clients over a pipe, in-process fakes, a pool of rollout
workers, a data-parallel trainer's ranks, Ray actors, and where each is placed."""
