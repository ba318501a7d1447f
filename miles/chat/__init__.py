"""Chat rendering and tool calls: OpenAI message shapes, chat templates per model family, tool-call parsing."""
