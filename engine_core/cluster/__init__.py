"""What a worker and the proxy share about cluster membership: the registration and
heartbeat messages, and the client a worker heartbeats with."""
