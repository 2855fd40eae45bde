"""Service runtime shared by every moemesh process: logging, deployment config, the
service skeleton and the supervisor side of readiness and heartbeats. Torch-free."""
