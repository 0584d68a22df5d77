"""What a worker and the proxy share about the cluster: the registration and heartbeat
messages, the client a worker heartbeats with, and trust (the cluster secret, the
authenticated envelope, transfer grants)."""
