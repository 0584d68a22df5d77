"""What the processes of one cluster share: membership messages, trust, identity."""
