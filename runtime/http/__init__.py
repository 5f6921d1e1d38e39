"""The OpenAI-compatible HTTP front door of a node (`kvrt launch --http-port H`)."""
