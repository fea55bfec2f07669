"""The agent APIs (Anthropic Messages, OpenAI Responses), each in the chat form llama-server
converts it to, and its answers back in their own form."""
