"""P2P KV connector: scheduler side, worker side, control channel, data transports."""
