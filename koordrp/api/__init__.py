"""Generated stubs for the runtime hook API (proto/); regenerate with scripts/generate-stubs."""
