"""pergrad's server: holds models and versioned weights, answers per-example gradient requests.

`pergrad.server.engine` computes; `pergrad.server.service` is the thin gRPC layer over it.
"""
