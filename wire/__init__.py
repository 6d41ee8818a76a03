"""pergrad's wire layer: what crosses between client and server, in numpy terms.

- `catalogue`: the reductions, declared once (options, outputs); no protobuf. `terms`:
  the types they are declared in (`Option`, `Output`, `Reduction`), re-exported by it.
- `results`: `GradientResult`, shapes of results, merging micro-batches; numpy only.
- `casting`: the one casting policy for user arrays; numpy only.
- `codec`: numpy <-> Tensor/TensorSpec/chunks; `chunks`: hand-encoded chunk messages;
  `messages`: requests and result headers <-> the catalogue's terms; `rpc`: method names.

Needs numpy and protobuf, never grpc or TensorFlow. The engine may import `catalogue`,
`results` and `casting`, which load no generated code; the rest loads `pergrad.v1`. This
module imports nothing, so importing one submodule loads only what that one needs.
"""
