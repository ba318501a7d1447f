"""Models and tokenizers from local directories (never the hub), and tiny models for tests."""
