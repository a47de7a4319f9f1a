"""The wire format's single owner (numpy + msgpack, no vLLM): hand-off, tree and verdict frames."""
