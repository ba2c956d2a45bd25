"""Where prompts and their verifiable answers come from: the built-in generated tasks and the
readers of a user's task files."""
