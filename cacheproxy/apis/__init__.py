"""llama-server's other request shapes (Responses, Anthropic Messages) in the chat form it runs."""
