"""The agent APIs, each translated to and from the chat form llama-server converts it to."""
