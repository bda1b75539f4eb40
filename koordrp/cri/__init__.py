"""The CRI side of koordrp: a threaded grpcio server in front of the runtime."""
