"""`kvrt route`: an OpenAI-compatible HTTP router in front of several kvrt nodes."""
