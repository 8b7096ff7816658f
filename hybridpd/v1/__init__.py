"""Generated gRPC code for proto/hybridpd/v1 (run `make proto`; do not edit)."""
