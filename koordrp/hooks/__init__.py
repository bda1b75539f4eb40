"""Runtime hooks: which servers are registered, calling them, and chaining their answers."""
