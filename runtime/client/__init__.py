"""Everything on the caller's side of a node's client API: the wire contract (`api.py`), the
client and `kvrt generate`, the text tools (tokenizer, chat template, detokenizer, stop
strings), traces, replay, the demo, and starting a node from Python (`launch.py`)."""
