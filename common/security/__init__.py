"""Security between moemesh processes and at the HTTP gateway.

- `curve`: CURVE key pairs (generate, write, load) and the socket options that apply them.
- `authenticator`: a ZAP handler that admits only allow-listed client public keys.
- `socket_security`: one frozen object per process telling the transport how to secure
  every socket it binds or connects, built from the deployment config.
- `bind_policy`: no bind beyond loopback without CURVE (unless explicitly insecure).
- `api_keys`: the gateway's Bearer keys, compared in constant time.

Nothing here does I/O at import time.
"""
