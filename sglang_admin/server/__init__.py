"""The server process: grpc.aio servicer, interceptors, communicator and the per-domain services."""
