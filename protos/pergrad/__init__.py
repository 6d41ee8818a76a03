"""pergrad: per-example gradients as a service.

`pergrad.client` (numpy + gRPC) talks to `pergrad.server` (TensorFlow) over the
`pergrad.v1` wire contract generated from `protos/pergrad/v1/*.proto`.
"""
