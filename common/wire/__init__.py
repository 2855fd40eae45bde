"""The wire layer: message types, the frame codec, staging buffers and ZeroMQ transport.

Import the submodules directly (`common.wire.messages`, `common.wire.codec`, ...); this
package imports nothing so that torch-free processes load only what they use.
"""
