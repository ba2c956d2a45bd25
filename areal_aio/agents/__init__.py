"""Agents: what an episode talks to (the Model, its bounds, the one sequence it trains), the
OpenAI-compatible endpoint and chat protocol an agent in another framework calls, playing an
episode, and the example agents (the calculator's, with the openai package and with smolagents,
and code with execution feedback). Below the controller, which plays them; never imports it."""
