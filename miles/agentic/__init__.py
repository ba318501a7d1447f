"""Agentic RL: multi-turn episodes with tools, the token-faithful session server, environments, sandboxes."""
