"""Generated wire contract (`make protos`); do not edit the *_pb2* modules by hand."""
