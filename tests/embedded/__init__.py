"""The embedded engine: the real llama-cpp-python on the generated test model."""
