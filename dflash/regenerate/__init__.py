"""Regeneration: a chat data set's answers replaced by the target's own, in-process (`local`) or through an
OpenAI-compatible inference server (`server`, with its HTTP `client`)."""
