"""The step loop: the engine core, its set-up, and what it does around each step (faults,
KV connectors, speculation, structured outputs). The state it moves, requests and step
messages, lives on the ground floor (``engine.messages.request``, ``engine.messages.step``)."""
