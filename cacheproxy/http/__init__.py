"""The HTTP face: the app factory, llama-server's routes, the byte relay, the error envelope."""
